"""What a call's tokens cost: a model's rates, from the config's ``price:`` or genai-prices.

genai-prices (pydantic's maintained price data) is read from the snapshot bundled in its wheel;
nothing is fetched at run time. Looking a model up there takes a few hundred microseconds (its
match rules), so each (provider, route, model) is resolved once into plain ``Rates`` and every
call after that is a handful of ``Decimal`` multiplications. A model nobody prices has no rates:
its calls cost "unknown" (None), which is counted, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from multiplexer.core.policy import Price, ProviderConfig, RouteConfig

MTOK = Decimal(1_000_000)
ZERO = Decimal(0)
# Kinds whose batch APIs bill half (OpenAI Batch API, Anthropic Message Batches).
BATCH_DISCOUNTS = {"openai": 0.5, "anthropic": 0.5}
# genai-prices' provider ids for the kinds that speak to a hosted API.
PROVIDER_IDS = {"openai": "openai", "anthropic": "anthropic"}
MAX_RESOLVED = 4096  # models are client strings on /rpc: the lookup cache stays bounded


class Tokens(NamedTuple):
    """A call's usage in one shape: ``input`` is all input, prompt-cache reads and writes included
    (genai-prices' convention); ``cache_read`` and ``cache_write`` are the parts of it that were;
    ``cache_write_1h`` is the part of ``cache_write`` kept an hour (Anthropic bills it higher)."""

    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    cache_write_1h: int = 0


PICO = Decimal(10) ** 12  # amounts are counted in integer pico-dollars: exact, and int-fast


def to_pico(usd_per_mtok: Decimal) -> int:
    """A per-million-token price as pico-dollars per token (exact to $0.000001 per million)."""
    return int((usd_per_mtok * PICO / MTOK).to_integral_value())


def usd_of(pico: int) -> Decimal:
    return Decimal(pico).scaleb(-12)


@dataclass(frozen=True, slots=True)
class Rates:
    """Dollars per million tokens of each kind, plus a fixed amount per call; the same as integer
    pico-dollars per token (``p_*``), which is what each call's arithmetic uses. ``cache_write_1h``:
    an hour-long cache write's rate, where it differs from ``cache_write`` (None: the same)."""

    input: Decimal
    output: Decimal
    cache_read: Decimal
    cache_write: Decimal
    per_call: Decimal = ZERO
    source: str = "config"
    cache_write_1h: Decimal | None = None
    p_input: int = 0
    p_output: int = 0
    p_read: int = 0
    p_write: int = 0
    p_write_1h: int = 0  # over p_write: what an hour-long write costs beyond a five-minute one
    p_call: int = 0

    def __post_init__(self) -> None:
        for name, value in (("p_input", self.input), ("p_output", self.output), ("p_read", self.cache_read),
                            ("p_write", self.cache_write)):
            object.__setattr__(self, name, to_pico(value))
        if self.cache_write_1h is not None:
            object.__setattr__(self, "p_write_1h", to_pico(self.cache_write_1h) - self.p_write)
        object.__setattr__(self, "p_call", int((self.per_call * PICO).to_integral_value()))

    def pico(self, t: Tokens) -> int:
        """What ``t`` costs at these rates, synchronous, in pico-dollars."""
        plain = t.input - t.cache_read - t.cache_write
        return ((plain if plain > 0 else 0) * self.p_input + t.cache_read * self.p_read
                + t.cache_write * self.p_write + t.cache_write_1h * self.p_write_1h
                + t.output * self.p_output + self.p_call)

    def pico_uncached(self, t: Tokens) -> int:
        """What ``t`` would cost had its prompt-cache reads been billed as plain input."""
        plain = t.input - t.cache_write
        return ((plain if plain > 0 else 0) * self.p_input + t.cache_write * self.p_write
                + t.cache_write_1h * self.p_write_1h + t.output * self.p_output + self.p_call)

    def pico_writes(self, t: Tokens) -> int:
        """What ``t``'s prompt-cache writes cost beyond the same tokens as plain input (Anthropic
        bills a five-minute write 1.25x, an hour-long one 2x; 0 where writes cost as input)."""
        extra = t.cache_write * (self.p_write - self.p_input) + t.cache_write_1h * self.p_write_1h
        return extra if extra > 0 else 0

    def pico_unread(self, t: Tokens) -> int:
        """What ``t``'s prompt beyond its cache reads cost above reading it all from the cache:
        for a call moved off the deployment holding its cache, the most the move cost (its last
        turn would have been new input anyway)."""
        plain = t.input - t.cache_read - t.cache_write
        extra = ((plain if plain > 0 else 0) * (self.p_input - self.p_read)
                 + t.cache_write * (self.p_write - self.p_read) + t.cache_write_1h * self.p_write_1h)
        return extra if extra > 0 else 0

    @property
    def priced_tokens(self) -> bool:
        return bool(self.p_input or self.p_output)

    @classmethod
    def of(cls, price: Price) -> Rates:
        inp = price.input_per_mtok
        read, write = price.cached_input_per_mtok, price.cache_write_per_mtok
        return cls(inp, price.output_per_mtok, inp if read is None else read,
                   inp if write is None else write, price.per_call)

    def cost(self, t: Tokens) -> Decimal:
        """What ``t`` costs at these rates (synchronous, no discount), in dollars."""
        return usd_of(self.pico(t))

    def uncached(self, t: Tokens) -> Decimal:
        return usd_of(self.pico_uncached(t))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def tokens_of(usage: Any) -> Tokens | None:
    """A provider's ``usage`` object in one shape; None when it reports no tokens.

    OpenAI chat and embeddings: ``prompt_tokens`` includes ``prompt_tokens_details.cached_tokens``.
    OpenAI Responses: ``input_tokens`` includes ``input_tokens_details.cached_tokens``.
    Anthropic: ``input_tokens`` excludes ``cache_read_input_tokens`` and
    ``cache_creation_input_tokens``, which are added here; the writes' ``cache_creation`` object
    says how many were kept an hour (``ephemeral_1h_input_tokens``), billed at their own rate.
    Gemini (``usageMetadata``): ``promptTokenCount`` includes ``cachedContentTokenCount``; the
    thoughts are output, a tool's prompt input.
    """
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        return Tokens(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached)
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return _gemini(usage) if "promptTokenCount" in usage or "candidatesTokenCount" in usage else None
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # the Responses API
        return Tokens(_int(usage.get("input_tokens")), _int(usage.get("output_tokens")),
                      _int(details.get("cached_tokens")))
    read, write = _int(usage.get("cache_read_input_tokens")), _int(usage.get("cache_creation_input_tokens"))
    hour = 0
    creation = usage.get("cache_creation")
    if isinstance(creation, dict):
        hour = _int(creation.get("ephemeral_1h_input_tokens"))
        if "cache_creation_input_tokens" not in usage:  # the parts without their sum
            write = _int(creation.get("ephemeral_5m_input_tokens")) + hour
        hour = min(hour, write)
    return Tokens(_int(usage.get("input_tokens")) + read + write, _int(usage.get("output_tokens")),
                  read, write, hour)


def _gemini(meta: dict[str, Any]) -> Tokens:
    """Gemini's ``usageMetadata`` in the one shape (its translations' usage is read as theirs)."""
    cached = _int(meta.get("cachedContentTokenCount"))
    prompt = _int(meta.get("promptTokenCount")) + _int(meta.get("toolUsePromptTokenCount"))
    return Tokens(max(prompt, cached), _int(meta.get("candidatesTokenCount"))
                  + _int(meta.get("thoughtsTokenCount")), cached)


def usage_of(result: dict[str, Any]) -> Any:
    """A result's usage object: ``usage``, or a native Gemini answer's ``usageMetadata``."""
    usage = result.get("usage")
    return result.get("usageMetadata") if usage is None else usage


def _mtok(value: Any) -> Decimal | None:
    """A genai-prices per-MTok price as one number (a tiered price: its base tier)."""
    if value is None:
        return None
    base = getattr(value, "base", value)
    return base if isinstance(base, Decimal) else Decimal(str(base))


def catalog_rates(model: str, provider_id: str | None, api_url: str | None) -> Rates | None:
    """The model's standard rates in genai-prices' bundled snapshot; None when it has none."""
    from genai_prices import data_snapshot

    snapshot = data_snapshot.get_snapshot()
    try:
        provider, info = snapshot.find_provider_model(model, None, provider_id, api_url)
    except LookupError:
        return None
    price = info.get_prices(datetime.now(tz=UTC))
    fields = price.__dict__
    input_ = _mtok(fields.get("input_mtok"))
    output = _mtok(fields.get("output_mtok"))
    if input_ is None and output is None:
        return None
    input_ = input_ or ZERO
    read = _mtok(fields.get("cache_read_mtok"))
    write = _mtok(fields.get("cache_write_mtok"))
    return Rates(input_, output or ZERO, input_ if read is None else read,
                 input_ if write is None else write, ZERO, f"genai-prices:{provider.id}/{info.id}",
                 _mtok(fields.get("cache_write_1h_mtok")))


class Prices:
    """Rates and batch discounts by provider, route and model, resolved once each."""

    def __init__(self, providers: dict[str, ProviderConfig], routes: dict[str, RouteConfig]) -> None:
        self.providers = providers
        self.routes = routes
        self._resolved: dict[tuple[str, str, str], Rates | None] = {}
        self._kept: dict[tuple[str, str], tuple[int, int]] = {}

    def rates(self, route: str, provider: str, model: str | None) -> Rates | None:
        """The rates a call on ``route`` (served by ``provider``) pays for ``model``."""
        key = (route, provider, model or "")
        try:
            return self._resolved[key]
        except KeyError:
            pass
        rates = self._resolve(route, provider, model)
        if len(self._resolved) >= MAX_RESOLVED:
            self._resolved.clear()
        self._resolved[key] = rates
        return rates

    def _resolve(self, route: str, provider: str, model: str | None) -> Rates | None:
        rconf = self.routes.get(route)
        pconf = self.providers.get(provider)
        if rconf is not None and rconf.price is not None:
            return Rates.of(rconf.price)
        if pconf is not None and pconf.price is not None:
            return Rates.of(pconf.price)
        if not model or pconf is None:
            return None
        base_url = pconf.extra.get("base_url")
        pid = PROVIDER_IDS.get(pconf.kind)
        if pid is None:
            return None  # local models, MCP servers, JSON-RPC upstreams: priced only by config
        api_url = base_url if isinstance(base_url, str) and pid not in base_url else None
        return (catalog_rates(model, None, api_url) if api_url else None) or catalog_rates(model, pid, None)

    def batch_kept(self, route: str, provider: str) -> tuple[int, int]:
        """(numerator, denominator) of the share of the price a batch call pays, for int math."""
        key = (route, provider)
        found = self._kept.get(key)
        if found is None:
            kept = (1 - self.batch_discount(route, provider)).as_integer_ratio()
            found = self._kept[key] = (kept[0], kept[1])
        return found

    def batch_discount(self, route: str, provider: str) -> Decimal:
        """The share taken off a call that went through the provider's batch API."""
        rconf = self.routes.get(route)
        if rconf is not None and rconf.batch_discount is not None:
            return Decimal(str(rconf.batch_discount))
        pconf = self.providers.get(provider)
        if pconf is None:
            return ZERO
        if pconf.batch_discount is not None:
            return Decimal(str(pconf.batch_discount))
        return Decimal(str(BATCH_DISCOUNTS.get(pconf.kind, 0)))


def data_version() -> str:
    """The price data's version, recorded with the spend (genai-prices' package version)."""
    from importlib.metadata import version

    return f"genai-prices {version('genai-prices')}"


def out_budget(params: Any) -> int | None:
    """The most output tokens a call's params allow (``max_tokens`` and its names), if they say."""
    if not isinstance(params, dict):
        return None
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = params.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# Provider operations that bill nothing: a call of one is never priced nor reserved against a
# budget (Anthropic's token counting is free and answers with no usage).
UNBILLED = frozenset({"count_tokens"})
