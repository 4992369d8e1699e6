"""One ``/v1`` endpoint as a bare ASGI app: key, request id, quota headers and errors are
handled here, the subclass only turns a body into a call and an outcome into a reply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import RpcError
from multiplexer.core.json_codec import dumps
from multiplexer.core.sink import DATA, NAMED
from multiplexer.core.tracing import http_trace
from multiplexer.faces.access import REQUEST_ID, new_request_id, note_of
from multiplexer.faces.disconnect import cancelled_on_disconnect
from multiplexer.faces.unexpected import unexpected
from multiplexer.faces.v1.common import (
    REQUEST_TRACE,
    V1,
    HttpError,
    Surface,
    http_error,
    send_encoded,
    send_error,
)
from multiplexer.faces.v1.sse import Encode, stream_call
from multiplexer.gateway.semantic import cache_headers, note_of_headers
from multiplexer.money.report import pico_text

# A stream may run long: without a route timeout it gets the SDKs' own 10 minutes, not the
# server's default for whole calls.
STREAM_TIMEOUT_MS = 600_000


class Endpoint:
    surface: ClassVar[Surface]
    # A request that submits no call (files, batch records, listings) is still one request of
    # its key: decided here as one claim. Those that submit calls are decided at admission.
    metered: ClassVar[bool] = False

    def __init__(self, v1: V1) -> None:
        self.v1 = v1

    @property
    def limit(self) -> int:
        """The largest body the server may read whole for ``direct`` (endpoints that have it)."""
        return self.v1.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        note = note_of(scope)  # the request's id, when the server notes requests
        header = self.surface.request_id_header
        # the server sends x-request-id with every request it notes; another name (Anthropic's) is ours
        base = [] if note is not None and header == REQUEST_ID else \
            [(header, note.rid if note is not None else new_request_id())]
        identity: str | None = None
        request_headers = dict(scope["headers"])
        if self.v1.gateway.tracer.enabled:
            REQUEST_TRACE.set(http_trace(request_headers))
        try:
            identity = self.v1.identify(request_headers)
            if note is not None:
                note.key = identity
            if not self.metered:
                await self.handle(scope, receive, send, identity, base)
                return
            async with self.v1.gateway.quotas.held(identity, self._refused):
                await self.handle(scope, receive, send, identity, base)
        except HttpError as e:
            if note is not None:
                note.code = e.error.code
            await send_error(send, self.surface, e, base + self.v1.quota_headers(identity))
        except Exception as e:  # a bug: this API's error body, never a bare 500 (nothing was sent)
            error = unexpected(self.v1.gateway, f"{scope['method']} {scope['path']}", e)
            await send_error(send, self.surface, HttpError(500, error), base)

    def _refused(self, error: RpcError) -> HttpError:
        return http_error(error, self.surface)

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        raise NotImplementedError

    # -- helpers for subclasses ------------------------------------------------------
    async def answer(self, call: Call, scope: Scope, receive: Receive, send: Send,
                     headers: list[tuple[bytes, bytes]], shape: Any = None) -> None:
        """Run a call and send its result (through ``shape`` when given) or its error; a client
        that hangs up first cancels the call, and with it the upstream request. The result is
        shaped and encoded as the call is answered (``Call.shape``), so one that cannot be is
        the call's error in ``/metrics`` too."""
        call.shape = encoded if shape is None else shaped(shape)
        self.cache_note(call, scope, headers)
        outcome = None
        note = note_of(scope)
        if note is not None:
            note.route = call.method
        async with cancelled_on_disconnect(scope, receive):
            outcome = await self.v1.submit(call)
        if outcome is None:
            return  # nobody is left to answer
        headers.append(route_header(call))  # also on an error: ``headers`` is the request's base
        if outcome.error is not None:
            raise http_error(outcome.error, self.surface)
        assert outcome.result_json is not None
        await send_encoded(send, 200, outcome.result_json,
                           headers + self.v1.quota_headers(call.identity) + money_headers(outcome)
                           + cache_headers(call))

    async def stream(self, call: Call, scope: Scope, receive: Receive, send: Send,
                     headers: list[tuple[bytes, bytes]], encode: Encode,
                     error_body: Any, tail: bytes = b"") -> None:
        def error_event(e: HttpError) -> bytes:
            return encode(error_body(e))

        route = self.v1.gateway.resolve(call.method).route  # a group's: its first route
        self.cache_note(call, scope, headers)
        note = note_of(scope)
        if note is not None:
            note.route = call.method
        if route.timeout_ms is None and call.timeout_ms is None:
            call.timeout_ms = STREAM_TIMEOUT_MS

        try:
            await stream_call(self.v1.submit, call, scope, receive, send,
                              lambda: [*headers, route_header(call), *self.v1.quota_headers(call.identity),
                                       *cache_headers(call)],
                              self.surface, encode=encode, error_event=error_event, tail=tail,
                              raw=RAW.get(encode))
        except HttpError:  # failed before its first chunk: the error says where it was tried last
            headers.append(route_header(call))
            raise

    def cache_note(self, call: Call, scope: Scope, headers: list[tuple[bytes, bytes]]) -> None:
        """What the request tells the semantic cache (opted out by its headers, its request id),
        read only where the gateway has one."""
        if self.v1.gateway.semantic is None:
            return
        note = note_of(scope)
        rid = note.rid if note is not None else next(
            (v for k, v in headers if k == self.surface.request_id_header), None)
        call.cache = note_of_headers(dict(scope["headers"]),
                                     None if rid is None else bytes(rid).decode("ascii", "replace"))


