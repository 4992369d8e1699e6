"""``kind: gemini``: the Gemini API's native ``generateContent`` (streamed through
``streamGenerateContent?alt=sse``), embeddings through ``batchEmbedContents`` (many callers
packed into one request, as OpenAI's embeddings are), and ``mode: batch`` routes as durable jobs
on Gemini's Batch API.

On ``/rpc`` and ``/mcp`` a route's params are Gemini's own request body plus ``model`` (which
goes into the URL); ``/v1`` callers are translated by ``gemini_openai`` and ``gemini_anthropic``
(the ``Translates`` capability). The key goes in ``x-goog-api-key``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pydantic import Field, SecretStr

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, invalid_params
from multiplexer.core.foreign import Translation
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import ProviderContext

from .api_client import ApiClient, item_error
from .batch.backend import BatchApiSettings
from .batch.gemini_batch import GeminiBatchBackend
from .batch.gemini_jobs import GeminiJobManager
from .dedup_rules import deterministic_chat
from .gemini_anthropic import message_response, messages_request, messages_stream
from .gemini_embed import embed_requests, model_path, run_embeddings
from .gemini_openai import chat_request, chat_response, chat_stream, embeddings_request, embeddings_response
from .gemini_shapes import usage_total
from .llm_base import LlmProvider
from .packing import content_text, text_tokens
from .ratelimit_headers import Observation

PATHS = {"chat": ":generateContent", "embeddings": ":batchEmbedContents"}
TRANSLATIONS = {
    "/v1/chat/completions": Translation("chat", chat_request, chat_response, chat_stream),
    "/v1/messages": Translation("chat", messages_request, message_response, messages_stream),
    "/v1/embeddings": Translation("embeddings", embeddings_request, embeddings_response),
}


class GeminiSettings(BatchApiSettings):
    base_url: str = Field(default="https://generativelanguage.googleapis.com",
                          description="the Gemini API (the version goes in api_version)")
    api_version: str = Field(default="v1beta", description="the path segment of every request")
    api_key: SecretStr | None = Field(
        default=None, description="sent as x-goog-api-key; falls back to $GEMINI_API_KEY, then "
        "$GOOGLE_API_KEY; never logged")
    headers: dict[str, str] = Field(default_factory=dict, description="extra headers on every request")
    max_inputs: int = Field(default=100, ge=1, description="embedding inputs per batchEmbedContents request")
    batch_max_bytes: int = Field(default=200 * 1024 * 1024, ge=1024,
                                 description="bytes of request lines per remote batch (files up to 2 GB)")
    batch_inline_max_bytes: int = Field(
        default=1024 * 1024, ge=0, le=20 * 1024 * 1024,
        description="a batch this small goes inline in the create request (results by position); "
        "a larger one goes up as a file through the resumable upload (results by key)")
    batch_enqueued_tokens: dict[str, int] = Field(
        default_factory=dict, description="per model: the tier's enqueued-token limit for batch jobs; "
        "a part waits to be submitted while the model's running batches hold that many "
        "(estimated at four characters a token). '*' applies to models not listed")
    batch_max_jobs: int = Field(default=100, ge=1, le=100,
                                description="batch jobs running at once on this key (the API allows 100)")
    batch_discount: float = Field(default=0.5, ge=0, le=1,
                                  description="the price of a batched token as a share of a live one")


def api_key(settings: GeminiSettings) -> str | None:
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    return os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY")


def no_limits(headers: Any, wall: Any) -> list[Observation]:
    """The Gemini API sends no rate-limit headers; a 429 pauses the lane by its Retry-After."""
    return []


def native_tokens(params: dict[str, Any]) -> int:
    """A generateContent body's estimate: its text plus the output budget."""
    texts: list[Any] = []
    for turn in [*(params.get("contents") or []), params.get("systemInstruction")]:
        parts = turn.get("parts") if isinstance(turn, dict) else None
        texts.extend(p.get("text") for p in parts or [] if isinstance(p, dict))
    prompt = 4 * len(params.get("contents") or [])
    prompt += sum(text_tokens(t) for t in texts if isinstance(t, str))
    config = params.get("generationConfig")
    budget = config.get("maxOutputTokens") if isinstance(config, dict) else None
    return prompt + (budget if isinstance(budget, int) and not isinstance(budget, bool) else 0)


