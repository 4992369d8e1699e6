"""An upstream MCP server for the era matrix; the same file runs on ``mcp`` 1.x and 2.x.

On ``mcp`` 1.x (``FastMCP``) it speaks only the handshake eras (``initialize``);
on 2.x (``MCPServer``) it also speaks 2026-07-28. Its tools return every kind of
content a ``CallToolResult`` may carry, so a test can see each survive the
gateway's translation between the client's era and this server's.

    <python with mcp 1.x> tests/era_upstream.py                    # MCP over stdio
    <python with mcp 1.x> tests/era_upstream.py --http --port 9010  # Streamable HTTP at /mcp
"""

from __future__ import annotations

import base64
import contextlib
import os
import sys
from typing import Any

import anyio
import mcp.types as types

try:
    from mcp.server import MCPServer as App
    from mcp.server.mcpserver import Context
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import Context  # type: ignore[no-redef,attr-defined]
    from mcp.server.fastmcp import FastMCP as App

MAJOR = "2" if hasattr(types, "DiscoverResult") else "1"
SCHEME = f"era{MAJOR}"  # resource URIs are global: each SDK major's copy has its own
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n-era-").decode()
WAV = base64.b64encode(b"RIFF-era-WAVE").decode()
SLEEPS = {"running": 0, "cancelled": 0}
GROWN: list[str] = []

server = App("era-upstream")


def result(data: dict[str, Any]) -> types.CallToolResult:
    """Built from wire (camelCase) keys, which both SDK majors accept."""
    return types.CallToolResult.model_validate(data)


@server.tool(description="Returns the text it was given")
def echo(text: str) -> str:
    return text


@server.tool(description="Which SDK major runs this server")
def sdk() -> str:
    return MAJOR


def media_result(scheme: str) -> dict[str, Any]:
    """Every content kind, on the wire; the era matrix expects it back in the client's revision."""
    return {"content": [
        {"type": "text", "text": "all kinds"},
        {"type": "image", "data": PNG, "mimeType": "image/png"},
        {"type": "audio", "data": WAV, "mimeType": "audio/wav"},
        {"type": "resource", "resource": {"uri": f"{scheme}://notes/1", "mimeType": "text/plain",
                                          "text": "embedded"}},
        {"type": "resource_link", "uri": f"{scheme}://notes/2", "name": "notes-2", "mimeType": "text/plain"},
    ]}


@server.tool(description="Text, image, audio, an embedded resource and a resource link, in one result")
def media() -> types.CallToolResult:
    return result(media_result(SCHEME))


@server.tool(description="A result with structuredContent")
def structured(n: int) -> types.CallToolResult:
    return result({"content": [{"type": "text", "text": str(n * 2)}], "structuredContent": {"double": n * 2}})


@server.tool(description="A tool error (isError: true)")
def broken() -> types.CallToolResult:
    return result({"content": [{"type": "text", "text": "it broke"}], "isError": True})


@server.tool(description="Sleeps in steps, reporting progress and logging each")
async def slow(seconds: float, ctx: Context, steps: int = 1) -> str:  # type: ignore[type-arg]
    SLEEPS["running"] += 1
    try:
        for i in range(steps):
            await anyio.sleep(seconds / steps)
            await ctx.report_progress(i + 1, steps, f"step {i + 1}")
    except anyio.get_cancelled_exc_class():
        SLEEPS["cancelled"] += 1
        raise
    finally:
        SLEEPS["running"] -= 1
    return "done"


@server.tool(description="Counts of slow calls running and cancelled")
def counts() -> dict[str, int]:
    return dict(SLEEPS)


LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
SET_LEVEL: dict[str, str] = {}  # mcp 1.x: what logging/setLevel last asked for (2.x: per request)

if MAJOR == "1":  # a handshake-era server that offers logging/setLevel and honours it
    @server._mcp_server.set_logging_level()  # type: ignore[attr-defined,misc]
    async def set_level(level: str) -> None:
        SET_LEVEL["level"] = level


def asked_level(ctx: Any) -> str:
    """The level this call was asked to log at: its request's ``_meta`` (2026-07-28) or the
    session's ``logging/setLevel`` (handshake eras); "none" when nobody asked."""
    meta = getattr(ctx.request_context, "meta", None)
    if isinstance(meta, dict) and meta.get("io.modelcontextprotocol/logLevel"):
        return str(meta["io.modelcontextprotocol/logLevel"])
    return SET_LEVEL.get("level", "none")


async def log_at(ctx: Any, level: str, text: str) -> None:
    """``ctx.log`` where the level is asked for; 2.x filters per request itself."""
    floor = SET_LEVEL.get("level", "debug")
    if LOG_LEVELS.index(level) >= LOG_LEVELS.index(floor):
        await ctx.log(level, text, logger_name="era")


@server.tool(description="Logs '<tag> <level>' at debug, info, warning and error; returns the level "
                         "it was asked to log at")
async def chatty(tag: str, ctx: Context) -> str:  # type: ignore[type-arg]
    for level in ("debug", "info", "warning", "error"):
        await log_at(ctx, level, f"{tag} {level}")
    return asked_level(ctx)


@server.tool(description="Logs '<tag> start' (info), waits until the file at path exists, logs "
                         "'<tag> end' (warning)")
async def held(tag: str, path: str, ctx: Context) -> str:  # type: ignore[type-arg]
    await log_at(ctx, "info", f"{tag} start")
    while not os.path.exists(path):
        await anyio.sleep(0.01)
    await log_at(ctx, "warning", f"{tag} end")
    return tag


@server.tool(description="Exits the process at once (a crash, for restart tests)")
def crash() -> str:
    os._exit(1)


@server.tool(description="Adds a tool extra_<n> and announces that the tool list changed")
async def grow(ctx: Context) -> str:  # type: ignore[type-arg]
    GROWN.append(f"extra_{len(GROWN) + 1}")
    name = GROWN[-1]

    def extra() -> str:
        return name

    server.add_tool(extra, name=name, description="Added at run time")
    notify = getattr(ctx, "notify_tools_changed", None)
    if notify is not None:  # mcp 2.x: 2026-07-28 listeners
        await notify()
    with contextlib.suppress(Exception):  # handshake-era sessions: their standalone channel
        await ctx.request_context.session.send_tool_list_changed()
    return name


@server.resource(f"{SCHEME}://notes/1", name="notes-1", mime_type="text/plain")
def notes() -> str:
    return "first notes"


@server.resource(SCHEME + "://items/{item_id}", name="item", mime_type="text/plain")
def item(item_id: str) -> str:
    return f"item {item_id}"


@server.prompt(description="Asks about a topic")
def ask(topic: str) -> str:
    return f"Tell me about {topic}."


def main() -> None:
    if "--http" not in sys.argv:
        server.run("stdio")
        return
    port = int(sys.argv[sys.argv.index("--port") + 1])
    try:
        server.run("streamable-http", host="127.0.0.1", port=port)  # type: ignore[call-arg]
    except TypeError:  # mcp 1.x: host and port are settings
        server.settings.port = port  # type: ignore[attr-defined]
        server.run("streamable-http")


if __name__ == "__main__":
    main()
