"""The least a stream relay on this host's loop can cost: bytes passed through, nothing read.

Each client connection gets its own upstream connection, and every read on either side is
written to the other as it came (a TCP pass-through on uvloop, no HTTP parsed, no routing, no
usage counted). ``bench_streams`` runs it as a target beside the gateway in the same run: its
CPU per chunk is the two socket calls and the loop's wake-up that any Python relay pays per
chunk here, and its added first-chunk p99 is what the hop alone costs on this host at that
many streams (the rest of the gateway's is its own work).

    python -m benchmarks._bare_relay PORT UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import sys

import uvloop


class _Side(asyncio.Protocol):
    """One side of a pair: what it reads goes to ``peer``'s transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []  # read before the other side connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()


class _Client(_Side):
    def __init__(self, upstream: int) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(_Side, "127.0.0.1", self.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        up.peer, self.peer = self, up
        for data in self.early:
            up.transport.write(data)  # type: ignore[union-attr]
        self.early.clear()


async def serve(port: int, upstream: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), int(sys.argv[2])))
