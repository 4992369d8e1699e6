"""A streamed call as server-sent events.

The call goes through the gateway like any other (quota, lane slot, limits), with a memory
stream as its sink. The response starts only with the first chunk, so a call refused or failed
before any output still gets its proper status; a failure after that is an error event. A
client that disconnects cancels the call, and with it the upstream stream.

A stream's headers leave before its usage is known, so its cost cannot be a header. The event
that carries its final usage (OpenAI's usage chunk, Anthropic's ``message_delta``, the
Responses API's ``response.completed``) is held until the call is priced, with what follows
it (the stream's last events, microseconds later), and goes out with ``cost_usd`` (and
``saved_usd``) in its usage, as decimal strings like ``_meta.cost_usd``.
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
from multiplexer.core.responses_api import RESPONSE_ENDS
from multiplexer.faces.disconnect import cancelled_on_disconnect
from multiplexer.faces.v1.common import HttpError, Surface, http_error
from multiplexer.money.report import cost_meta

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
    held: list[dict[str, Any]] = []  # the final usage event and what follows it, until priced

    async def out(chunk: dict[str, Any]) -> bool:
        nonlocal started
        try:
            event = encode(chunk)
        except Exception:  # the reader stops here: the provider's next send ends the call
            log.exception("a chunk of a stream on route %s could not be encoded", call.method)
            broken.append(internal_error("a chunk of the stream could not be encoded"))
            return False
        if not started:
            started = True
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*SSE_HEADERS, *headers()]})
        await send({"type": "http.response.body", "body": event, "more_body": True})
        return True

    async def forward() -> None:
        async with chunks:
            async for chunk in chunks:
                if held or final_usage(chunk) is not None:
                    held.append(chunk)
                elif not await out(chunk):
                    break
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
    if held and not broken:
        held[0] = with_cost(held[0], outcome[0])
        for chunk in held:
            if not await out(chunk):
                break
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