class GeminiProvider(LlmProvider):
    Settings = GeminiSettings
    paths = PATHS
    packable = frozenset({"embeddings"})
    usage_total = staticmethod(usage_total)

    def __init__(self, ctx: ProviderContext) -> None:
        self.settings: GeminiSettings = ctx.settings
        self.version = "/" + self.settings.api_version.strip("/")
        headers = dict(self.settings.headers)
        if (key := api_key(self.settings)) is not None:
            headers["x-goog-api-key"] = key
        api = ApiClient(ctx, self.settings.base_url, headers, no_limits)
        super().__init__(ctx, api, lambda api: GeminiBatchBackend(api, self.settings, self.version))
        self.jobs = GeminiJobManager(ctx, self.settings, self.jobs.backend, self.jobs.sync)

    # -- /v1 callers (the ``Translates`` capability) ----------------------------------------
    def translation(self, endpoint: str) -> Translation | None:
        return TRANSLATIONS.get(endpoint)

    # -- admission -------------------------------------------------------------
    def prepare(self, route: RouteConfig, item: Item) -> None:
        params, model = self.request_body(item)
        if item.operation == "chat":
            contents = params.get("contents")
            if not isinstance(contents, list) or not contents:
                raise invalid_params("'contents' must be a non-empty array (Gemini's generateContent "
                                     "body)", param="contents")
            item.group = ("chat", model)
            self.charge(route, item, native_tokens(params))
            return
        requests = embed_requests(params, model)
        rest = {k: v for k, v in params.items() if k not in ("model", "requests", "content")}
        item.group = ("embeddings", model, tuple(sorted((k, repr(v)) for k, v in rest.items())))
        item.options["mode"] = route.mode  # run live even on a batch route (execute): charged live
        item.tokens = sum(text_tokens(content_text(r["content"].get("parts"))) for r in requests)

    @staticmethod
    def deterministic(item: Item) -> bool:
        """``generationConfig.temperature`` exactly 0 and one candidate (the sampling knobs live
        there in Gemini's body): identical calls may then share one execution, and be retried."""
        config = item.params.get("generationConfig") if isinstance(item.params, dict) else None
        config = config if isinstance(config, dict) else {}
        return deterministic_chat({"temperature": config.get("temperature"),
                                   "n": config.get("candidateCount", 1)})

    def idempotent(self, item: Item) -> bool:
        return item.operation == "embeddings" or bool(item.options.get("idempotent")) \
            or self.deterministic(item)

    def dedup_safe(self, item: Item) -> bool:
        return item.operation == "embeddings" or self.deterministic(item)

    def path(self, model: str, method: str) -> str:
        return f"{self.version}/{model_path(model)}{method}"

    # -- execution -------------------------------------------------------------
    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if operation == "embeddings":  # the Batch API's embeddings are experimental: packed live calls
            return await self.execute_now(operation, items)
        return await super().execute(operation, items)

    async def execute_now(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if operation == "embeddings":
            return await run_embeddings(self.api, self.version, self.settings.max_inputs, items)
        return await super().execute_now(operation, items)

    async def run_one(self, item: Item) -> Outcome:
        if item.operation == "embeddings":
            return (await run_embeddings(self.api, self.version, self.settings.max_inputs, [item]))[0]
        params = item.params
        body = {k: v for k, v in params.items() if k not in ("model", "stream")}
        try:
            reply = await self.api.json("POST", self.path(params["model"], PATHS["chat"]), json=body,
                                        idempotent=self.idempotent(item), deadline=item.deadline)
        except RpcError as e:
            return Outcome.fail(e)
        self.correct(item.tokens, reply)
        return Outcome(result=reply)

    # -- streaming (the ``Streamer`` capability) --------------------------------------------
    usage_key = "usageMetadata"

    def stream_path(self, item: Item) -> str:
        """``streamGenerateContent?alt=sse``: each event is a partial ``GenerateContentResponse``."""
        return self.path(item.params["model"], ":streamGenerateContent") + "?alt=sse"

    def stream_request(self, item: Item) -> dict[str, Any]:
        return {k: v for k, v in item.params.items() if k not in ("model", "stream")}

    def stream_event(self, item: Item, event: str, data: dict[str, Any],
                     usage: dict[str, Any]) -> bool:
        """An error event fails the call; each event's ``usageMetadata`` replaces the last."""
        if data.get("error") is not None:
            raise item_error(self.name, data, None)
        if isinstance(data.get("usageMetadata"), dict):
            usage.clear()
            usage.update(data["usageMetadata"])
        return True

    def stream_end(self, item: Item, event: str, data: dict[str, Any]) -> bool:
        """Whole once a candidate names its finish reason, or the prompt was blocked."""
        return finished(data)


def finished(chunk: dict[str, Any]) -> bool:
    """A chunk that ends the answer: a candidate with a finish reason, or a blocked prompt."""
    feedback = chunk.get("promptFeedback")
    if isinstance(feedback, dict) and feedback.get("blockReason"):
        return True
    candidates = chunk.get("candidates")
    return isinstance(candidates, list) and any(
        isinstance(c, dict) and c.get("finishReason") for c in candidates)
