"""``kind: mistral``: Mistral's OpenAI-compatible chat and embeddings, and its batch jobs API.

Synchronous calls and streams are the OpenAI provider's (Mistral answers chat and
embeddings in OpenAI's shapes, with ``Authorization: Bearer``); ``mode: batch``
routes become durable jobs on Mistral's own ``/v1/batch/jobs`` (see
``batch/mistral_batch.py``), at half price.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, SecretStr

from multiplexer.core.call import Item
from multiplexer.core.provider import ProviderContext

from .api_client import ApiClient
from .batch.backend import BatchApiSettings
from .batch.mistral_batch import MistralBatchBackend
from .endpoints import EndpointSettings
from .llm_base import LlmProvider
from .openai import OpenAIProvider
from .ratelimit_headers import openai_limits

PATHS = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


class MistralSettings(BatchApiSettings, EndpointSettings):
    base_url: str = Field(default="https://api.mistral.ai", description="Mistral's API (no /v1)")
    api_key: SecretStr | None = Field(
        default=None, description="falls back to $MISTRAL_API_KEY; never logged")
    headers: dict[str, str] = Field(default_factory=dict, description="extra headers on every request")
    max_inputs: int = Field(default=512, ge=1, description="embedding inputs per request")
    max_batch_tokens: int | None = Field(default=16_000, ge=1,
                                         description="embedding tokens per request")
    batch_timeout_hours: int = Field(default=24, ge=1,
                                     description="a batch job's timeout_hours (then TIMEOUT_EXCEEDED)")
    batch_max_requests: int = Field(default=100_000, ge=1)
    batch_max_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)


def mistral_headers(settings: MistralSettings) -> dict[str, str]:
    key = settings.api_key.get_secret_value() if settings.api_key else os.environ.get("MISTRAL_API_KEY")
    headers = dict(settings.headers)
    if key:
        headers["authorization"] = f"Bearer {key}"
    return headers


class MistralProvider(OpenAIProvider):
    Settings = MistralSettings  # type: ignore[assignment]
    paths = PATHS

    def __init__(self, ctx: ProviderContext) -> None:
        settings: MistralSettings = ctx.settings
        self.settings = settings  # type: ignore[assignment]
        api = ApiClient(ctx, settings.base_url, mistral_headers(settings), openai_limits)
        LlmProvider.__init__(self, ctx, api, lambda api: MistralBatchBackend(
            api, settings, settings.batch_timeout_hours))

    def stream_request(self, item: Item) -> dict[str, Any]:
        """Mistral reports usage on its last chunk unasked; OpenAI's ``stream_options`` is not
        part of its API, so a caller's is not passed on (the usage reaches it anyway)."""
        return {**{k: v for k, v in item.params.items() if k != "stream_options"}, "stream": True}
