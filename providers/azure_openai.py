"""``kind: azure_openai``: Azure OpenAI deployments, as the OpenAI provider with Azure's addresses.

What differs from ``kind: openai`` is only where requests go and how they are signed:
a route's ``model`` is a deployment name, which the classic API puts in the path
(``{endpoint}/openai/deployments/{deployment}/chat/completions?api-version=...``),
files and batches sit at ``{endpoint}/openai/files`` and ``/openai/batches``, and
the key goes in an ``api-key`` header. With ``api_version: v1`` (or ``preview`` /
``latest``) the v1 API is used instead: ``{endpoint}/openai/v1/...`` with OpenAI's
own paths and the deployment in the body's ``model``. Everything else (packing,
streams, usage, the Batch API with the deployment in every line's ``model``) is
the OpenAI provider's.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

from pydantic import Field, SecretStr, field_validator, model_validator

from multiplexer.core.call import Item
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import ProviderContext

from .api_client import ApiClient
from .batch.backend import BatchApiSettings
from .batch.openai_batch import OpenAIBatchBackend
from .llm_base import LlmProvider
from .openai import PATHS, OpenAIProvider
from .ratelimit_headers import openai_limits

V1_VERSIONS = frozenset({"v1", "preview", "latest"})
# The classic API puts the deployment in these paths only (the Responses API is per resource).
DEPLOYMENT_PATHS = frozenset({"chat", "completions", "embeddings"})
# What Azure's batches carry: chat and Responses lines (embeddings batch: unverified, see
# docs/batch-vendors.md); other operations of a mode: batch route run as sync calls.
BATCH_OPERATIONS = frozenset({"chat", "responses"})
# A create names the endpoint without /v1 (the lines' url keeps it).
CREATE_ENDPOINTS = {"chat": "/chat/completions", "responses": "/responses",
                    "embeddings": "/embeddings", "completions": "/completions"}


class AzureOpenAISettings(BatchApiSettings):
    endpoint: str = Field(description="the resource's endpoint, e.g. https://NAME.openai.azure.com")
    api_version: str = Field(
        default="2024-10-21", description="a dated api-version (deployment URLs), or v1 / preview / "
        "latest for the v1 API ({endpoint}/openai/v1/...)")
    api_key: SecretStr | None = Field(
        default=None, description="sent as the api-key header; falls back to $AZURE_OPENAI_API_KEY; "
        "never logged")
    headers: dict[str, str] = Field(
        default_factory=dict, description="extra headers on every request (an Entra ID "
        "Authorization: Bearer token instead of api_key, say)")
    batch_poll_interval_s: float = Field(
        default=60.0, gt=0, description="seconds between polls of a running batch (Azure asks for "
        "60 or more)")
    max_inputs: int = Field(default=2048, ge=1, description="embedding inputs per request")
    max_batch_tokens: int | None = Field(default=300_000, ge=1,
                                         description="embedding tokens per request")

    @field_validator("endpoint")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"endpoint: {value!r} is not an http(s) URL")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _one_window(self) -> AzureOpenAISettings:
        window = self.batch_api.completion_window or self.batch_completion_window
        if window != "24h":
            raise ValueError(f"Azure OpenAI batches take completion_window 24h only, not {window!r}")
        return self

    @property
    def v1(self) -> bool:
        return self.api_version in V1_VERSIONS

    @property
    def query(self) -> str:
        """``?api-version=`` on every path; the v1 API needs none (``preview``/``latest`` keep it)."""
        return "" if self.api_version == "v1" else f"?api-version={quote(self.api_version)}"


def azure_headers(settings: AzureOpenAISettings) -> dict[str, str]:
    key = settings.api_key.get_secret_value() if settings.api_key else os.environ.get(
        "AZURE_OPENAI_API_KEY")
    headers = dict(settings.headers)
    if key:
        headers["api-key"] = key
    return headers


class AzureOpenAIProvider(OpenAIProvider):
    Settings = AzureOpenAISettings  # type: ignore[assignment]

    def __init__(self, ctx: ProviderContext) -> None:
        settings: AzureOpenAISettings = ctx.settings
        self.settings = settings  # type: ignore[assignment]
        base = settings.endpoint + ("/openai/v1" if settings.v1 else "/openai")
        api = ApiClient(ctx, base, azure_headers(settings), openai_limits)
        self._query = settings.query
        LlmProvider.__init__(self, ctx, api, lambda api: OpenAIBatchBackend(
            api, settings, query=settings.query, create_endpoints=CREATE_ENDPOINTS,
            operations=BATCH_OPERATIONS, max_requests=100_000))

    def prepare(self, route: RouteConfig, item: Item) -> None:
        """A route's ``model`` is its deployment: a ``/v1`` caller's model name picked the route,
        and must not replace the deployment the route names."""
        deployment = route.params.get("model") if isinstance(route.params, dict) else None
        if isinstance(deployment, str) and isinstance(item.params, dict):
            item.params["model"] = deployment
        super().prepare(route, item)

    def op_path(self, operation: str, model: Any) -> str:
        path = PATHS[operation]
        if operation in DEPLOYMENT_PATHS and not self.settings.v1:  # type: ignore[attr-defined]
            path = f"/deployments/{quote(str(model), safe='')}{path}"
        return path + self._query
