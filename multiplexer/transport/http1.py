"""An httpx transport for hot upstream paths: HTTP/1.1 keep-alive, httptools' parser, no pool lock.

Why: on this project's 2-core reference machine httpx's default transport costs
~0.5 ms per request (two socket writes per request, anyio stream wrappers, and a
pool that scans every connection on each request), more than the gateway's whole
latency budget; ``benchmarks/bench_llm.py --transport`` measures the two side by
side. The reply is parsed by httptools (llhttp, the C parser uvicorn uses, already
a dependency): h11, pure Python, was a third of the provider path's CPU. This
transport keeps the httpx API (``Client``, ``Request``, ``Response``, timeouts,
exception types); it replaces the connection layer: one write per request, an
idle-connection stack per origin, at most ``max_connections`` open per origin
(waiting up to the pool timeout for one).

A reply already whole in the first read, or small (64 KiB) with its length
declared, comes back with its content and frees its connection at once (the hot
path); a longer one (a large file, a stream of server-sent events) comes back as
a stream that holds the connection until it is read to the end or closed. A
reply larger than ``max_response_bytes`` (per request: the ``max_response_bytes``
extension, ``None`` for no cap) fails instead of filling the memory.
"""

from __future__ import annotations

import contextlib
import math
import re
import select
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NoReturn

import anyio
import anyio.abc
import httptools
import httpx

_BROKEN = (anyio.BrokenResourceError, anyio.EndOfStream, anyio.ClosedResourceError,
           ConnectionError)
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_UNSAFE = re.compile(rb"[\r\n\0]")  # would split or end a header line
# A packed embeddings reply is the largest whole reply: 2,048 inputs of 3,072 floats as JSON
# text come to ~130 MB. Result files are read as streams, without a cap.
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024 * 1024
_READ = 65536

