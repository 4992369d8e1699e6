"""Anthropic's ``POST /v1/messages``, whole or streamed as named events, and
``POST /v1/messages/count_tokens``, for routes on ``anthropic`` providers.
``anthropic-version`` is accepted (the provider sends its own)."""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call
from multiplexer.core.errors import RpcError
from multiplexer.faces.v1.common import Surface, message_of
from multiplexer.faces.v1.deadline import deadline_ms
from multiplexer.faces.v1.endpoint import Endpoint, converted, named_event
from multiplexer.faces.v1.requests import MESSAGES, plan, require_operation, stream_flag
from multiplexer.faces.v1.session import session_of

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          504: "timeout_error", 529: "overloaded_error"}


_KINDS = {*_TYPES.values(), "api_error", "billing_error", "timeout_error"}


def anthropic_error(status: int, error: RpcError, param: str | None,
                    code: str | None) -> dict[str, Any]:
    """``{"type": "error", "error": {type, message}}``, the body and the ``error`` event alike;
    an upstream Anthropic error keeps its own type (a message batch's errored result has no
    status to tell it)."""
    kind = code if code in _KINDS else _TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message_of(error)}}


ANTHROPIC = Surface(b"request-id", anthropic_error, overloaded_status=529)


class CountTokens(Endpoint):
    """``POST /v1/messages/count_tokens`` on an ``anthropic`` messages route: passed through under
    the route's lane and limits (a request, no tokens charged); identical counts may be shared."""

    surface = ANTHROPIC

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        name, params, _ = plan(self.v1, MESSAGES, body, identity)
        require_operation(self.v1, identity, name, body, params, "count_tokens", "token counting")
        call = Call(name, params, identity=identity, operation="count_tokens",
                    timeout_ms=deadline_ms(self.v1.gateway, scope["headers"], name, body))
        await self.answer(call, scope, receive, send, headers)


class Messages(Endpoint):
    surface = ANTHROPIC

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        name, params, shape = plan(self.v1, MESSAGES, body, identity)
        call = Call(name, params, identity=identity,
                    timeout_ms=deadline_ms(self.v1.gateway, scope["headers"], name, body),
                    session=session_of(scope["headers"]))
        if not stream_flag(body):
            await self.answer(call, scope, receive, send, headers, shape)
            return
        translation = self.v1.translation(name, MESSAGES)  # another API's stream, as Anthropic's events
        encode = named_event if translation is None or translation.stream is None else \
            converted(translation.stream(body), named_event)
        await self.stream(call, scope, receive, send, headers, encode,
                          lambda e: anthropic_error(e.status, e.error, e.param, e.code))
