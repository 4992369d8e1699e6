"""uvicorn's httptools protocol with a disconnect hook in every request's scope, writes
joined per turn of the event loop, and direct calls of the hot endpoints.

Everything else (parsing, keep-alive, pipelining, flow control, shutdown) stays uvicorn's;
this adds ``scope["extensions"]["multiplexer.disconnect"]`` and fires it when the
connection is lost before the response is complete (see ``faces/disconnect.py``), and
hands uvicorn a transport whose writes in one turn of the loop leave as one: uvicorn
writes a response's head and its body separately, two sends and two wakeups of the
client for every answer.

A request to an endpoint with a ``direct`` method (``faces/reply.py``: ``POST /rpc``,
``POST /v1/embeddings``) whose body has a declared length within the endpoint's limit skips
ASGI: its task waits for the whole body, calls the endpoint and writes the reply in one send.
ASGI's receive and send messages, the app chain and a cancel scope per request were about a
fifth of the event loop's CPU per request (``benchmarks/bench_http_path.py``). The request's
cycle is uvicorn's own, so pipelining, keep-alive, shutdown and the disconnect hook treat it
as any other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from multiplexer.core.after import hold, release
from multiplexer.faces.access import REQUEST_ID, AccessLog, Note
from multiplexer.faces.body import headers_over
from multiplexer.faces.disconnect import CHUNK, DIRECT, FLUSH, HOOK, OnDisconnect
from multiplexer.faces.reply import DirectEndpoint, Reply

# An idle connection is closed this long after ``timeout_keep_alive`` (``server.keepalive_s``): the
# server's idle time starts when it sends a response, a client's when it has read it, so a client
# whose idle timeout equals the server's would otherwise reuse a connection the server is closing
# at that moment, and lose the request (a ReadError).
KEEPALIVE_GRACE_S = 1
_GONE = 499  # the status a line says for a client that went away before its answer
_ASGI = -1  # not answered: the endpoint handed the request back to the ASGI app
_FAILED = Reply(500, b"Internal Server Error", [(b"content-type", b"text/plain; charset=utf-8"),
                                                (b"connection", b"close")])


class JoinedWrites:
    """A transport whose writes wait for the end of the loop's current turn and leave together.

    A response's head and body, written one after the other, go out in one send (the
    client reads them in one wakeup); a streamed response's chunks still leave every turn.
    Everything but ``write`` and ``close`` is the transport's own."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():  # lost meanwhile: nobody to read it
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def write_now(self, data: bytes) -> None:
        """A whole response: out at once, after anything still held."""
        if self._pending:
            self._pending.append(data)
            self.flush()
        elif not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _chunk_writer(cycle: RequestResponseCycle, joined: JoinedWrites) -> Callable[[bytes], bool]:
    """A streamed response's chunk written as uvicorn's send would write it (chunked encoding,
    after anything the connection holds), without the ASGI message, the app's send wrappers and
    a callback at the turn's end, each paid per chunk by every open stream. False where
    uvicorn's own send must do it: no head sent yet, a body of known length, the response over,
    the client gone or reading slower than it is written (its flow control waits)."""

    def write(body: bytes) -> bool:
        if not cycle.response_started or not cycle.chunked_encoding or cycle.response_complete \
                or cycle.disconnected or cycle.flow.write_paused or cycle.scope["method"] == "HEAD":
            return False
        if body:  # an empty chunk would end a chunked body: there is nothing to write
            joined.write_now(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return write


class GatewayHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive += KEEPALIVE_GRACE_S
        self._owed: list[tuple[RequestResponseCycle, OnDisconnect]] = []  # requests still owed an answer
        # What the app says (its direct endpoints, header cap, access log) is read from it when a
        # request needs it, and the joined writes are the transport itself, not attributes of
        # their own: with ``_owed`` a connection has 29 attributes, and past 30 its attribute dict
        # stops sharing its keys with the other connections' (1,584 bytes, not 296, for each).

    @property
    def _direct(self) -> dict[tuple[str, str], DirectEndpoint]:
        """The app's endpoints to call directly, by (method, path)."""
        return getattr(self.app, "direct", {})  # type: ignore[no-any-return]

    @property
    def _max_header_bytes(self) -> int:
        """The app's header cap (it refuses longer headers itself, so such requests go to it)."""
        return getattr(self.app, "max_header_bytes", 0)  # type: ignore[no-any-return]

    @property
    def _access(self) -> AccessLog | None:
        """What notes direct requests."""
        return getattr(self.app, "access", None)

    @property
    def joined(self) -> JoinedWrites:
        return cast(JoinedWrites, self.transport)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = JoinedWrites(transport, self.loop)  # type: ignore[assignment]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions: dict[str, Any] = {HOOK: OnDisconnect(), FLUSH: self.joined.flush}
        self.scope["extensions"] = extensions  # type: ignore[typeddict-item]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # makes the request's cycle; its task has not run yet
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade: not ours to watch
        self._owed = [(c, h) for c, h in self._owed if not c.response_complete]
        extensions = _extensions(cycle)
        self._owed.append((cycle, extensions[HOOK]))
        extensions[CHUNK] = _chunk_writer(cycle, self.joined)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        owed, self._owed = self._owed, []
        for cycle, hook in owed:
            if not cycle.response_complete:
                hook.fire()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        endpoint = self._direct.get((cycle.scope["method"], cycle.scope["path"]))
        if endpoint is None or app is not self.app or not self._takes(cycle, endpoint):
            super()._start_asgi_task(cycle, app)
            return
        task = self.loop.create_task(_run_direct(cycle, endpoint, self.transport, self.logger,
                                                 self._access, app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        extensions = _extensions(cycle)
        extensions[DIRECT] = True  # the endpoint adds no cancel scope of its own
        extensions[HOOK].add(task.cancel)

    def _takes(self, cycle: RequestResponseCycle, endpoint: DirectEndpoint) -> bool:
        """A whole body of a declared length within the endpoint's limit, and headers the app
        would not refuse: every other request takes the ASGI path, which answers it."""
        headers = cast(list[tuple[bytes, bytes]], cycle.scope["headers"])
        length = next((v for k, v in headers if k == b"content-length"), b"")
        return (length.isdigit() and int(length) <= endpoint.limit
                and not cycle.waiting_for_100_continue
                and not headers_over(headers, self._max_header_bytes))


def _extensions(cycle: RequestResponseCycle) -> dict[str, Any]:
    """The request's scope extensions, where the protocol keeps its disconnect hook."""
    return cast(dict[str, Any], cycle.scope["extensions"])


async def _run_direct(cycle: RequestResponseCycle, endpoint: DirectEndpoint, transport: Any,
                      logger: logging.Logger, access: AccessLog | None, app: Any) -> None:
    """One request to a direct endpoint, noted by ``access`` as ``Access`` notes the others: its
    request id, its line and its count. One the endpoint hands back (``direct`` returned None:
    a stream) goes to ``app`` as any request would, and is noted there."""
    scope = cast(Scope, cycle.scope)
    note = access.begin(scope) if access is not None else None
    status = _GONE
    held = hold()  # the call's bookkeeping that can wait for its answer (core/after.py)
    try:
        status = await _serve_direct(cycle, endpoint, transport, logger, note)
    except asyncio.CancelledError:
        status = _GONE if cycle.disconnected else _FAILED.status
        raise
    finally:
        release(held)
        if access is not None and note is not None and status != _ASGI:
            access.end(scope, note, status)
    if status == _ASGI:  # as the server would have run it: the endpoint's own disconnect handling
        extensions = _extensions(cycle)
        extensions.pop(DIRECT, None)
        task = asyncio.current_task()
        if task is not None:
            extensions[HOOK].discard(task.cancel)
        cycle.message_event.set()  # the whole body is there for the app's first ``receive``
        await cycle.run_asgi(app)


async def _serve_direct(cycle: RequestResponseCycle, endpoint: DirectEndpoint, transport: Any,
                        logger: logging.Logger, note: Note | None) -> int:
    """Read the body, call the endpoint, answer; the status sent. As
    ``RequestResponseCycle.run_asgi`` does for an app, an exception is logged and answered 500,
    and so is a request the server cancels (a shutdown past its grace period); the connection
    then closes."""
    try:
        while cycle.more_body and not cycle.disconnected:
            cycle.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected:
            return _GONE
        reply = await endpoint.direct(cast(Scope, cycle.scope), bytes(cycle.body))
        if reply is None:
            return _ASGI  # the body stays in the cycle for the app's ``receive``
    except asyncio.CancelledError:
        if cycle.disconnected:
            return _GONE  # the client went away: its calls are cancelled, nobody is owed an answer
        _answer(cycle, _FAILED, transport, note)
        raise
    except Exception as exc:
        logger.error("Exception in ASGI application\n", exc_info=exc)
        reply = _FAILED
    _answer(cycle, reply, transport, note)
    return reply.status if cycle.response_complete else _GONE


def _answer(cycle: RequestResponseCycle, reply: Reply, transport: Any, note: Note | None) -> None:
    """Status line, headers and body in one write, then the cycle's end as uvicorn's send ends it."""
    if cycle.disconnected:
        return
    keep_alive = cycle.keep_alive and reply is not _FAILED
    head = [STATUS_LINE[reply.status]]
    if note is not None:
        head += (REQUEST_ID, b": ", note.rid, b"\r\n")
    for name, value in (*cycle.default_headers, *reply.head()):
        head += (name, b": ", value, b"\r\n")
    if not keep_alive and reply is not _FAILED:
        head.append(b"connection: close\r\n")
    head += (b"\r\n", reply.body)
    transport.write_now(b"".join(head))
    cycle.response_started = cycle.response_complete = True
    cycle.message_event.set()
    if not keep_alive:
        transport.close()
    cycle.on_response()
