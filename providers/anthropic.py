"""``kind: anthropic``: the Messages API, one request per call, and Message Batches for jobs;
token counting (``/v1/messages/count_tokens``) for calls that come to that endpoint.

Authentication is ``x-api-key`` plus ``anthropic-version``; limits are learned
from ``anthropic-ratelimit-*`` headers (RFC 3339 resets) and a 429 or a 529
(overloaded) pauses the lane for ``retry-after`` before the retry.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pydantic import Field, SecretStr

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import invalid_params
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import ProviderContext

from .api_client import ApiClient, item_error
from .batch.anthropic_batch import AnthropicBatchBackend
from .batch.backend import BatchApiSettings
from .endpoints import EndpointSettings
from .llm_base import LlmProvider
from .packing import chat_tokens
from .prompt_cache import PromptCacheRouteSettings, PromptCacheSettings, anthropic_markers, minimum, mode_of
from .ratelimit_headers import anthropic_limits
from .sse_relay import Event

# Events read whole are the rest: usage (message_start, message_delta), the end, an error.
_CONTENT_EVENTS = frozenset({"content_block_start", "content_block_delta", "content_block_stop", "ping"})
OPERATIONS = {"messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens"}


class AnthropicSettings(BatchApiSettings, EndpointSettings, PromptCacheSettings):
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


# What a response used, as the tpm limit counts it: ``input_tokens`` leaves out the prompt-cache
# reads and writes, which are input the provider's own limit counts all the same.
USED = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def usage_total(body: object) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    numbers = [v for k, v in usage.items() if k in USED and isinstance(v, int) and not isinstance(v, bool)]
    return sum(numbers) if numbers else None


class AnthropicProvider(LlmProvider):
    Settings = AnthropicSettings
    RouteSettings = PromptCacheRouteSettings
    paths = OPERATIONS
    usage_total = staticmethod(usage_total)

    def __init__(self, ctx: ProviderContext) -> None:
        self.settings: AnthropicSettings = ctx.settings
        api = ApiClient(ctx, self.settings.base_url, auth_headers(self.settings), anthropic_limits)
        super().__init__(ctx, api, lambda api: AnthropicBatchBackend(api, self.settings))

    def prepare(self, route: RouteConfig, item: Item) -> None:
        params, model = self.request_body(item)
        if item.operation == "count_tokens":  # a request against rpm, no tokens spent
            self.require_messages(params)
            item.group = ("count_tokens", model)
            self.charge(route, item, 0)
            return
        max_tokens = params.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise invalid_params("'max_tokens' must be a positive integer", param="max_tokens")
        self.require_messages(params)
        if mode_of(item.options, self.settings) == "auto":  # markers where the caller set none
            marked = anthropic_markers(params, minimum(model, self.settings))
            if marked is not None:
                item.params = params = marked
        item.group = ("messages", model)
        self.charge(route, item, chat_tokens(params))

    def idempotent(self, item: Item) -> bool:
        return item.operation == "count_tokens" or super().idempotent(item)

    def dedup_safe(self, item: Item) -> bool:
        return item.operation == "count_tokens" or super().dedup_safe(item)

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if operation == "count_tokens":  # Message Batches do not count: always a request each
            return await self.execute_now(operation, items)
        return await super().execute(operation, items)

    def stream_event(self, item: Item, event: str, data: dict[str, Any],
                     usage: dict[str, Any]) -> bool:
        """Named events pass through; usage is in ``message_start`` and ``message_delta``."""
        if event == "error" or data.get("type") == "error":
            raise item_error(self.name, data, None)
        if event == "message_start" and isinstance(data.get("message"), dict):
            found = data["message"].get("usage")
        else:
            found = data.get("usage") if event == "message_delta" else None
        if isinstance(found, dict):  # the writes' split by lifetime (an object) is priced too
            usage.update({k: v for k, v in found.items()
                          if isinstance(v, int) or (k == "cache_creation" and isinstance(v, dict))})
        return True

    def stream_end(self, item: Item, event: str, data: dict[str, Any]) -> bool:
        return event == "message_stop" or data.get("type") == "message_stop"

    def passes(self, item: Item, event: Event) -> bool:
        """A content block's events and pings: no usage in them, and no error unless the bytes
        say ``"error"`` somewhere."""
        return event.name in _CONTENT_EVENTS and b'"error"' not in event.data
