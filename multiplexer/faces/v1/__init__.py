"""OpenAI- and Anthropic-compatible HTTP surfaces (``/v1/...``), mounted next to ``/rpc``."""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from multiplexer.faces.auth import Authenticator
from multiplexer.faces.v1.anthropic import Messages
from multiplexer.faces.v1.common import V1
from multiplexer.faces.v1.openai import ChatCompletions, Embeddings, Models
from multiplexer.gateway.gateway import Gateway


def v1_routes(gateway: Gateway, auth: Authenticator) -> list[BaseRoute]:
    v1 = V1(gateway, auth)
    return [
        Route("/v1/chat/completions", ChatCompletions(v1), methods=["POST"]),
        Route("/v1/embeddings", Embeddings(v1), methods=["POST"]),
        Route("/v1/models", Models(v1), methods=["GET"]),
        Route("/v1/messages", Messages(v1), methods=["POST"]),
    ]