ROUTE_HEADER = b"x-multiplexer-route"


def route_header(call: Call) -> tuple[bytes, bytes]:
    """Where the call was served (or tried last): a fallback's or a model group's route."""
    return ROUTE_HEADER, (call.route or call.method).encode("ascii", "replace")


def money_headers(outcome: Outcome) -> list[tuple[bytes, bytes]]:
    """``x-multiplexer-cost-usd`` where the call's cost is known, ``x-multiplexer-saved-usd`` where
    the gateway saved something on it (decimal strings, US dollars)."""
    cost = outcome.cost_pico
    if cost is None:
        return []
    if not outcome.saved_pico:
        return [(b"x-multiplexer-cost-usd", pico_text(cost))]
    return [(b"x-multiplexer-cost-usd", pico_text(cost)),
            (b"x-multiplexer-saved-usd", pico_text(outcome.saved_pico))]


def encoded(outcome: Outcome) -> Outcome:
    """The outcome with its result as JSON (a provider's own encoding, made off the loop, kept)."""
    if outcome.result_json is not None:
        return outcome
    return Outcome(outcome.result, result_json=dumps(outcome.result))


def shaped(shape: Callable[[Any], Any]) -> Callable[[Outcome], Outcome]:
    """The outcome's result in the endpoint's shape, as JSON."""
    def shape_outcome(outcome: Outcome) -> Outcome:
        result = shape(outcome.result)
        return Outcome(result, result_json=dumps(result))

    return shape_outcome


def data_event(chunk: dict[str, Any]) -> bytes:
    """OpenAI's format: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(chunk) + b"\n\n"


def converted(convert: Callable[[dict[str, Any]], list[dict[str, Any]]],
              encode: Callable[[dict[str, Any]], bytes]) -> Callable[[dict[str, Any]], bytes]:
    """An encoder of a translated stream: each upstream chunk as the caller's API's events."""
    return lambda chunk: b"".join(encode(event) for event in convert(chunk))


def named_event(chunk: dict[str, Any]) -> bytes:
    """Anthropic's format: the event name is the chunk's ``type``, which the SDK dispatches on."""
    return b"event: " + str(chunk.get("type", "message")).encode() + b"\ndata: " + dumps(chunk) + b"\n\n"


# The encoders whose events an upstream's may be as they are (``providers/sse_relay.py``): only
# these, so a translated stream or a local route's own shapes is always encoded here.
RAW: dict[Callable[[dict[str, Any]], bytes], str] = {data_event: DATA, named_event: NAMED}
