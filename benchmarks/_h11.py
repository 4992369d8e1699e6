"""A lean HTTP/1.1 client connection (h11 over anyio) for load and fuzz runs.

Why not httpx here: its connection pool spends O(connections) per request
(``_assign_requests_to_connections``), so at 64 concurrent connections a client
process managed ~150 requests/s on this 2-core box where one h11 connection per
worker manages ~5,000/s. A fuzzer must also send header values and bodies that a
strict client would refuse to build. One ``Conn`` per worker: no pool, no locks.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass

import anyio
import h11


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    first_data_at: float = 0.0  # perf_counter when the first body bytes arrived (streams)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")


class Conn:
    """One keep-alive connection that reconnects when the server closes it."""

    def __init__(self, host: str, port: int, timeout: float = 30.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._stream: anyio.abc.SocketStream | None = None
        self._h11 = h11.Connection(h11.CLIENT)

    @classmethod
    def to(cls, base_url: str, timeout: float = 30.0) -> Conn:
        host, _, port = base_url.removeprefix("http://").rstrip("/").rpartition(":")
        return cls(host, int(port), timeout)

    async def _connect(self) -> anyio.abc.SocketStream:
        if self._stream is None:
            self._stream = await anyio.connect_tcp(self.host, self.port)
            raw = self._stream.extra(anyio.abc.SocketAttribute.raw_socket)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._h11 = h11.Connection(h11.CLIENT)
        return self._stream

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()

    async def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                      body: bytes = b"", *, chunked: bool = False) -> Reply:
        """Send one request and read its reply; raises on a transport failure or timeout.

        Never resends: a POST that reached the server may have run, and a soak counting
        answers must see a failure, not a silent second try. A kept-alive connection
        the server has closed is noticed (readable at EOF) and replaced before sending.
        """
        if self._stream is not None and self._peer_closed():
            await self.aclose()
        try:
            with anyio.fail_after(self.timeout):
                return await self._exchange(method, path, headers or {}, body, chunked)
        except BaseException:
            await self.aclose()
            raise

    def _peer_closed(self) -> bool:
        assert self._stream is not None
        raw = self._stream.extra(anyio.abc.SocketAttribute.raw_socket)
        poller = select.poll()
        poller.register(raw.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    async def _exchange(self, method: str, path: str, headers: dict[str, str], body: bytes,
                        chunked: bool) -> Reply:
        stream = await self._connect()
        conn = self._h11
        head = [("host", f"{self.host}:{self.port}"), *headers.items()]
        head.append(("transfer-encoding", "chunked") if chunked else ("content-length", str(len(body))))
        out = conn.send(h11.Request(method=method, target=path, headers=head))
        if chunked:
            for i in range(0, len(body), 16384):
                out += conn.send(h11.Data(data=body[i:i + 16384]))
        elif body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        try:
            await stream.send(out)
        except (anyio.BrokenResourceError, OSError):
            if not body:
                raise  # otherwise the server may have answered (413) and closed mid-body
        status, reply_headers, chunks, first = 0, {}, [], 0.0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive(65536))
                except anyio.EndOfStream:
                    conn.receive_data(b"")
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                reply_headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                first = first or time.perf_counter()
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()
        return Reply(status, reply_headers, b"".join(chunks), first)
