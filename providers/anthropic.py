"""``kind: anthropic``: the Messages API, one request per call, and Message Batches for jobs.

Authentication is ``x-api-key`` plus ``anthropic-version``; limits are learned
from ``anthropic-ratelimit-*`` headers (RFC 3339 resets) and a 429 or a 529
(overloaded) pauses the lane for ``retry-after`` before the retry.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pydantic import Field, SecretStr

from multiplexer.batching import CountFormation
from multiplexer.call import Item, Outcome
from multiplexer.config import BatchPolicy, RouteConfig
from multiplexer.errors import RpcError, invalid_params
from multiplexer.provider import Provider, ProviderContext

from .api_client import ApiClient, run_each
from .batch.anthropic_batch import AnthropicBatchBackend
from .batch.backend import BatchApiSettings
from .batch.jobs import JobManager
from .batch.sync_fallback import SyncFallback
from .dedup_rules import deterministic_chat
from .formations import PackOrSingle
from .packing import chat_tokens
from .ratelimit_headers import anthropic_limits

OPERATIONS = {"messages": "/v1/messages"}


class AnthropicSettings(BatchApiSettings):
    base_url: str = "https://api.anthropic.com"
    api_key: SecretStr | None = None  # falls back to $ANTHROPIC_API_KEY; never logged
    anthropic_version: str = "2023-06-01"
    beta: list[str] = Field(default_factory=list)
    headers: dict[str, str] = Field(default_factory=dict)
    batch_max_requests: int = Field(default=100_000, ge=1)
    batch_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)


def auth_headers(settings: AnthropicSettings) -> dict[str, str]:
    key = (settings.api_key.get_secret_value() if settings.api_key
           else os.environ.get("ANTHROPIC_API_KEY"))
    headers = {"anthropic-version": settings.anthropic_version,
               **settings.headers}
    if key:
        headers["x-api-key"] = key
    if settings.beta:
        headers["anthropic-beta"] = ",".join(settings.beta)
    return headers


def usage_total(body: object) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    numbers = [v for k, v in usage.items() if k in ("input_tokens", "output_tokens",
                                                    "cache_creation_input_tokens")
               and isinstance(v, int)]
    return sum(numbers) if numbers else None


class AnthropicProvider(Provider):
    Settings = AnthropicSettings

    def __init__(self, ctx: ProviderContext) -> None:
        super().__init__(ctx)
        self.settings: AnthropicSettings = ctx.settings
        self.api = ApiClient(ctx, self.settings.base_url, auth_headers(self.settings),
                             anthropic_limits)
        sync = SyncFallback(self.run_one, ctx.limiter, ctx.clock, ctx.config.limits.concurrency)
        self.jobs = JobManager(ctx, self.settings, AnthropicBatchBackend(self.api, self.settings),
                               sync)

    async def start(self) -> None:
        await self.api.start()
        await self.jobs.start()

    async def aclose(self) -> None:
        try:
            await self.jobs.aclose()
        finally:
            await self.api.aclose()

    def prepare(self, route: RouteConfig, item: Item) -> None:
        if item.operation not in OPERATIONS:
            raise invalid_params(f"{self.name} has no operation {item.operation!r}",
                                 operations=sorted(OPERATIONS))
        params = item.params
        if not isinstance(params, dict):
            raise invalid_params("params must be an object (the Messages request body)")
        model = params.get("model")
        if not isinstance(model, str) or not model:
            raise invalid_params("'model' is required (in params or the route's params)",
                                 param="model")
        max_tokens = params.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise invalid_params("'max_tokens' must be a positive integer", param="max_tokens")
        messages = params.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid_params("'messages' must be a non-empty array", param="messages")
        if params.get("stream"):
            raise invalid_params("streaming responses are not supported through the gateway",
                                 param="stream")
        item.group = ("messages", model)
        item.options["mode"] = route.mode
        tokens = chat_tokens(params)
        if route.mode == "batch":
            item.options["tokens"] = tokens
            item.tokens = 0
        else:
            item.tokens = tokens

    def dedup_safe(self, item: Item) -> bool:
        return deterministic_chat(item.params)

    def formation(self, policy: BatchPolicy) -> PackOrSingle:
        count = CountFormation(policy.max_items, policy.max_wait_ms / 1000.0, policy.max_tokens)
        return PackOrSingle(count, frozenset())

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if items[0].options.get("mode") == "batch":
            return await self.jobs.run_items(items)
        return await run_each(items, self.run_one, self.ctx)

    async def run_one(self, item: Item) -> Outcome:
        idempotent = bool(item.options.get("idempotent")) or deterministic_chat(item.params)
        try:
            body = await self.api.json("POST", OPERATIONS[item.operation], json=item.params,
                                       idempotent=idempotent, deadline=item.deadline)
        except RpcError as e:
            return Outcome.fail(e)
        actual = usage_total(body)
        if actual is not None and item.tokens:
            self.ctx.limiter.correct_tokens(item.tokens, actual)
        return Outcome(result=body)
