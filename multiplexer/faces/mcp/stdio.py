"""MCP over stdio (``multiplexer serve --stdio``), so a desktop MCP client can launch the gateway.

stdout carries only protocol frames: logs go to stderr, the SDK points fd 1 at
stderr while serving, and upstream children get their own pipes. The gateway
stops when the client closes stdin or on SIGTERM/SIGINT; closing it reaps every
upstream child. stdin is read by a daemon thread with ``os.read`` so a signal
can end the process even while a read is blocked. SIGHUP reads the config file again
(``gateway/reload.py``, as ``serve`` does); the client is told the tools changed.
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
from multiplexer.gateway import heap
from multiplexer.gateway.config import Config
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.reload import ConfigReloader

log = logging.getLogger(__name__)


class Lines:
    """Async iteration over the lines of a byte stream fed by the reader thread.

    A line longer than ``max_line`` bytes (``server.max_body_bytes``) is dropped with a
    warning, as /rpc and /mcp refuse such a body, instead of growing the buffer without bound.
    """

    def __init__(self, chunks: MemoryObjectReceiveStream[bytes], max_line: int) -> None:
        self._chunks = chunks
        self._max = max_line
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already known to hold no newline
        self._dropping = False  # inside an oversized line: skip to its end

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> str:
        while True:
            end = self._buffer.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[:end + 1]
                self._scanned = 0
                if self._dropping:
                    self._dropping = False
                    continue
                return line.decode("utf-8", errors="replace")
            self._scanned = len(self._buffer)
            if self._scanned > self._max:
                if not self._dropping:
                    log.warning("stdin: a message over %d bytes was dropped (server.max_body_bytes)",
                                self._max)
                self._dropping = True
                self._buffer.clear()
                self._scanned = 0
            try:
                self._buffer += await self._chunks.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if not self._buffer or self._dropping:
                    raise StopAsyncIteration from None
                line = bytes(self._buffer)
                self._buffer.clear()
                return line.decode("utf-8", errors="replace")


@asynccontextmanager
async def stdin_lines(fd: int = 0, max_line: int = 8 * 1024 * 1024) -> AsyncIterator[Lines]:
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
        yield Lines(receive, max_line)


async def serve_stdio(config: Config) -> None:
    async with Gateway(config) as gateway:
        attach_jobs(gateway)
        reloader = gateway.faces["reloader"] = ConfigReloader(gateway, config.source)  # SIGHUP
        face = McpFace(gateway)
        server = face.server
        heap.serving(gateway)
        async with face.running(), anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                    async for sig in signals:
                        if sig == signal.SIGHUP:
                            log.info("received SIGHUP: reloading the config")
                            gateway.start_background(reloader.reload, "sighup")
                            continue
                        log.info("received %s: stopping", signal.Signals(sig).name)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(stop_on_signal)
            max_line = config.server.max_body_bytes
            async with stdin_lines(sys.stdin.fileno(), max_line) as lines, \
                    stdio_server(stdin=lines) as (read_stream, write_stream):  # type: ignore[arg-type]
                log.info("multiplexer serving MCP on stdio")
                await server.run(read_stream, write_stream, server.create_initialization_options())
            tg.cancel_scope.cancel()
