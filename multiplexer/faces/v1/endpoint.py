"""One ``/v1`` endpoint as a bare ASGI app: key, request id, quota headers and errors are
handled here, the subclass only turns a body into a call and an outcome into a reply."""

from __future__ import annotations

from typing import Any, ClassVar

from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call
from multiplexer.core.jsonrpc import dumps
from multiplexer.core.tracing import http_trace
from multiplexer.faces.access import REQUEST_ID, new_request_id, note_of
from multiplexer.faces.disconnect import cancelled_on_disconnect
from multiplexer.faces.v1.common import (
    REQUEST_TRACE,
    V1,
    HttpError,
    Surface,
    http_error,
    send_encoded,
    send_error,
    send_json,
)
from multiplexer.faces.v1.sse import Encode, stream_call

# A stream may run long: without a route timeout it gets the SDKs' own 10 minutes, not the
# server's default for whole calls.
STREAM_TIMEOUT_MS = 600_000


class Endpoint:
    surface: ClassVar[Surface]

    def __init__(self, v1: V1) -> None:
        self.v1 = v1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        note = note_of(scope)  # the request's id, when the server notes requests
        header = self.surface.request_id_header
        # the server sends x-request-id with every request it notes; another name (Anthropic's) is ours
        base = [] if note is not None and header == REQUEST_ID else \
            [(header, note.rid if note is not None else new_request_id())]
        identity: str | None = None
        if self.v1.gateway.tracer.enabled:
            REQUEST_TRACE.set(http_trace(dict(scope["headers"])))
        try:
            identity = self.v1.identify(dict(scope["headers"]))
            if note is not None:
                note.key = identity
            await self.handle(scope, receive, send, identity, base)
        except HttpError as e:
            if note is not None:
                note.code = e.error.code
            await send_error(send, self.surface, e, base + self.v1.quota_headers(identity))

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        raise NotImplementedError

    # -- helpers for subclasses ------------------------------------------------------
    async def answer(self, call: Call, scope: Scope, receive: Receive, send: Send,
                     headers: list[tuple[bytes, bytes]], shape: Any = None) -> None:
        """Run a call and send its result (through ``shape`` when given) or its error; a client
        that hangs up first cancels the call, and with it the upstream request."""
        outcome = None
        note = note_of(scope)
        if note is not None:
            note.route = call.method
        async with cancelled_on_disconnect(scope, receive):
            outcome = await self.v1.submit(call)
        if outcome is None:
            return  # nobody is left to answer
        if outcome.error is not None:
            raise http_error(outcome.error, self.surface)
        headers = headers + self.v1.quota_headers(call.identity)
        if shape is None and outcome.result_json is not None:  # encoded off the event loop already
            await send_encoded(send, 200, outcome.result_json, headers)
            return
        result = outcome.result if shape is None else shape(outcome.result)
        await send_json(send, 200, result, headers)

    async def stream(self, call: Call, scope: Scope, receive: Receive, send: Send,
                     headers: list[tuple[bytes, bytes]], encode: Encode,
                     error_body: Any, tail: bytes = b"") -> None:
        def error_event(e: HttpError) -> bytes:
            return encode(error_body(e))

        route = self.v1.gateway.config.routes[call.method]
        note = note_of(scope)
        if note is not None:
            note.route = call.method
        if route.timeout_ms is None and call.timeout_ms is None:
            call.timeout_ms = STREAM_TIMEOUT_MS

        await stream_call(self.v1.submit, call, scope, receive, send,
                          lambda: headers + self.v1.quota_headers(call.identity), self.surface,
                          encode=encode, error_event=error_event, tail=tail)


def data_event(chunk: dict[str, Any]) -> bytes:
    """OpenAI's format: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(chunk) + b"\n\n"


def named_event(chunk: dict[str, Any]) -> bytes:
    """Anthropic's format: the event name is the chunk's ``type``, which the SDK dispatches on."""
    return b"event: " + str(chunk.get("type", "message")).encode() + b"\ndata: " + dumps(chunk) + b"\n\n"
