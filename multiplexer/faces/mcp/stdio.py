"""MCP over stdio (``multiplexer serve --stdio``), so a desktop MCP client can launch the gateway.

stdout carries only protocol frames: logs go to stderr, the SDK points fd 1 at
stderr while serving, and upstream children get their own pipes. The gateway
stops when the client closes stdin or on SIGTERM/SIGINT; closing it reaps every
upstream child. stdin is read by a daemon thread with ``os.read`` so a signal
can end the process even while a read is blocked.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream
from mcp import stdio_server

from multiplexer.faces.jobs import attach_jobs
from multiplexer.faces.mcp.server import McpFace
from multiplexer.gateway.config import Config
from multiplexer.gateway.gateway import Gateway

log = logging.getLogger(__name__)


class _Lines:
    """Async iteration over the lines of a byte stream fed by the reader thread."""

    def __init__(self, chunks: MemoryObjectReceiveStream[bytes]) -> None:
        self._chunks = chunks
        self._buffer = b""

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        while b"\n" not in self._buffer:
            try:
                self._buffer += await self._chunks.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if not self._buffer:
                    raise StopAsyncIteration from None
                line, self._buffer = self._buffer, b""
                return line.decode("utf-8", errors="replace")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace")


@asynccontextmanager
async def stdin_lines(fd: int = 0) -> AsyncIterator[_Lines]:
    send, receive = anyio.create_memory_object_stream[bytes](16)
    token = anyio.lowlevel.current_token()

    def pump() -> None:
        with suppress(Exception):  # the loop is gone or the fd closed: nothing left to feed
            while chunk := os.read(fd, 65536):
                anyio.from_thread.run(send.send, chunk, token=token)
        with suppress(Exception):
            anyio.from_thread.run_sync(send.close, token=token)

    threading.Thread(target=pump, name="multiplexer-stdin", daemon=True).start()
    with receive:
        yield _Lines(receive)


async def serve_stdio(config: Config) -> None:
    async with Gateway(config) as gateway:
        attach_jobs(gateway)
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
            async with stdin_lines(sys.stdin.fileno()) as lines, stdio_server(stdin=lines) as (  # type: ignore[arg-type]
                read_stream, write_stream
            ):
                log.info("multiplexer serving MCP on stdio")
                await server.run(read_stream, write_stream, server.create_initialization_options())
            tg.cancel_scope.cancel()
