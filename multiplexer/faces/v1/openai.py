"""OpenAI's HTTP API: ``/v1/chat/completions``, ``/v1/responses`` and the legacy
``/v1/completions`` (whole or streamed), ``/v1/embeddings``, ``GET /v1/models``. A request's
``model`` picks the route; its body becomes the call's params, so packing, limits, dedup and
quotas apply as on ``/rpc``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call
from multiplexer.core.errors import RpcError
from multiplexer.faces.reply import Reply, whole_reply
from multiplexer.faces.v1.common import Surface, message_of, send_json
from multiplexer.faces.v1.deadline import deadline_ms
from multiplexer.faces.v1.endpoint import Endpoint, converted, data_event, named_event
from multiplexer.faces.v1.local_chat import chunk_encoder, completion_encoder, response_encoder
from multiplexer.faces.v1.requests import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    operation_for,
    plan,
    stream_flag,
)
from multiplexer.faces.v1.session import session_of

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          403: "permission_denied", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


def openai_error(status: int, error: RpcError, param: str | None, code: str | None) -> dict[str, Any]:
    """``{"error": {message, type, param, code}}``: what the OpenAI SDK reads into its exception."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if status == 429 and (error.data or {}).get("limit") == "budget_usd":
        kind = code = "insufficient_quota"  # what OpenAI answers when an account's quota is spent
    if code is None:
        code = {401: "invalid_api_key", 403: "permission_denied", 429: "rate_limit_exceeded"}.get(status)
    return {"error": {"message": message_of(error), "type": kind, "param": param, "code": code}}


OPENAI = Surface(b"x-request-id", openai_error)
DONE = b"data: [DONE]\n\n"


def response_error(status: int, error: RpcError, param: str | None, code: str | None) -> dict[str, Any]:
    """A Responses stream's ``error`` event, for a failure after the stream started."""
    body = openai_error(status, error, param, code)["error"]
    return {"type": "error", "code": body["code"] or body["type"], "message": body["message"],
            "param": body["param"]}


class Generation(Endpoint):
    """A text-generation endpoint: on a remote route the body goes up as the call's params (to
    the provider's own endpoint for it) and the reply or stream comes back as sent; on a local
    generate route the gateway answers in the endpoint's shapes (``local_chat``)."""

    surface = OPENAI
    endpoint: ClassVar[str]
    remote = staticmethod(data_event)  # encodes each chunk of a remote route's stream
    error_body: ClassVar[Callable[..., dict[str, Any]]] = staticmethod(openai_error)
    tail: ClassVar[bytes] = DONE

    @staticmethod
    def local(body: dict[str, Any]) -> Callable[[dict[str, Any]], bytes]:
        """The encoder of a local generate route's stream, in the endpoint's shapes (each endpoint
        has its own)."""
        raise NotImplementedError

    async def direct(self, scope: Scope, body: bytes) -> Reply | None:
        """A whole call answers in one piece, so the gateway's own server calls it directly
        (``faces/reply.py``). A body that may ask for a stream goes back to the ASGI path, which
        streams: one with the bytes ``stream`` anywhere, or with an escape that could spell them."""
        if b"stream" in body or b"\\u" in body:
            return None
        return await whole_reply(self, scope, body)

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        name, params, shape = plan(self.v1, self.endpoint, body, identity)
        call = Call(name, params, identity=identity, operation=operation_for(self.endpoint, shape),
                    timeout_ms=deadline_ms(self.v1.gateway, scope["headers"], name, body),
                    session=session_of(scope["headers"]))
        if not stream_flag(body):
            await self.answer(call, scope, receive, send, headers, shape)
            return
        translation = self.v1.translation(name, self.endpoint)
        if translation is not None and translation.stream is not None:
            encode = converted(translation.stream(body), self.remote)
        else:
            encode = self.remote if shape is None else type(self).local(body)
        await self.stream(call, scope, receive, send, headers, encode, lambda e: self.error_body(
            e.status, e.error, e.param, e.code), tail=self.tail)


class ChatCompletions(Generation):
    endpoint = CHAT
    local = staticmethod(chunk_encoder)


class Completions(Generation):
    """The legacy text completions: on a local generate route the prompt goes to the model as it
    is (no chat template)."""

    endpoint = COMPLETIONS
    local = staticmethod(completion_encoder)


class Responses(Generation):
    """Streamed as the API's named events, with no ``[DONE]``; never shared by dedup (a response
    is stored upstream and may be chained by ``previous_response_id``). A local generate route
    keeps no responses, so ``previous_response_id`` is refused there."""

    endpoint = RESPONSES
    remote = staticmethod(named_event)
    local = staticmethod(response_encoder)
    error_body = staticmethod(response_error)
    tail = b""


class Embeddings(Endpoint):
    """Answers in one piece, so the gateway's own server calls it directly (``faces/reply.py``)."""

    surface = OPENAI

    async def direct(self, scope: Scope, body: bytes) -> Reply:
        return await whole_reply(self, scope, body)

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        name, params, shape = plan(self.v1, EMBEDDINGS, body, identity)
        call = Call(name, params, identity=identity,
                    timeout_ms=deadline_ms(self.v1.gateway, scope["headers"], name, body))
        await self.answer(call, scope, receive, send, headers, shape)


class Models(Endpoint):
    """``GET /v1/models`` (the models the routes list) and ``GET /v1/models/{model}``."""
    metered = True

    surface = OPENAI

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        gateway = self.v1.gateway
        created = int(time.time())
        data = [{"id": model, "object": "model", "created": created,
                 "owned_by": "multiplexer" if route in gateway.config.groups
                 else gateway.config.routes[route].provider}
                for model, route in self.v1.models.items() if self.v1.visible(identity, model, route)]
        wanted = scope.get("path_params", {}).get("model")
        if wanted is None:
            await send_json(send, 200, {"object": "list", "data": data}, headers)
            return
        found = next((m for m in data if m["id"] == wanted), None)
        if found is None:
            raise self.v1.unknown_model(wanted, identity)
        await send_json(send, 200, found, headers)
