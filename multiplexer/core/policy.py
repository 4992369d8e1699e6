"""The policy a provider and a lane need: batching, limits, retries, quotas, and the route/provider keys.

These live in the core so that providers and the lane depend on them without
depending on config loading (the composition layer), which builds them from YAML.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from multiplexer.core.cache_affinity import ModeSetting


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Quota(Strict):
    rpm: float | None = Field(default=None, gt=0)
    tpm: float | None = Field(
        default=None, gt=0,
        description="tokens per minute: each call charged its estimate at admission, settled to its usage")
    concurrency: int | None = Field(default=None, ge=1)
    batch_calls_per_day: int | None = Field(
        default=None, ge=1,
        description="calls carried by batch jobs (jobs.submit, mode: batch routes) per UTC day")


class BudgetUsd(Strict):
    """A spend cap in US dollars per period (a key's or a team's); unset periods do not cap."""

    daily: Decimal | None = Field(default=None, ge=0, description="reset at midnight in budgets.timezone")
    monthly: Decimal | None = Field(default=None, ge=0, description="reset on the 1st")
    total: Decimal | None = Field(default=None, ge=0, description="never reset")
    alert_at: float | None = Field(default=None, gt=0, le=1,
                                   description="a share of a period's cap: logged and counted once")


class Price(Strict):
    """A model's price in US dollars where genai-prices has none or the deal differs (local models,
    self-hosted endpoints, negotiated rates); unset token kinds cost what input costs."""

    input_per_mtok: Decimal = Field(default=Decimal(0), ge=0, description="per million input tokens")
    output_per_mtok: Decimal = Field(default=Decimal(0), ge=0, description="per million output tokens")
    cached_input_per_mtok: Decimal | None = Field(
        default=None, ge=0, description="per million prompt-cache reads (unset: the input price)")
    cache_write_per_mtok: Decimal | None = Field(
        default=None, ge=0, description="per million prompt-cache writes (unset: the input price)")
    per_call: Decimal = Field(default=Decimal(0), ge=0, description="added to every call")


class BatchPolicy(Strict):
    max_items: int = Field(default=1, ge=1)
    max_wait_ms: float = Field(default=0.0, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    # Send a partial batch at once when nothing is in flight: batching then costs no
    # latency at low load, and batches still fill while earlier ones are upstream.
    eager: bool = True


class Limits(Strict):
    rpm: float | None = Field(default=None, gt=0)
    tpm: float | None = Field(default=None, gt=0)
    concurrency: int = Field(default=16, ge=1)
    max_queue: int = Field(default=10_000, ge=1)


class RetryPolicy(Strict):
    attempts: int = Field(default=3, ge=1)
    base_wait_ms: float = Field(default=50, ge=0)
    max_wait_ms: float = Field(default=5_000, ge=0)


class BreakerPolicy(Strict):
    """A circuit breaker on a provider's endpoint (and on each of its ``base_urls``)."""

    allowed_fails: int = Field(default=3, ge=1, description="failures within window_s that open it")
    window_s: float = Field(default=30.0, gt=0, description="the window failures are counted in")
    cooldown_s: float = Field(default=20.0, gt=0,
                              description="open this long; then one probe call decides (half-open)")


# What a call may fall back on (``on:``); an integer there is an upstream HTTP status.
FallbackReason = Literal["rate_limit", "server_error", "connection", "timeout", "malformed",
                         "overloaded", "breaker_open", "batch_failed"]
DEFAULT_FALLBACK_ON: tuple[FallbackReason, ...] = (
    "rate_limit", "server_error", "connection", "timeout", "malformed", "overloaded", "breaker_open",
    "batch_failed")