Origin = tuple[str, str, int]


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The upstream's reply is over the transport's size cap."""


@dataclass(slots=True)
class Reply:
    """A whole reply from ``Http1Transport.fetch``: header names are lower case."""

    status: int
    headers: list[tuple[bytes, bytes]]
    content: bytes


class _Stale(Exception):
    """A kept-alive connection closed before any reply byte: safe to resend on another."""


class _Conn:
    """One connection and the reply being read on it (httptools calls the ``on_*`` methods)."""

    __slots__ = ("chunks", "done", "headers", "keep", "parser", "raw", "status", "stray", "stream")
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes]

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.raw: socket.socket | None = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        self.parser = httptools.HttpResponseParser(self)
        self.stray = False  # bytes past the end of a reply: not reusable
        self.reset()

    def reset(self) -> None:
        self.status, self.headers, self.chunks = 0, [], []
        self.done = self.keep = False

    def feed(self, data: bytes, request: httpx.Request | None) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            raise httpx.RemoteProtocolError(f"malformed reply from upstream: {e}",
                                            request=request) from None

    def take(self) -> list[bytes]:
        chunks, self.chunks = self.chunks, []
        return chunks

    # -- httptools callbacks ---------------------------------------------------
    def on_message_begin(self) -> None:
        if self.done:
            self.stray = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if not self.done:
            self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.done:
            return
        if 100 <= self.status < 200:  # 100 Continue and the like: the real reply follows
            self.status, self.headers = 0, []
            return
        self.done, self.keep = True, self.parser.should_keep_alive()  # not known after this

    def reusable(self) -> bool:
        return self.done and self.keep and not self.stray


class Http1Transport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int = 100, verify: ssl.SSLContext | bool = True,
                 max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self._idle: dict[Origin, list[_Conn]] = {}
        self._slots: dict[Origin, anyio.Semaphore] = {}
        self._max = max_connections
        self._cap = max_response_bytes
        self._ssl = verify if isinstance(verify, ssl.SSLContext) else (
            ssl.create_default_context() if verify else None)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        out = await _serialize(request)
        cap = request.extensions.get("max_response_bytes", self._cap)
        status, headers, chunks, rest = await self._roundtrip(
            request.url, request.method, out, request.extensions.get("timeout", {}), cap, request)
        extensions = {"http_version": b"HTTP/1.1"}
        if rest is None:
            return httpx.Response(status, headers=headers, content=b"".join(chunks),
                                  request=request, extensions=extensions)
        return httpx.Response(status, headers=headers, stream=rest, request=request,
                              extensions=extensions)

    async def fetch(self, method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]],
                    body: bytes, timeouts: dict[str, float | None]) -> Reply:
        """A whole reply, read under the size cap, for a request given as its parts: the hot
        path skips building httpx's ``Request`` and ``Response`` (a sixth of its CPU).
        ``headers`` must include ``host`` and ``content-length``."""
        out = _wire(method, url.raw_path, headers, body, None)
        status, reply_headers, chunks, rest = await self._roundtrip(url, method, out, timeouts,
                                                                    self._cap, None)
        if rest is not None:
            chunks = [chunk async for chunk in rest]
        return Reply(status, reply_headers, b"".join(chunks))

    async def _roundtrip(self, url: httpx.URL, method: str, out: bytes,
                         timeouts: dict[str, float | None], cap: int | None,
                         request: httpx.Request | None
                         ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], _Body | None]:
        """Status, headers, and the body: whole, or (when longer) as a stream that owns the
        connection until read or closed."""
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        slots = self._slots.get(origin)
        if slots is None:
            slots = self._slots[origin] = anyio.Semaphore(self._max)
        await _acquire(slots, timeouts.get("pool"), request)
        try:
            idle = self._idle.setdefault(origin, [])
            while idle:
                conn = idle.pop()
                if _closed_by_peer(conn):
                    await _close(conn)
                    continue
                try:
                    return await self._exchange(conn, origin, slots, method, out, timeouts, cap,
                                                request)
                except _Stale:
                    continue  # the server closed a kept-alive connection: try the next one
            conn = await self._connect(origin, request, timeouts.get("connect"))
            return await self._exchange(conn, origin, slots, method, out, timeouts, cap, request,
                                        fresh=True)
        except BaseException:
            slots.release()
            raise

    async def _connect(self, origin: Origin, request: httpx.Request | None,
                       timeout: float | None) -> _Conn:
        scheme, host, port = origin
        stream: anyio.abc.ByteStream
        try:
            with anyio.fail_after(timeout):
                if scheme == "https":
                    stream = await anyio.connect_tcp(host, port, tls=True, ssl_context=self._ssl,
                                                     tls_standard_compatible=False)
                else:
                    stream = await anyio.connect_tcp(host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out",
                                       request=request) from None
        except (OSError, anyio.BrokenResourceError, ssl.SSLError) as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}", request=request) from None
        conn = _Conn(stream)
        if conn.raw is not None:
            conn.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    async def _exchange(self, conn: _Conn, origin: Origin, slots: anyio.Semaphore, method: str,
                        out: bytes, timeouts: dict[str, float | None], cap: int | None,
                        request: httpx.Request | None, fresh: bool = False
                        ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], _Body | None]:
        """Send the request and read the head; a slot is released here only for a whole reply."""
        try:
            await _send_and_read_head(conn, method, request, out, timeouts)
            if method == "HEAD":  # no body follows, whatever the length says
                conn.done, conn.stray = True, True
            declared = _content_length(conn.headers)
            if not conn.done and declared is not None and declared <= _READ:
                await _read_rest(conn, request, timeouts.get("read"))
            chunks = conn.take()
            length = declared or sum(len(c) for c in chunks)
            if cap is not None and length > cap:
                raise ResponseTooLarge(f"upstream reply of {length} bytes is over the "
                                       f"{cap}-byte cap", request=request)
        except _Stale as e:
            await _close(conn)
            if not fresh:
                raise
            raise httpx.RemoteProtocolError("server closed the connection without a reply",
                                            request=request) from e
        except BaseException as e:
            await _close(conn)
            _reraise(e, request)
        status, headers = conn.status, conn.headers
        if conn.done:
            await self._release(conn, origin, slots)
            return status, headers, chunks, None
        rest = _Body(self, conn, origin, slots, request, timeouts.get("read"), cap, chunks)
        return status, headers, [], rest

    async def _release(self, conn: _Conn | None, origin: Origin, slots: anyio.Semaphore) -> None:
        """Hand the slot back; a connection that ended its reply cleanly is kept alive."""
        slots.release()
        if conn is None:
            return
        if conn.reusable() and not self._closed:
            conn.reset()
            self._idle.setdefault(origin, []).append(conn)
        else:
            await _close(conn)

    async def aclose(self) -> None:
        self._closed = True
        conns = [c for stack in self._idle.values() for c in stack]
        self._idle.clear()
        for conn in conns:
            await _close(conn)


class _Body(httpx.AsyncByteStream):
    """The rest of a reply, read as the caller asks for it; owns the connection until done."""

    def __init__(self, transport: Http1Transport, conn: _Conn, origin: Origin,
                 slots: anyio.Semaphore, request: httpx.Request | None,
                 read_timeout: float | None, cap: int | None, first: list[bytes]) -> None:
        self._transport, self._origin, self._slots = transport, origin, slots
        self._conn: _Conn | None = conn  # None once handed back
        self._request, self._timeout, self._cap = request, read_timeout, cap
        self._first, self._seen = first, sum(len(c) for c in first)
        self._delimited = _content_length(conn.headers) is None and not any(
            name == b"transfer-encoding" for name, _ in conn.headers)  # ends when it closes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        first, self._first = self._first, []
        for chunk in first:
            yield chunk
        while (conn := self._conn) is not None:
            if conn.done:
                await self._end(keep=True)
                return
            try:
                with anyio.fail_after(self._timeout):
                    data = await conn.stream.receive(_READ)
                conn.feed(data, self._request)
            except anyio.EndOfStream:
                if not self._delimited:
                    await self._end(keep=False)
                    raise httpx.ReadError("upstream closed the connection mid-reply",
                                          request=self._request) from None
                conn.done, conn.stray = True, True  # the close was the end of this reply
            except BaseException as e:
                await self._end(keep=False)
                _reraise(e, self._request)
            for chunk in conn.take():
                self._seen += len(chunk)
                if self._cap is not None and self._seen > self._cap:
                    await self._end(keep=False)
                    raise ResponseTooLarge(f"upstream reply is over the {self._cap}-byte cap",
                                           request=self._request)
                yield chunk

    async def _end(self, keep: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if not keep:
                conn.stray = True  # never reused
            await self._transport._release(conn, self._origin, self._slots)

    async def aclose(self) -> None:
        await self._end(keep=False)


async def _serialize(request: httpx.Request) -> bytes:
    """The request as it goes on the wire, in one piece (one write)."""
    try:
        body = request.content
    except httpx.RequestNotRead:  # a multipart upload: read it whole, it goes in one write
        body = await request.aread()
        if "transfer-encoding" in request.headers:
            del request.headers["transfer-encoding"]
            request.headers["content-length"] = str(len(body))
    return _wire(request.method, request.url.raw_path, request.headers.raw, body, request)


def _wire(method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
          request: httpx.Request | None) -> bytes:
    lines = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if _UNSAFE.search(name) or _UNSAFE.search(value):
            raise httpx.LocalProtocolError(f"header {name!r} holds a line break or NUL",
                                           request=request)
        lines += (name, b": ", value, b"\r\n")
    lines += (b"\r\n", body)
    return b"".join(lines)


async def _acquire(slots: anyio.Semaphore, timeout: float | None,
                   request: httpx.Request | None) -> None:
    try:
        slots.acquire_nowait()
        return
    except anyio.WouldBlock:
        pass
    try:
        with anyio.fail_after(timeout):
            await slots.acquire()
    except TimeoutError:
        raise httpx.PoolTimeout("no upstream connection came free in time",
                                request=request) from None


async def _send_and_read_head(conn: _Conn, method: str, request: httpx.Request | None, out: bytes,
                              timeouts: dict[str, float | None]) -> None:
    got_bytes, writing = False, True
    # one cancel scope for the exchange, its deadline moved from the write to the read
    with anyio.CancelScope(deadline=_deadline(timeouts.get("write"))) as scope:
        try:
            await conn.stream.send(out)  # one write per request
        except _BROKEN:
            raise _Stale from None
        writing = False
        scope.deadline = _deadline(timeouts.get("read"))
        while not conn.status:
            try:
                data = await conn.stream.receive(_READ)
            except _BROKEN:
                # Closed after our request went out: it may have run (a crash or reset
                # mid-call), so resend only what HTTP calls idempotent; a POST is not.
                if not got_bytes and method in _IDEMPOTENT:
                    raise _Stale from None
                raise
            got_bytes = True
            conn.feed(data, request)
        return
    if writing:
        raise httpx.WriteTimeout("upstream did not take the request in time", request=request)
    raise httpx.ReadTimeout("upstream did not answer in time", request=request)


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else anyio.current_time() + timeout


async def _read_rest(conn: _Conn, request: httpx.Request | None, timeout: float | None) -> None:
    """The rest of a small reply whose head came alone (servers often write them apart)."""
    with anyio.fail_after(timeout):
        while not conn.done:
            conn.feed(await conn.stream.receive(_READ), request)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _reraise(e: BaseException, request: httpx.Request | None) -> NoReturn:
    """Raise a transport failure as the httpx exception callers classify; others unchanged."""
    if isinstance(e, TimeoutError):
        raise httpx.ReadTimeout("upstream did not answer in time", request=request) from None
    if isinstance(e, _BROKEN):
        raise httpx.ReadError(f"{type(e).__name__}: {e}", request=request) from None
    raise e


def _closed_by_peer(conn: _Conn) -> bool:
    """An idle connection with something to read (the server's FIN, or stray bytes) is done."""
    raw = conn.raw
    if raw is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(raw.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([raw], [], [], 0)[0])  # Windows has no poll
    except (OSError, ValueError):
        return True


async def _close(conn: _Conn) -> None:
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(Exception):
            await conn.stream.aclose()
