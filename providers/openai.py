"""``kind: openai``: any OpenAI-compatible API (OpenAI, vLLM, Ollama, ...): chat, embeddings, and
the Responses API and legacy completions for calls that come to ``/v1/responses`` or
``/v1/completions`` on a chat route.

A lane's batch of embedding calls goes up as few requests with an ``input``
array and each caller gets its own embeddings object back; chat calls are one
request each, run under the lane's limits. Routes with ``mode: batch`` become
durable jobs on the Batch API (or on the synchronous endpoint where a
deployment has none).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import anyio
from pydantic import Field, SecretStr

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import Code, RpcError, invalid_params, upstream_error
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import ProviderContext
from multiplexer.core.responses_api import RESPONSE_ENDS

from .api_client import ApiClient, item_error
from .batch.backend import BatchApiSettings
from .batch.openai_batch import OpenAIBatchBackend
from .endpoints import EndpointSettings
from .http_util import batch_deadline
from .llm_base import LlmProvider
from .packing import (
    Chunk,
    Scatter,
    chat_tokens,
    completion_tokens,
    embedding_inputs,
    ordered_data,
    pack,
    responses_tokens,
    text_tokens,
)
from .prompt_cache import PromptCacheRouteSettings, PromptCacheSettings, mode_of, openai_cache_key
from .ratelimit_headers import openai_limits
from .sse_relay import Event, escaped, valued

# Responses events read whole: the last (its usage), an error, and any without its name.
_READ_EVENTS = frozenset({*RESPONSE_ENDS, "error", "message"})
PATHS = {"chat": "/chat/completions", "embeddings": "/embeddings", "responses": "/responses",
         "completions": "/completions"}


class OpenAISettings(BatchApiSettings, EndpointSettings, PromptCacheSettings):
    base_url: str = "https://api.openai.com/v1"
    api_key: SecretStr | None = None  # falls back to $OPENAI_API_KEY; never logged
    organization: str | None = None
    project: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    max_inputs: int = Field(default=2048, ge=1)
    max_batch_tokens: int | None = Field(default=300_000, ge=1)


def auth_headers(settings: OpenAISettings) -> dict[str, str]:
    key = settings.api_key.get_secret_value() if settings.api_key else os.environ.get("OPENAI_API_KEY")
    headers = dict(settings.headers)
    if key:
        headers["authorization"] = f"Bearer {key}"
    if settings.organization:
        headers["openai-organization"] = settings.organization
    if settings.project:
        headers["openai-project"] = settings.project
    return headers


def usage_total(body: Any) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if not isinstance(total, int):
        parts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "input_tokens",
                                        "output_tokens")]
        numbers = [p for p in parts if isinstance(p, int)]
        total = sum(numbers) if numbers else None
    return total


class OpenAIProvider(LlmProvider):
    Settings = OpenAISettings
    RouteSettings = PromptCacheRouteSettings
    paths = PATHS
    packable = frozenset({"embeddings"})
    usage_total = staticmethod(usage_total)

    def __init__(self, ctx: ProviderContext) -> None:
        self.settings: OpenAISettings = ctx.settings
        api = ApiClient(ctx, self.settings.base_url, auth_headers(self.settings), openai_limits)
        super().__init__(ctx, api, lambda api: OpenAIBatchBackend(api, self.settings))

    # -- admission -------------------------------------------------------------
    def prepare(self, route: RouteConfig, item: Item) -> None:
        params, model = self.request_body(item)
        if item.operation in ("chat", "responses") and mode_of(item.options, self.settings) == "auto" \
                and (key := openai_cache_key(params, item.identity)) is not None:
            item.params = params = {**params, "prompt_cache_key": key}  # a key where it set none
        if item.operation == "chat":
            self.require_messages(params)
            tokens = chat_tokens(params)
            item.group = ("chat", model)
        elif item.operation == "responses":
            if params.get("input") in (None, "", []):
                raise invalid_params("'input' is required", param="input")
            tokens = responses_tokens(params)
            item.group = ("responses", model)
        elif item.operation == "completions":
            if params.get("prompt") in (None, []):
                raise invalid_params("'prompt' is required", param="prompt")
            tokens = completion_tokens(params)
            item.group = ("completions", model)
        else:
            tokens = sum(len(v) if isinstance(v, list) else text_tokens(v)
                         for v in embedding_inputs(params))
            rest = {k: v for k, v in params.items() if k not in ("input", "model")}
            item.group = ("embeddings", model) if not rest else (
                "embeddings", model, tuple(sorted((k, repr(v)) for k, v in rest.items())))
        self.charge(route, item, tokens)

    def idempotent(self, item: Item) -> bool:
        return item.operation == "embeddings" or super().idempotent(item)

    def dedup_safe(self, item: Item) -> bool:
        if item.operation == "responses":  # stored upstream and chained by id: each call its own
            return False
        return item.operation == "embeddings" or super().dedup_safe(item)

    # -- streaming ---------------------------------------------------------------
    def stream_request(self, item: Item) -> dict[str, Any]:
        """Usage is always asked for (it corrects the token charge); the caller sees the usage
        chunk only when it asked too. A Responses stream reports usage in its last event."""
        if item.operation == "responses":
            return {**item.params, "stream": True}
        options = item.params.get("stream_options")
        options = options if isinstance(options, dict) else {}
        return {**item.params, "stream": True, "stream_options": {**options, "include_usage": True}}

    def stream_event(self, item: Item, event: str, data: dict[str, Any],
                     usage: dict[str, Any]) -> bool:
        if item.operation == "responses":  # every event goes on; the final one carries the usage
            done = data.get("response") if data.get("type") in RESPONSE_ENDS else None
            if isinstance(done, dict) and isinstance(done.get("usage"), dict):
                usage.update(done["usage"])
            return True
        if data.get("error") is not None:
            raise item_error(self.name, data, None)
        if isinstance(data.get("usage"), dict):
            usage.update(data["usage"])
            if not data.get("choices"):
                options = item.params.get("stream_options")
                return isinstance(options, dict) and bool(options.get("include_usage"))
        return True

    def stream_end(self, item: Item, event: str, data: dict[str, Any]) -> bool:
        """A Responses stream ends at its final event (or an error event), with no ``[DONE]``."""
        return item.operation == "responses" and (data.get("type") in RESPONSE_ENDS
                                                  or data.get("type") == "error")

    def passes(self, item: Item, event: Event) -> bool:
        """A chat or completions chunk with no ``usage`` or ``error`` in it (OpenAI sends
        ``"usage":null`` on every chunk), a Responses event named and not its last or an error."""
        if item.operation == "responses":
            return event.name not in _READ_EVENTS
        data = event.data
        return not valued(data, b'"usage"') and not valued(data, b'"error"') and not escaped(data)

    # -- execution -------------------------------------------------------------
    async def execute_now(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if operation == "embeddings":
            return await self._embeddings(items)
        return await super().execute_now(operation, items)

    async def _embeddings(self, items: Sequence[Item]) -> list[Outcome]:
        per_item: list[list[Any]] = []
        bad: dict[int, RpcError] = {}
        for i, item in enumerate(items):
            try:
                per_item.append(embedding_inputs(item.params))
            except RpcError as e:
                per_item.append([])
                bad[i] = e
        base = {k: v for k, v in items[0].params.items() if k != "input"}
        chunks = pack(per_item, self.settings.max_inputs, self.settings.max_batch_tokens)
        scatter = Scatter(per_item)
        if len(items) > len(chunks):  # each call's share of the requests sent (the savings ledger)
            share = len(chunks) / len(items)
            for item in items:
                item.options["upstream_share"] = share

        async def run(chunk: Chunk) -> None:  # one request each: the lane charges every one
            owners = [items[s.item] for s in chunk.spans]
            await self._send_chunk(base, chunk, owners, scatter, split_on_400=len(chunk.spans) > 1)

        async with anyio.create_task_group() as tg:
            for chunk in chunks:
                tg.start_soon(run, chunk)
        out = []
        for i in range(len(items)):
            result = bad.get(i) or scatter.result(i)
            out.append(Outcome.fail(result) if isinstance(result, RpcError) else Outcome(result=result))
        return out

    async def _send_chunk(self, base: dict[str, Any], chunk: Chunk, owners: Sequence[Item],
                          scatter: Scatter, split_on_400: bool) -> None:
        try:
            body = await self.api.json("POST", self.op_path("embeddings", base.get("model")),
                                       json={**base, "input": chunk.inputs},
                                       idempotent=True, deadline=batch_deadline(owners))
        except RpcError as e:
            if split_on_400 and e.code == Code.UPSTREAM_ERROR and (e.data or {}).get(
                    "upstream_status") in (400, 413, 422):
                await self._isolate(base, chunk, owners, scatter)
            else:
                scatter.fail(chunk, e)
            return
        data = ordered_data(body, len(chunk.inputs))
        if data is None:
            scatter.fail(chunk, upstream_error(self.name, "malformed embeddings response: expected "
                                               f"{len(chunk.inputs)} vectors indexed from 0"))
            return
        scatter.add(chunk, body, data)
        self.correct(chunk.tokens, body)

    async def _isolate(self, base: dict[str, Any], chunk: Chunk, owners: Sequence[Item],
                       scatter: Scatter) -> None:
        """A request refused as a whole: resend each caller's part alone so the error finds its owner."""
        pos = 0
        for span, owner in zip(chunk.spans, owners, strict=True):
            alone = Chunk([span], chunk.inputs[pos:pos + span.count], span.tokens)
            pos += span.count
            await self._send_chunk(base, alone, [owner], scatter, split_on_400=False)
