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
(waiting up to the pool timeout for one). Each connection is an asyncio protocol
(``connection.py`` says why: a stream costs loop iterations and syscalls per request),
so this transport runs on asyncio, the gateway's loop, and not on trio.

A reply already whole in the first read, or small (64 KiB) with its length
declared, comes back with its content and frees its connection at once (the hot
path); a longer one (a large file, a stream of server-sent events) comes back as
a stream that holds the connection until it is read to the end or closed. A
reply larger than ``max_response_bytes`` (per request: the ``max_response_bytes``
extension, ``None`` for no cap) fails instead of filling the memory.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import chain
from typing import NoReturn

import anyio
import httpx

from multiplexer.transport.connection import Conn, content_length
from multiplexer.transport.dial import dial, literal

_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_UNSAFE = re.compile(rb"[\r\n\0]")  # would split or end a header line
# A packed embeddings reply is the largest whole reply: 2,048 inputs of 3,072 floats as JSON
# text come to ~130 MB. Result files are read as streams, without a cap.
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024 * 1024

Origin = tuple[str, str, int]


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The upstream's reply is over the transport's size cap."""


@dataclass(slots=True)
class Reply:
    """A whole reply from ``Http1Transport.fetch``: header names are lower case."""

    status: int
    headers: list[tuple[bytes, bytes]]
    content: bytes


class Opened:
    """A reply from ``Http1Transport.open`` whose body is read as it comes: ``first`` is what
    came with its head, ``rest`` (None when that was all of it) holds the connection until it
    is read to the end or closed."""

    __slots__ = ("first", "headers", "rest", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], first: list[bytes],
                 rest: _Body | None) -> None:
        self.status, self.headers, self.first, self.rest = status, headers, first, rest

    async def __aiter__(self) -> AsyncIterator[bytes]:
        first, self.first = self.first, []
        for chunk in first:
            yield chunk
        if self.rest is not None:
            async for chunk in self.rest:
                yield chunk

    def connection(self) -> Conn | None:
        """The connection the rest of the body comes on, where nothing is left to read before it
        (what a relay of its bytes takes them from, ``Conn.relay``)."""
        return self.rest.connection if self.rest is not None and not self.first else None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        if self.rest is not None:
            await self.rest.aclose()


class _Stale(Exception):
    """A kept-alive connection closed before any reply byte: safe to resend on another."""


class Http1Transport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int = 100, verify: ssl.SSLContext | bool = True,
                 max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self._idle: dict[Origin, list[Conn]] = {}
        self._slots: dict[Origin, anyio.Semaphore] = {}
        self._max = max_connections
        self._cap = max_response_bytes
        self._ssl = verify if isinstance(verify, ssl.SSLContext) else _tls(verify)
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

    async def open(self, method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]],
                   body: bytes, timeouts: dict[str, float | None]) -> Opened:
        """A reply to read as it comes (server-sent events), with no size cap, for a request
        given as its parts as in ``fetch``: no httpx ``Request`` or ``Response``, whose stream
        layers cost a stream's first chunk tens of microseconds."""
        out = _wire(method, url.raw_path, headers, body, None)
        status, reply_headers, chunks, rest = await self._roundtrip(url, method, out, timeouts,
                                                                    None, None)
        return Opened(status, reply_headers, chunks, rest)

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
                conn.idle = False
                # Closed by the server (or sent stray bytes) while idle: the loop has said so,
                # or, before a request that must not be resent, the kernel says so first.
                if conn.closed or (method not in _IDEMPOTENT and conn.unread_end()):
                    conn.close()
                    continue
                try:
                    await _send_and_read_head(conn, method, request, out, timeouts)
                except _Stale:
                    continue  # the server closed a kept-alive connection: try the next one
                return self._exchange(conn, origin, slots, method, cap, request, timeouts)
            conn = await self._connect(origin, request, timeouts.get("connect"))
            try:
                await _send_and_read_head(conn, method, request, out, timeouts)
            except _Stale as e:
                raise httpx.RemoteProtocolError("server closed the connection without a reply",
                                                request=request) from e
            return self._exchange(conn, origin, slots, method, cap, request, timeouts)
        except BaseException:
            slots.release()
            raise

    async def _connect(self, origin: Origin, request: httpx.Request | None,
                       timeout: float | None) -> Conn:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self._ssl if scheme == "https" else None
        try:
            with anyio.fail_after(timeout):
                address = literal(host)
                if address is not None:  # one address, nothing to race: the loop connects it itself
                    _, conn = await loop.create_connection(
                        lambda: Conn(loop), address[1], port, ssl=tls,
                        server_hostname=host if tls is not None else None)
                    return conn
                sock = await dial(host, port)  # the host's addresses raced (RFC 8305)
                try:
                    _, conn = await loop.create_connection(
                        lambda: Conn(loop), sock=sock, ssl=tls,
                        server_hostname=host if tls is not None else None)
                except BaseException:
                    sock.close()
                    raise
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out",
                                       request=request) from None
        except (OSError, ssl.SSLError) as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}", request=request) from None
        return conn

    def _exchange(self, conn: Conn, origin: Origin, slots: anyio.Semaphore, method: str,
                  cap: int | None, request: httpx.Request | None,
                  timeouts: dict[str, float | None]
                  ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], _Body | None]:
        """The reply whose head is read: whole (its slot released here), or as a stream."""
        try:
            if method == "HEAD":  # no body follows, whatever the length says
                conn.done, conn.stray = True, True
            declared = content_length(conn.headers)
            chunks = conn.take()
            length = declared or sum(len(c) for c in chunks)
            if cap is not None and length > cap:
                raise ResponseTooLarge(f"upstream reply of {length} bytes is over the "
                                       f"{cap}-byte cap", request=request)
        except BaseException:
            conn.close()
            raise
        status, headers = conn.status, conn.headers
        if conn.done:
            self._release(conn, origin, slots)
            return status, headers, chunks, None
        rest = _Body(self, conn, origin, slots, request, timeouts.get("read"), cap, chunks)
        return status, headers, [], rest

    def _release(self, conn: Conn | None, origin: Origin, slots: anyio.Semaphore) -> None:
        """Hand the slot back; a connection that ended its reply cleanly is kept alive."""
        slots.release()
        if conn is None:
            return
        if conn.reusable() and not self._closed:
            conn.reset()
            conn.idle = True
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        conns = [c for stack in self._idle.values() for c in stack]
        self._idle.clear()
        for conn in conns:
            conn.close()


