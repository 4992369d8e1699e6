"""A streamed call as server-sent events.

The call goes through the gateway like any other (quota, lane slot, limits), with a memory
stream as its sink. The response starts only with the first chunk, so a call refused or failed
before any output still gets its proper status; a failure after that is an error event. A
client that disconnects cancels the call, and with it the upstream stream.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import anyio
from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import RpcError, internal_error
from multiplexer.faces.disconnect import cancelled_on_disconnect
from multiplexer.faces.v1.common import HttpError, Surface, http_error

log = logging.getLogger(__name__)
Encode = Callable[[dict[str, Any]], bytes]

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


async def stream_call(submit: Callable[[Call], Any], call: Call, scope: Scope, receive: Receive,
                      send: Send,
                      headers: Callable[[], list[tuple[bytes, bytes]]], surface: Surface, *,
                      encode: Encode, error_event: Callable[[HttpError], bytes],
                      tail: bytes = b"") -> None:
    """Run ``call`` and write its chunks as events; raises ``HttpError`` if it fails unstarted."""
    sink, chunks = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
    call.sink = sink
    outcome: list[Outcome] = []
    broken: list[RpcError] = []  # a chunk the face could not encode ended the stream
    forwarded = anyio.Event()
    started = False

    async def forward() -> None:
        nonlocal started
        async with chunks:
            async for chunk in chunks:
                try:
                    event = encode(chunk)
                except Exception:  # the reader stops here: the provider's next send ends the call
                    log.exception("a chunk of a stream on route %s could not be encoded", call.method)
                    broken.append(internal_error("a chunk of the stream could not be encoded"))
                    break
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [*SSE_HEADERS, *headers()]})
                await send({"type": "http.response.body", "body": event, "more_body": True})
        forwarded.set()

    async with cancelled_on_disconnect(scope, receive), anyio.create_task_group() as tg:
        tg.start_soon(forward)
        try:  # the call runs in this task: it reaches the lane without waiting for a task start
            outcome.append(await submit(call))
        finally:
            sink.close()  # refused calls never reach the provider, which closes it otherwise
        await forwarded.wait()
    if not outcome:
        return  # the client went away; the call was cancelled with it
    result = Outcome.fail(broken[0]) if broken else outcome[0]
    if result.error is not None and not started:
        raise http_error(result.error, surface)
    await _finish(send, result, started, headers, surface, error_event, tail)


async def _finish(send: Send, result: Outcome, started: bool,
                  headers: Callable[[], list[tuple[bytes, bytes]]], surface: Surface,
                  error_event: Callable[[HttpError], bytes], tail: bytes) -> None:
    if not started:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *headers()]})
    body = tail if result.error is None else error_event(http_error(result.error, surface))
    await send({"type": "http.response.body", "body": body})
