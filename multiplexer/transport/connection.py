"""One upstream HTTP/1.1 connection: an asyncio ``Protocol`` that feeds httptools as bytes arrive.

Why a protocol, not anyio's ``SocketStream``: per request a stream's ``send`` runs two cancel
checkpoints (an extra event-loop iteration), each ``receive`` resumes and then pauses reading
(two epoll_ctl calls on uvloop) and waits on an ``Event``, and seeing that the server closed an
idle connection took a poll syscall. Here ``data_received`` parses each read at once, and the
task that sent the request wakes once: when the reply's head is parsed (with the whole reply
when it is small and of declared length), or the connection ends. A peer's close of an idle
connection is known from ``eof_received``/``connection_lost``; only before a request that must
not be resent (a POST) is the kernel asked too, with one poll on a poller made per connection:
asyncio's own loop runs a task woken in one iteration before that iteration's reads.
Reading pauses only as flow control, while a streamed body has more than ``HIGH_WATER`` bytes
unread; the request is one ``transport.write``, waited on only when the transport's buffer is
over its high-water mark. The gateway runs on asyncio (uvloop when installed), never trio:
callers' anyio cancel scopes cancel the task awaiting here, as they would a stream's.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from collections.abc import Callable
from typing import cast

import httptools

SMALL = 65536  # a reply of declared length up to this is read whole before its task wakes
HIGH_WATER = 1 << 20  # unread bytes of a streamed body that pause reading until it is drained


class Conn(asyncio.Protocol):
    """One connection and the reply being read on it (httptools calls the ``on_*`` methods).

    The task using it checks the state (``done``, ``status``, ``closed``, ``failed``,
    ``expired``, ``write_paused``) and calls ``wait`` until it changes."""

    __slots__ = ("chunks", "closed", "deadline", "done", "expired", "failed", "got", "head_only",
                 "headers", "idle", "keep", "loop", "lost", "parser", "poller", "read_paused", "relay",
                 "small", "status", "stray", "timeout", "timer", "timer_at", "transport", "unread",
                 "waiter", "write_paused")
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes]
    transport: asyncio.Transport

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.stray = False  # bytes past the end of a reply: not reusable
        self.idle = False  # in the pool between requests: any byte read makes it unusable
        self.closed = False  # by the peer, by an error, or by us
        self.lost: BaseException | None = None  # why it closed, when not at a clean end
        self.failed: str | None = None  # the parser's complaint about the reply
        self.head_only = False  # a reply to HEAD: no body follows, whatever its length says
        self.write_paused = self.read_paused = self.expired = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0  # when ``timer`` fires
        self.deadline: float | None = None  # when an armed wait expires (the loop's clock)
        self.timeout: float | None = None
        self.poller: select.poll | None = None
        # what takes a streamed body's bytes as they are read, while the task waits for them:
        # True when it took them all (the task is not woken), False to wake the task
        self.relay: Callable[[], bool] | None = None
        self.reset()

    def reset(self) -> None:
        self.relay = None
        self.status, self.headers, self.chunks = 0, [], []
        self.done = self.keep = self.got = self.small = False
        self.unread = 0

    def reusable(self) -> bool:
        return self.done and self.keep and not self.stray and not self.closed

    def unread_end(self) -> bool:
        """Whether the kernel holds bytes or an EOF for this idle connection that the loop has
        not delivered yet: a server that closed it an iteration ago (one poll syscall)."""
        try:
            return self.poller is not None and bool(self.poller.poll(0))
        except OSError:
            return True

    def ready(self) -> bool:
        """The head is here, and with it the whole reply when that is small."""
        return self.done or (self.status != 0 and not self.small)

    # -- the task's side -----------------------------------------------------------
    def send(self, data: bytes) -> bool:
        """Write the request (one write); False when the connection is gone."""
        transport = self.transport
        if self.closed or transport.is_closing():
            return False
        transport.write(data)
        return not transport.is_closing()  # a failed send closes it at once

    def take(self) -> list[bytes]:
        """The body bytes parsed so far; reading resumes if it was paused for them."""
        chunks, self.chunks = self.chunks, []
        self.unread = 0
        if self.read_paused:
            self.read_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()
        return chunks

    async def wait(self) -> None:
        """Until the state changes: bytes parsed, the writer drained, the end, or the timer."""
        self.waiter = waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    def arm(self, timeout: float | None) -> None:
        """Set ``expired`` (and wake the task) after ``timeout`` seconds; ``None``: never.

        A stream arms before every read: its timer is kept across them, and when it fires
        before the latest deadline it waits again for that one (a timer made and cancelled
        per chunk cost every open stream a few microseconds a chunk)."""
        self.expired, self.timeout = False, timeout
        if timeout is None:
            self.deadline = None
            return
        self.deadline = deadline = self.loop.time() + timeout
        if self.timer is not None:
            if self.timer_at <= deadline:
                return  # fires first, and waits on for this deadline
            self.timer.cancel()
        self.timer, self.timer_at = self.loop.call_at(deadline, self._expire), deadline

    def disarm(self) -> None:
        """No wait expires (a kept timer lapses when it fires)."""
        self.deadline = None

    def close(self) -> None:
        self.closed = self.stray = True
        self.disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        with contextlib.suppress(AttributeError):  # never connected
            self.transport.abort()  # no TLS close_notify: none was awaited before either

    def _expire(self) -> None:
        self.timer = None
        deadline = self.deadline
        if deadline is None:
            return
        if self.loop.time() < deadline:  # armed again since it was set: wait for that deadline
            self.timer, self.timer_at = self.loop.call_at(deadline, self._expire), deadline
            return
        self.deadline, self.expired = None, True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- asyncio's callbacks ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if hasattr(select, "poll"):  # not on Windows
                self.poller = select.poll()
                self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if self.idle or self.failed is not None:  # bytes nobody asked for: unusable
            self.close()
            return
        self.got = True
        waiting_head = self.status == 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.failed = str(e)
            self.stray = True
            self._wake()
            return
        if self.unread > HIGH_WATER and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        relay, waiter = self.relay, self.waiter
        if relay is not None and waiter is not None and not waiter.done() and self.chunks \
                and not self.done and relay():
            return  # every byte relayed while the task waits: nothing to wake it for
        if self.ready():
            self._wake()
        elif waiting_head and self.status and self.deadline is not None:
            self.arm(self.timeout)  # the rest of a small reply gets a read timeout of its own

    def eof_received(self) -> bool | None:
        self._end(None)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    def _end(self, exc: BaseException | None) -> None:
        if not self.closed:
            self.closed, self.lost = True, exc
        self.write_paused = False
        self._wake()

    # -- httptools' callbacks --------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.done:
            self.stray = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.done:
            return
        self.status = status = self.parser.get_status_code()
        if status >= 200 and not self.head_only:
            length = content_length(self.headers)
            self.small = length is not None and length <= SMALL

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.chunks.append(body)
            self.unread += len(body)

    def on_message_complete(self) -> None:
        if self.done:
            return
        if 100 <= self.status < 200:  # 100 Continue and the like: the real reply follows
            self.status, self.headers = 0, []
            return
        self.done, self.keep = True, self.parser.should_keep_alive()  # not known after this


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None
