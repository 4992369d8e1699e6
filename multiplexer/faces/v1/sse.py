"""A streamed call as server-sent events.

The call goes through the gateway like any other (quota, lane slot, limits), with the face's
event writer as its sink: the provider's task writes each chunk as it comes. The response
starts only with the first chunk, so a call refused or failed before any output still gets its
proper status; a failure after that is an error event. A client that disconnects cancels the
call, and with it the upstream stream.

A stream's headers leave before its usage is known, so its cost cannot be a header. The event
that carries its final usage (OpenAI's usage chunk, Anthropic's ``message_delta``, the
Responses API's ``response.completed``) is held until the call is priced, with what follows
it (the stream's last events, microseconds later), and goes out with ``cost_usd`` (and
``saved_usd``) in its usage, as decimal strings like ``_meta.cost_usd``.

Where the face's events have the upstream's shape (OpenAI's ``data:`` lines to an OpenAI-shaped
provider, named events to Anthropic's or to the Responses API), the provider hands every event
it need not read as the upstream's own bytes (``raw``), written as they came: no JSON decoded
or encoded per chunk (``providers/sse_relay.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import anyio
from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import RpcError, internal_error
from multiplexer.core.responses_api import RESPONSE_ENDS
from multiplexer.faces.disconnect import CHUNK, FLUSH, cancelled_on_disconnect
from multiplexer.faces.v1.common import HttpError, Surface, http_error
from multiplexer.money.report import cost_meta

log = logging.getLogger(__name__)
Encode = Callable[[dict[str, Any]], bytes]
Chunk = dict[str, Any] | bytes  # bytes: an upstream's event as it came, in the face's own shape

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class _Events:
    """The face's end of a stream, written from the provider's own task as each chunk comes:
    no memory stream or forwarding task between them (they cost a stream's first chunk about
    60 µs). ``send_nowait`` (a provider that cannot await, as a local model's step callback)
    queues the chunk for a drain task, which ``flushed`` waits for; ``send`` keeps the order by
    draining first. A chunk the face cannot encode ends the stream: every later send raises
    ``BrokenResourceError``, which providers take as a reader gone."""

    __slots__ = ("_chunk", "_flush", "_send", "broken", "drainer", "encode", "headers", "held", "name",
                 "pending", "raw", "started")

    def __init__(self, send: Send, encode: Encode, headers: Callable[[], list[tuple[bytes, bytes]]],
                 name: str, flush: Callable[[], None] | None, raw: str | None = None,
                 chunk: Callable[[bytes], bool] | None = None) -> None:
        self._send = send
        self._flush = flush
        self._chunk = chunk  # the server's writer of a chunk after the head (``CHUNK``)
        self.encode = encode
        self.headers = headers
        self.name = name
        self.started = False
        self.raw = raw  # the shape of ``encode``'s events, when an upstream's in it go as they are
        self.broken: RpcError | None = None
        self.held: list[Chunk] = []  # the final usage event and what follows it, until priced
        # chunks handed over without waiting (``send_nowait``), made at the first: a deque is
        # 600 bytes, and most streams never queue one (a thousand open streams hold 0.6 MB less)
        self.pending: collections.deque[Chunk] | None = None
        self.drainer: asyncio.Task[None] | None = None

    async def send(self, chunk: Chunk) -> None:
        if self.drainer is not None:
            await self.flushed()
        await self._one(chunk)

    def send_nowait(self, chunk: Chunk) -> None:
        if self.broken is not None:
            raise anyio.BrokenResourceError
        if self.pending is None:
            self.pending = collections.deque()
        self.pending.append(chunk)
        done = self.drainer
        if done is not None and done.done():
            self.drainer = None
            done.result()  # what stopped the last drain, if anything did
        if self.drainer is None:
            self.drainer = asyncio.get_running_loop().create_task(self._drain())

    def write_now(self, events: list[bytes]) -> bool:
        """An upstream's events in this face's shape (those one read completed), written at
        once and in one send from the upstream connection's read callback: only after the
        head, with nothing queued or held before them, the stream unbroken and the server able
        to write them now (``CHUNK``)."""
        if not self.started or self.held or self.pending or self.drainer is not None \
                or self.broken is not None or self._chunk is None:
            return False
        return self._chunk(events[0] if len(events) == 1 else b"".join(events))

    def close(self) -> None:
        """Nothing to close: the stream ends when the call's outcome comes back."""

    async def flushed(self) -> None:
        """Every chunk handed over so far is written (or the stream broke)."""
        drainer = self.drainer
        if drainer is not None:
            try:
                await asyncio.shield(drainer)
            finally:
                if drainer.done():
                    self.drainer = None

    def stop(self) -> None:
        """The call was cancelled (its client gone): a drain still running stops."""
        if self.drainer is not None:
            self.drainer.cancel()

    async def _drain(self) -> None:
        while (pending := self.pending) and self.broken is None:
            try:
                await self._one(pending.popleft())
            except anyio.BrokenResourceError:
                break

    async def _one(self, chunk: Chunk) -> None:
        if self.broken is not None:
            raise anyio.BrokenResourceError
        if self.held or (not isinstance(chunk, bytes) and final_usage(chunk) is not None):
            self.held.append(chunk)
        elif not await self.out(chunk):
            raise anyio.BrokenResourceError

    async def out(self, chunk: Chunk, joined: bool = False) -> bool:
        """Write one event; ``joined``: through the ASGI send, which leaves with whatever else
        is written in this turn of the loop (a stream's held usage event and its end, in one
        send), not at once."""
        if isinstance(chunk, bytes):  # an upstream's event in this face's shape, as it came
            event = chunk
        else:
            try:
                event = self.encode(chunk)
            except Exception:  # the stream stops here: the provider's next send ends the call
                log.exception("a chunk of a stream on route %s could not be encoded", self.name)
                self.broken = internal_error("a chunk of the stream could not be encoded")
                return False
        first = not self.started
        if not first and not joined and self._chunk is not None and self._chunk(event):
            return True
        if first:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200,
                              "headers": [*SSE_HEADERS, *self.headers()]})
        await self._send({"type": "http.response.body", "body": event, "more_body": True})
        if first and self._flush is not None:  # the head and the first event leave now, in one send
            self._flush()
        return True


