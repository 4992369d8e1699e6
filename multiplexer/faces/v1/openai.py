"""OpenAI's HTTP API: ``/v1/chat/completions`` (whole or streamed), ``/v1/embeddings``,
``GET /v1/models``. A request's ``model`` picks the route; its body becomes the call's params,
so packing, limits, dedup and quotas apply as on ``/rpc``."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call
from multiplexer.core.errors import RpcError, invalid_params
from multiplexer.faces.v1.common import HttpError, Surface, message_of, send_json
from multiplexer.faces.v1.endpoint import Endpoint, data_event
from multiplexer.faces.v1.local_chat import chat_params, chat_result, chunk_encoder, is_local_chat

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(status: int, error: RpcError, param: str | None, code: str | None) -> dict[str, Any]:
    """``{"error": {message, type, param, code}}``: what the OpenAI SDK reads into its exception."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if code is None:
        code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
    return {"error": {"message": message_of(error), "type": kind, "param": param, "code": code}}


OPENAI = Surface(b"x-request-id", openai_error)
DONE = b"data: [DONE]\n\n"


class ChatCompletions(Endpoint):
    surface = OPENAI

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        name, route = self.v1.route_for(body.get("model"))
        if route.operation not in ("chat", "call"):
            raise HttpError(400, invalid_params(f"model {body['model']!r} is served by route {name} "
                                                f"({route.operation}), not chat completions"),
                            param="model")
        params = self.v1.params_for(body, name, route)
        local = is_local_chat(route)
        if local:
            params = chat_params(params)
        stream = body.get("stream")
        if stream not in (None, True, False):
            raise HttpError(400, invalid_params("'stream' must be a boolean"), param="stream")
        call = Call(name, params, identity=identity)
        if not stream:
            shape = (lambda r: chat_result(r, body["model"])) if local else None
            await self.answer(call, send, headers, shape)
            return
        encode = chunk_encoder(body) if local else data_event
        await self.stream(call, receive, send, headers, encode, lambda e: openai_error(
            e.status, e.error, e.param, e.code), tail=DONE)


class Embeddings(Endpoint):
    surface = OPENAI

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        name, route = self.v1.route_for(body.get("model"))
        if route.operation not in ("embeddings", "call"):
            raise HttpError(400, invalid_params(f"model {body['model']!r} is served by route {name} "
                                                f"({route.operation}), not embeddings"),
                            param="model")
        await self.answer(Call(name, self.v1.params_for(body, name, route), identity=identity),
                          send, headers)


class Models(Endpoint):
    surface = OPENAI

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        routes = self.v1.gateway.config.routes
        created = int(time.time())
        data = [{"id": model, "object": "model", "created": created,
                 "owned_by": routes[route].provider} for model, route in self.v1.models.items()]
        await send_json(send, 200, {"object": "list", "data": data}, headers)
