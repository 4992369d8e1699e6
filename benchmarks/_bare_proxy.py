"""The least a proxy on this host's loop can add: what any Python gateway pays for the hop.

uvloop, httptools both ways, each client connection with its own kept-alive upstream
connection; a request's bytes go upstream as they came and the reply's bytes come back as
they came (no JSON, no routing, no headers rewritten). ``bench_llm --features-phase`` puts it
beside the gateway in the same run: the gateway's added latency less this row's is the
gateway's own work, the rest is the extra hop (two more socket round trips and wakeups).

    python -m benchmarks._bare_proxy PORT UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop


class _Upstream(asyncio.Protocol):
    """The upstream connection: hands each whole reply's bytes to the waiting request."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.reply = bytearray()
        self.waiter: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reply += data
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        reply, self.reply = bytes(self.reply), bytearray()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(reply)


class _Front(asyncio.Protocol):
    """A client connection: each whole request goes upstream, its reply comes back."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.parser = httptools.HttpRequestParser(self)
        self.request = bytearray()
        self.up: _Upstream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.request += data
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        request, self.request = bytes(self.request), bytearray()
        asyncio.get_running_loop().create_task(self.forward(request))

    async def forward(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        if self.up is None:
            _, self.up = await loop.create_connection(_Upstream, "127.0.0.1", self.upstream_port)
        self.up.waiter = loop.create_future()
        self.up.transport.write(request)  # type: ignore[attr-defined]
        self.transport.write(await self.up.waiter)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.transport.close()


async def main(port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Front(upstream_port), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
