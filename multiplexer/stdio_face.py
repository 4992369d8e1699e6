"""MCP over stdio (``multiplexer serve --stdio``), so a desktop MCP client can launch the gateway.

stdout carries only protocol frames: logs go to stderr, and upstream children
get their own pipes. The gateway stops when the client closes stdin or on
SIGTERM/SIGINT, and closing it reaps every upstream child.
"""

from __future__ import annotations

import logging
import signal

import anyio
from mcp import stdio_server

from .config import Config
from .gateway import Gateway
from .mcp_server import McpFace

log = logging.getLogger(__name__)


async def serve_stdio(config: Config) -> None:
    async with Gateway(config) as gateway:
        face = McpFace(gateway)
        server = face.server
        async with face.running(), anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for sig in signals:
                        log.info("received %s: stopping", signal.Signals(sig).name)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(stop_on_signal)
            async with stdio_server() as (read_stream, write_stream):
                log.info("multiplexer serving MCP on stdio")
                await server.run(read_stream, write_stream, server.create_initialization_options())
            tg.cancel_scope.cancel()
