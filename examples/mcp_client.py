"""Call the gateway with the MCP SDK's own client, over Streamable HTTP or stdio.

    multiplexer serve &                                   # then:
    python examples/mcp_client.py                         # http://127.0.0.1:8080/mcp, newest protocol
    python examples/mcp_client.py --legacy                # the initialize-handshake era
    python examples/mcp_client.py --stdio                 # launch `multiplexer serve --stdio` itself
    python examples/mcp_client.py --api-key KEY           # when server.api_keys is set
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx2
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from multiplexer.defaults import DEFAULT_CONFIG


async def main(args: argparse.Namespace) -> None:
    mode = "legacy" if args.legacy else "auto"
    async with AsyncExitStack() as stack:
        if args.stdio:
            target: Any = StdioServerParameters(
                command=sys.executable,
                args=["-m", "multiplexer", "serve", "--stdio", "--config", args.config],
            )
        else:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            http = await stack.enter_async_context(
                httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)))
            target = streamable_http_client(args.url, http_client=http)
        client = await stack.enter_async_context(Client(target, mode=mode))
        print(f"connected: protocol {client.protocol_version}")

        tools = (await client.list_tools()).tools
        print(f"{len(tools)} tools: {', '.join(t.name for t in tools)}")

        names = {t.name for t in tools}
        if "tools_add" in names:
            result = await client.call_tool("tools_add", {"a": 2, "b": 40})
            print(f"tools_add(2, 40) -> {result.structured_content}")

            async def progress(done: float, total: float | None, message: str | None) -> None:
                print(f"  progress {done}/{total}: {message}")

            result = await client.call_tool("tools_sleep", {"seconds": 0.3, "steps": 3},
                                            progress_callback=progress)
            print(f"tools_sleep -> {result.structured_content}")
            result = await client.call_tool("tools_fail", {"message": "on purpose"})
            print(f"tools_fail -> isError={result.is_error}: {result.content[0].text}")  # type: ignore[union-attr]
        if "sum" in names:
            result = await client.call_tool("sum", {"values": [1, 2, 3.5]})
            print(f"sum -> {result.structured_content}")
        try:
            await client.call_tool("no_such_tool", {})
        except MCPError as e:
            print(f"no_such_tool -> MCP error {e.code}: {e.message}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080/mcp")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--legacy", action="store_true", help="use the initialize handshake")
    parser.add_argument("--stdio", action="store_true", help="launch the gateway over stdio")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="config for --stdio")
    anyio.run(main, parser.parse_args())
