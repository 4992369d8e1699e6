"""Rate limits as the upstream reports them, read from response headers.

OpenAI sends ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` with
resets as durations (``12ms``, ``1m30s``); Anthropic sends
``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-*`` with RFC
3339 resets. Both become ``Observation``s the lane's limiter learns from, so the
lane slows down before the upstream starts answering 429.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from multiplexer.core.limiter import Limiter

from .http_util import Wall, parse_duration, parse_retry_after, parse_rfc3339


@dataclass(frozen=True, slots=True)
class Observation:
    kind: str  # "requests" or "tokens"
    limit: float | None
    remaining: float
    reset_in: float


Parser = Callable[[Mapping[str, str], Wall], list[Observation]]


def _number(value: str | None) -> float | None:
    """A header number; None when absent, malformed, negative (``-1`` means unknown) or infinite."""
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _observe(kind: str, limit: str | None, remaining: str | None, reset_in: float | None,
             ) -> Observation | None:
    left = _number(remaining)
    if left is None:
        return None
    return Observation(kind, _number(limit), left, reset_in if reset_in is not None else 0.0)


def openai_limits(headers: Mapping[str, str], wall: Wall) -> list[Observation]:
    out = []
    for kind in ("requests", "tokens"):
        obs = _observe(
            kind,
            headers.get(f"x-ratelimit-limit-{kind}"),
            headers.get(f"x-ratelimit-remaining-{kind}"),
            parse_duration(headers.get(f"x-ratelimit-reset-{kind}")),
        )
        if obs is not None:
            out.append(obs)
    return out


def anthropic_limits(headers: Mapping[str, str], wall: Wall) -> list[Observation]:
    """Requests, and tokens: the combined bucket when sent, else the tighter of input/output."""
    def read(name: str, kind: str) -> Observation | None:
        prefix = f"anthropic-ratelimit-{name}"
        return _observe(kind, headers.get(f"{prefix}-limit"), headers.get(f"{prefix}-remaining"),
                        parse_rfc3339(headers.get(f"{prefix}-reset"), wall))

    out = []
    if (requests := read("requests", "requests")) is not None:
        out.append(requests)
    tokens = read("tokens", "tokens")
    if tokens is None:
        split = [o for o in (read("input-tokens", "tokens"), read("output-tokens", "tokens")) if o]
        tokens = min(split, key=lambda o: o.remaining) if split else None
    if tokens is not None:
        out.append(tokens)
    return out


def apply(limiter: Limiter, observations: list[Observation]) -> None:
    for obs in observations:
        limiter.observe(obs.kind, obs.limit, obs.remaining, obs.reset_in)


def wait_hint(headers: Mapping[str, str], observations: list[Observation], wall: Wall) -> float | None:
    """How long to wait after a 429/529: Retry-After, else the reset of an exhausted bucket."""
    retry_after = parse_retry_after(headers.get("retry-after"), wall)
    if retry_after is not None:
        return retry_after
    ms = _number(headers.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000.0
    exhausted = [o.reset_in for o in observations if o.remaining <= 0 and o.reset_in > 0]
    return max(exhausted) if exhausted else None
