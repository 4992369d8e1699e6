"""A small upstream MCP server for the default config's ``tools`` provider, tests and benchmarks
(built on the SDK's ``MCPServer``); shipped in the package, which ``default.yaml`` starts as a module.

Tools: ``echo`` and ``add`` (fast, read-only), ``sleep`` (slow, reports progress; ``stats``
counts running, cancelled and finished sleeps), ``fail`` (always fails), ``pid`` (the server's
process id, so tests can kill it), ``record`` (appends a token to a file: a side effect to
count), ``grow`` (adds a tool at run time and announces that the
tool list changed) and ``grow_catalog`` (adds a resource and a prompt, and announces both).
Resources: ``example://readme`` (text naming the server's process id, so
tests can tell two copies apart) and the template ``example://items/{item_id}``. Prompt:
``greet(name)``.

    python -m multiplexer.defaults.demo_tools                     # MCP over stdio
    python -m multiplexer.defaults.demo_tools --http --port 9002  # Streamable HTTP at /mcp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.prompts import Prompt
from mcp.server.mcpserver.resources import FunctionResource
from mcp.types import ToolAnnotations

READ_ONLY = ToolAnnotations(read_only_hint=True, idempotent_hint=True)

server = MCPServer("upstream-example", version="1.0", log_level="WARNING")


@server.tool(description="Returns the text it was given", annotations=READ_ONLY)
def echo(text: str) -> str:
    return text


@server.tool(description="Adds two numbers", annotations=READ_ONLY)
def add(a: int | float, b: int | float) -> int | float:
    return a + b


SLEEPS = {"running": 0, "cancelled": 0, "finished": 0}


@server.tool(description="Sleeps, reporting progress after each step; returns 'slept'")
async def sleep(seconds: float, ctx: Context, steps: int = 1) -> str:
    steps = max(1, steps)
    SLEEPS["running"] += 1
    try:
        for i in range(steps):
            await anyio.sleep(seconds / steps)
            await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
    except anyio.get_cancelled_exc_class():
        SLEEPS["cancelled"] += 1
        raise
    finally:
        SLEEPS["running"] -= 1
    SLEEPS["finished"] += 1
    return "slept"


@server.tool(description="Appends its token to the file at path: a side effect that must not run twice")
def record(token: str, path: str) -> str:
    with open(path, "a", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


@server.tool(description="Counts of sleep calls running, cancelled and finished")
def stats() -> dict[str, int]:
    return dict(SLEEPS)


@server.tool(description="Always fails with the given message")
def fail(message: str = "boom") -> str:
    raise ToolError(message)


@server.tool(description="This server's process id", annotations=READ_ONLY)
def pid() -> int:
    return os.getpid()


def shout(text: str) -> str:
    return text.upper()


@server.tool(description="Adds the tool 'shout' and announces that the tool list changed")
async def grow(ctx: Context) -> str:
    if all(t.name != "shout" for t in await server.list_tools()):
        server.add_tool(shout, description="Upper-cases its text", annotations=READ_ONLY)
    await ctx.notify_tools_changed()  # 2026-07-28 listeners
    with contextlib.suppress(Exception):  # no standalone channel on this connection: nothing to tell
        await ctx.request_context.session.send_tool_list_changed()  # handshake-era sessions
    return "grown"


def news() -> str:
    return "the catalog grew"


def farewell(name: str) -> str:
    return f"Goodbye, {name}."


@server.tool(description="Adds the resource example://news and the prompt 'farewell', and announces both")
async def grow_catalog(ctx: Context) -> str:
    if all(str(r.uri) != "example://news" for r in await server.list_resources()):
        server.add_resource(FunctionResource.from_function(news, uri="example://news", name="news",
                                                           mime_type="text/plain"))
        server.add_prompt(Prompt.from_function(farewell, description="Says goodbye"))
    await ctx.notify_resources_changed()  # 2026-07-28 listeners
    await ctx.notify_prompts_changed()
    session = ctx.request_context.session
    with contextlib.suppress(Exception):  # handshake-era sessions, where there is a standalone channel
        await session.send_resource_list_changed()
        await session.send_prompt_list_changed()
    return "grown"


@server.resource("example://readme", name="readme", description="About this server",
                 mime_type="text/plain")
def readme() -> str:
    return f"upstream-example, pid {os.getpid()}"


@server.resource("example://items/{item_id}", name="item", description="One item, by id",
                 mime_type="application/json")
def item(item_id: str) -> str:
    return json.dumps({"id": item_id, "label": f"item {item_id}"})


@server.prompt(description="Greets someone by name")
def greet(name: str) -> str:
    return f"Hello, {name}! Say something nice."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve Streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9002)
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host=args.host, port=args.port)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