async def stream_call(submit: Callable[[Call], Any], call: Call, scope: Scope, receive: Receive,
                      send: Send,
                      headers: Callable[[], list[tuple[bytes, bytes]]], surface: Surface, *,
                      encode: Encode, error_event: Callable[[HttpError], bytes],
                      tail: bytes = b"", raw: str | None = None) -> None:
    """Run ``call`` and write its chunks as events; raises ``HttpError`` if it fails unstarted.
    ``raw``: the shape of ``encode``'s events, where an upstream's event in that shape goes on
    as its own bytes (``providers/sse_relay.py``)."""
    extensions = scope.get("extensions", {})
    events = _Events(send, encode, headers, call.method, extensions.get(FLUSH), raw,
                     extensions.get(CHUNK))
    call.sink = events
    outcome: Outcome | None = None
    async with cancelled_on_disconnect(scope, receive):
        try:  # the call runs in this task: it reaches the lane without waiting for a task start
            outcome = await submit(call)
            await events.flushed()
        finally:
            events.stop()
    if outcome is None:
        return  # the client went away; the call was cancelled with it
    if events.held and events.broken is None:
        held = events.held
        first = held[0]  # the final usage event: always an object (its usage was read)
        if not isinstance(first, bytes):
            held[0] = with_cost(first, outcome)
        for chunk in held:  # they and the stream's end leave in one send
            if not await events.out(chunk, joined=True):
                break
    result = Outcome.fail(events.broken) if events.broken is not None else outcome
    if result.error is not None and not events.started:
        raise http_error(result.error, surface)
    await _finish(send, result, events.started, headers, surface, error_event, tail)


async def _finish(send: Send, result: Outcome, started: bool,
                  headers: Callable[[], list[tuple[bytes, bytes]]], surface: Surface,
                  error_event: Callable[[HttpError], bytes], tail: bytes) -> None:
    if not started:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *headers()]})
    body = tail if result.error is None else error_event(http_error(result.error, surface))
    await send({"type": "http.response.body", "body": body})


def final_usage(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The usage of a stream's event that reports the call's final usage; None for any other."""
    kind = chunk.get("type")
    if kind == "message_delta":  # Anthropic: the output tokens, before message_stop
        usage = chunk.get("usage")
    elif kind in RESPONSE_ENDS:  # the Responses API's last event
        response = chunk.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
    elif chunk.get("choices") == []:  # OpenAI's usage chunk (``stream_options.include_usage``)
        usage = chunk.get("usage")
    else:
        return None
    return usage if isinstance(usage, dict) else None


def with_cost(chunk: dict[str, Any], answer: Outcome) -> dict[str, Any]:
    """``chunk`` (a final usage event, not changed in place) with the call's cost in its usage."""
    if answer.error is not None or answer.cost_pico is None:
        return chunk
    usage = {**(final_usage(chunk) or {}), **cost_meta(answer)}
    if chunk.get("type") in RESPONSE_ENDS:
        return {**chunk, "response": {**chunk["response"], "usage": usage}}
    return {**chunk, "usage": usage}