class _Body(httpx.AsyncByteStream):
    """The rest of a reply, read as the caller asks for it; owns the connection until done."""

    def __init__(self, transport: Http1Transport, conn: Conn, origin: Origin,
                 slots: anyio.Semaphore, request: httpx.Request | None,
                 read_timeout: float | None, cap: int | None, first: list[bytes]) -> None:
        self._transport, self._origin, self._slots = transport, origin, slots
        self._conn: Conn | None = conn  # None once handed back
        self._request, self._timeout, self._cap = request, read_timeout, cap
        self._first, self._seen = first, sum(len(c) for c in first)
        self._delimited = content_length(conn.headers) is None and not any(
            name == b"transfer-encoding" for name, _ in conn.headers)  # ends when it closes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        first, self._first = self._first, []
        for chunk in first:
            yield chunk
        while (conn := self._conn) is not None:
            if chunks := conn.take():
                for chunk in chunks:
                    self._seen += len(chunk)
                    if self._cap is not None and self._seen > self._cap:
                        self._end(keep=False)
                        raise ResponseTooLarge(f"upstream reply is over the {self._cap}-byte "
                                               "cap", request=self._request)
                    yield chunk
                continue  # more may have come (and reading paused) while the caller had these
            if conn.done:
                self._end(keep=True)
                return
            try:
                if conn.failed is not None or conn.lost is not None:
                    _broken(conn, self._request)
                if conn.closed:
                    if not self._delimited:
                        raise httpx.ReadError("upstream closed the connection mid-reply",
                                              request=self._request)
                    conn.done = conn.stray = True  # the close was the end of this reply
                    continue
                conn.arm(self._timeout)
                await conn.wait()
                if conn.expired:
                    raise httpx.ReadTimeout("upstream did not answer in time",
                                            request=self._request)
            except BaseException:
                self._end(keep=False)
                raise
            finally:
                conn.disarm()

    @property
    def connection(self) -> Conn | None:
        """The connection the rest is read from, until it is handed back."""
        return self._conn

    def _end(self, keep: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if not keep:
                conn.stray = True  # never reused
            self._transport._release(conn, self._origin, self._slots)

    async def aclose(self) -> None:
        # a reply read to its end (a stream that stopped at its last event, the body's end
        # already parsed) leaves the connection at a clean boundary: kept alive, not dialled anew
        conn = self._conn
        self._end(keep=conn is not None and conn.done and not conn.failed)


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
        lines += (name, b": ", value, b"\r\n")
    if _UNSAFE.search(b"".join(chain.from_iterable(headers))):  # one search over names and values
        name = next(n for n, v in headers if _UNSAFE.search(n) or _UNSAFE.search(v))
        raise httpx.LocalProtocolError(f"header {name!r} holds a line break or NUL",
                                       request=request)
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


async def _send_and_read_head(conn: Conn, method: str, request: httpx.Request | None, out: bytes,
                              timeouts: dict[str, float | None]) -> None:
    """Write the request and wait for the reply's head (with the whole reply, when small);
    the connection is closed on any failure."""
    conn.head_only = method == "HEAD"
    try:
        if not conn.send(out):  # one write per request
            raise _Stale
        if conn.write_paused:  # more than the transport buffers: wait until it drains
            conn.arm(timeouts.get("write"))
            while conn.write_paused:
                if conn.expired:
                    raise httpx.WriteTimeout("upstream did not take the request in time",
                                             request=request)
                await conn.wait()
            if conn.closed and not conn.got:
                raise _Stale
        conn.arm(timeouts.get("read"))
        while True:
            if conn.failed is not None:
                _broken(conn, request)
            if conn.ready():
                return
            if conn.closed:
                # Closed after our request went out: it may have run (a crash or reset
                # mid-call), so resend only what HTTP calls idempotent; a POST is not.
                if not conn.got and method in _IDEMPOTENT:
                    raise _Stale
                _broken(conn, request)
            if conn.expired:
                raise httpx.ReadTimeout("upstream did not answer in time", request=request)
            await conn.wait()
    except BaseException:
        conn.close()
        raise
    finally:
        conn.disarm()


def _broken(conn: Conn, request: httpx.Request | None) -> NoReturn:
    """Raise why the connection failed as the httpx exception callers classify."""
    if conn.failed is not None:
        raise httpx.RemoteProtocolError(f"malformed reply from upstream: {conn.failed}",
                                        request=request)
    why = f": {type(conn.lost).__name__}: {conn.lost}" if conn.lost is not None else ""
    raise httpx.ReadError(f"upstream closed the connection{why}", request=request)


def _tls(verify: bool) -> ssl.SSLContext:
    """The system's trust store, or (``verify=False``, as httpx means it) no checks at all."""
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