class ProviderConfig(BaseModel):
    """Common keys; the rest belong to the provider kind (its ``Settings``, checked at load)."""

    model_config = ConfigDict(extra="allow")

    kind: str
    batch: BatchPolicy = Field(default_factory=BatchPolicy)
    limits: Limits = Field(default_factory=Limits)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    timeout_ms: float = Field(default=60_000, gt=0)
    breaker: BreakerPolicy | None = Field(
        default=None, description="a circuit breaker: while open, calls go to their fallback at once")

    price: Price | None = Field(default=None, description="this price instead of genai-prices'")
    batch_discount: float | None = Field(
        default=None, ge=0, le=1, description="share taken off the price of calls sent through the "
        "batch API (unset: 0.5 for kind openai and anthropic, else 0)")

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RouteConfig(BaseModel):
    """Common keys; the rest belong to the provider's kind (its ``RouteSettings``, checked at load)
    and reach the provider in ``item.options``."""

    model_config = ConfigDict(extra="allow")

    provider: str
    method: str | None = None
    operation: str = "call"
    params: dict[str, Any] = Field(default_factory=dict)
    dedup: bool | None = None
    dedup_scope: Literal["identity", "global"] = "identity"
    cache_ttl_s: float | None = Field(default=None, gt=0)
    timeout_ms: float | None = Field(default=None, gt=0)
    priority: int = 0
    mode: Literal["sync", "batch", "auto"] = Field(
        default="sync", description="sync: each call now; batch: as batch jobs; auto: through the "
        "provider's batch API when the call's deadline allows its completion window, else now; the "
        "deadline is the x-multiplexer-deadline header on /v1 (seconds or an RFC 3339 time), else "
        "_meta.timeout_ms (/rpc, MCP, /v1), else on /v1 service_tier: flex (the provider's batch "
        "window), else max_latency_s")
    max_latency_s: float | None = Field(
        default=None, gt=0, description="mode: auto: how long a call that names no deadline may take")
    # MCP clients that opt into the tasks extension get a task handle instead of a held request
    # (always so for mode: batch; this asks for it on a sync route of a provider with a batch API).
    task: bool = False
    batch: BatchPolicy | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Model names a ``/v1`` request may ask for to reach this route (OpenAI/Anthropic faces).
    models: list[str] = Field(default_factory=list)
    # Fallbacks (docs/fallbacks.md): other routes tried in order when this one fails in a way
    # another provider may not.
    fallbacks: list[str] = Field(
        default_factory=list, description="routes tried in order when this one fails (429 after "
        "its retries, 5xx, connection failures, timeouts); their own fallbacks follow theirs")
    context_window_fallbacks: list[str] = Field(
        default_factory=list, description="routes tried in order when the upstream refuses the "
        "prompt as too long for its context window")
    on: list[FallbackReason | int] | None = Field(
        default=None, description="what falls back (default: rate_limit, server_error, connection, "
        "timeout, malformed, overloaded, breaker_open, batch_failed); an integer is an upstream "
        "HTTP status")
    max_attempts: int = Field(
        default=3, ge=1, description="upstream requests of one call over all its routes, retries "
        "included (with fallbacks or set here)")

    price: Price | None = Field(default=None, description="this price instead of genai-prices'")
    batch_discount: float | None = Field(
        default=None, ge=0, le=1, description="share taken off the price of calls sent through the "
        "batch API (unset: 0.5 for kind openai and anthropic, else 0)")

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class GroupConfig(Strict):
    """One public model name served by several routes (``groups:``)."""

    routes: list[str] = Field(min_length=1, description="the routes that serve the group's name")
    strategy: Literal["least_busy", "weighted", "latency", "cost"] = Field(
        default="least_busy", description="which route a call tries first: fewest calls in flight, "
        "at random by weights, lowest recent latency (cost: needs prices, refused at load for now)")
    weights: dict[str, float] = Field(
        default_factory=dict, description="strategy weighted: a route's weight (default 1)")
    fallbacks: list[str] = Field(
        default_factory=list, description="routes tried after every route of the group failed")
    context_window_fallbacks: list[str] = Field(
        default_factory=list, description="routes tried when the prompt is too long for the group")
    on: list[FallbackReason | int] | None = Field(
        default=None, description="what moves to the next route (as on a route)")
    max_attempts: int = Field(default=3, ge=1, description="upstream requests of one call, all "
                              "routes and retries together")
    affinity: ModeSetting | None = Field(
        default=None, description="calls that share a prompt-cache key keep to one route while it "
        "is healthy and not saturated: prefix (prompt_cache_key, else x-session-id, else the system "
        "prompt, tools and first user message), session (prompt_cache_key, else x-session-id, else "
        "the body's metadata.session_id, metadata.user_id or user), off; default prefix when every "
        "route is chat or messages, else off")
