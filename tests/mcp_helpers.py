"""Shared pieces for the MCP tests: real upstream processes, gateway configs, process accounting."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import mcp_types as types
import psutil
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server
from mcp_types import TextContent

from multiplexer.core.call import Call
from multiplexer.gateway.gateway import Gateway

MODERN = "2026-07-28"
ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = str(ROOT / "multiplexer" / "defaults" / "demo_tools.py")
ERA_UPSTREAM = str(ROOT / "tests" / "era_upstream.py")


def stdio_upstream(**extra: Any) -> dict[str, Any]:
    return {"kind": "mcp", "command": "python", "args": [UPSTREAM], "restart_backoff_ms": 20,
            "limits": {"concurrency": 256}, **extra}


def http_upstream(url: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "mcp", "url": url, "restart_backoff_ms": 20, "limits": {"concurrency": 256},
            **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"upstream exited with {proc.returncode}")
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.05)
                continue
            await stream.aclose()
            return


class HttpUpstream:
    """``multiplexer/defaults/demo_tools.py --http`` as a real child process that tests may kill and
    restart."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, UPSTREAM, "--http", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await wait_listening(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class EraServer:
    """``tests/era_upstream.py --http`` on one port, restartable on either SDK major."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, python: str) -> None:
        self.stop()
        self.proc = subprocess.Popen([python, ERA_UPSTREAM, "--http", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await wait_listening(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@asynccontextmanager
async def http_upstream_process() -> AsyncIterator[HttpUpstream]:
    upstream = HttpUpstream()
    await upstream.start()
    try:
        yield upstream
    finally:
        upstream.stop()


MODES = {"auto": "2026-07-28", "legacy": "2025-11-25"}  # client mode -> the revision it speaks


@asynccontextmanager
async def mcp_http_client(url: str, mode: str = "auto", key: str | None = None,
                          **kw: Any) -> AsyncIterator[Client]:
    """The SDK's client on Streamable HTTP (bearer ``key`` if given), with long timeouts for slow tools."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode, **kw) as client,
    ):
        yield client


async def grow_and_hear_it(client: Client, changed: anyio.Event, tool: str = "tools_grow") -> str:
    """Call ``tool`` (a ``grow``) and wait until the client hears the tool list changed: on a listen
    stream at 2026-07-28, in band (``changed``, set by its message handler) on handshake-era revisions.
    Returns the tool's text."""
    if client.protocol_version == "2026-07-28":
        async with client.listen(tools_list_changed=True) as subscription:
            result = await client.call_tool(tool, {})
            with anyio.fail_after(10):
                async for _event in subscription:
                    break
    else:
        result = await client.call_tool(tool, {})
        with anyio.fail_after(10):
            await changed.wait()
    text = result.content[0]
    return text.text if isinstance(text, TextContent) else ""


TASKS = "io.modelcontextprotocol/tasks"


class McpHttp:
    """One 2026-07-28 client key over plain HTTP: the envelope, the routing headers, SSE or JSON."""

    def __init__(self, http: httpx.AsyncClient, url: str, key: str | None, *, tasks: bool = True) -> None:
        self.http, self.url, self.key, self.tasks = http, url, key, tasks

    async def send(self, method: str, params: dict[str, Any], name: str | None = None) -> dict[str, Any]:
        caps: dict[str, Any] = {"extensions": {TASKS: {}}} if self.tasks else {}
        meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
                "io.modelcontextprotocol/clientCapabilities": caps}
        headers = {"MCP-Protocol-Version": MODERN, "Mcp-Method": method,
                   "Accept": "application/json, text/event-stream"}
        if self.key is not None:
            headers["Authorization"] = f"Bearer {self.key}"
        if name is not None:
            headers["Mcp-Name"] = name
        body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta}}
        r = await self.http.post(self.url, json=body, headers=headers)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            data = [line[5:] for line in r.text.splitlines() if line.startswith("data:")]
            return json.loads(data[-1])
        return r.json()

    async def call(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return await self.send("tools/call", {"name": tool, "arguments": arguments}, name=tool)

    async def task(self, method: str, task_id: str, name: str | None = "same") -> dict[str, Any]:
        return await self.send(method, {"taskId": task_id}, name=task_id if name == "same" else name)



def paginated_server(pages: int, per_page: int) -> Server[Any]:
    calls: dict[str, Any] = {"list": 0, "x-team": set()}

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        calls["list"] += 1
        calls["x-team"].add(ctx.request.headers.get("x-team"))
        page = int(params.cursor) if params and params.cursor else 0
        tools = [types.Tool(name=f"t{page}_{i}", input_schema={"type": "object"}) for i in range(per_page)]
        cursor = str(page + 1) if page + 1 < pages else None
        return types.ListToolsResult(tools=tools, next_cursor=cursor, ttl_ms=60_000)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(type="text", text=params.name)])

    async def list_resources(ctx: Any, params: types.PaginatedRequestParams | None
                             ) -> types.ListResourcesResult:
        notes = types.Resource(uri="paged://notes", name="notes")
        return types.ListResourcesResult(resources=[notes], ttl_ms=30_000)

    server: Server[Any] = Server("paged", on_list_tools=list_tools, on_call_tool=call_tool,
                                 on_list_resources=list_resources)
    server.calls = calls  # type: ignore[attr-defined]
    return server


def live_children() -> set[int]:
    """Descendants of this test process that are still running (zombies do not count)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def structured(outcome: Any) -> Any:
    """``structuredContent`` of a successful MCP-route outcome."""
    assert outcome.ok, outcome.error
    return outcome.result["structuredContent"]


async def call(gateway: Gateway, method: str, params: Any = None, **kw: Any) -> Any:
    return await gateway.submit(Call(method, params, **kw))


async def upstream_pid(gateway: Gateway, tool: str = "tools_pid") -> int:
    return int(structured(await call(gateway, tool, {}))["result"])


async def until_connected(gw: Any, names: Any, timeout: float = 60) -> None:
    """Start-up gives each MCP upstream ``connect_timeout_ms`` and goes on; a subprocess upstream on
    a loaded host (a legacy SDK's interpreter starting cold) can connect later than that."""

    async def connected() -> bool:
        return all(gw.providers[name].session.era for name in names)

    await wait_until(connected, timeout=timeout)


async def wait_until(predicate: Any, timeout: float = 10, poll: float = 0.02) -> None:
    """Poll an observable condition of a real subprocess (no event is available across processes)."""
    with anyio.fail_after(timeout):
        while not await predicate():
            await anyio.sleep(poll)
