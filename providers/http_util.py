"""Shared HTTP plumbing for providers: pooled clients, retry classification, header parsing."""

from __future__ import annotations

import email.utils
import functools
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

import httpx

from multiplexer.core.call import Item
from multiplexer.core.errors import RpcError, upstream_error, upstream_unavailable
from multiplexer.core.retry import Retryable

from .health import ConnectionHealth

# Statuses where the upstream did not run the request: always safe to retry.
SAFE_STATUSES = {408, 425, 429, 503, 529}
# Statuses where it may have run: retried only for idempotent calls.
UNSAFE_STATUSES = {500, 502, 504}


def make_client(timeout_s: float, max_connections: int, **kwargs: object) -> httpx.AsyncClient:
    """A pooled client (pass ``transport=`` for the lean connection layer on hot paths)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=max_connections),
        **kwargs,  # type: ignore[arg-type]
    )


def all_idempotent(items: Sequence[Item]) -> bool:
    return all(item.options.get("idempotent") for item in items)


def batch_deadline(items: Sequence[Item]) -> float | None:
    deadlines = [i.deadline for i in items if i.deadline is not None]
    return max(deadlines) if deadlines else None


Wall = Callable[[], float]  # the clock's wall time (``Clock.wall``), read only when a date needs it


def parse_retry_after(value: str | None, wall: Wall) -> float | None:
    """Seconds from a Retry-After header (delta seconds or HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - wall())


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | None) -> float | None:
    """OpenAI reset durations: ``12ms``, ``6s``, ``1m30s``, ``2h0m0s``."""
    if not value:
        return None
    return _duration(value)


@functools.lru_cache(maxsize=4096)  # two per upstream answer, and the values repeat
def _duration(value: str) -> float | None:
    value = value.strip()
    for unit in ("ms", "s"):  # one unit, the common case: no regex
        number = value.removesuffix(unit)
        head, dot, tail = number.partition(".")
        if (number is not value and number.isascii() and head.isdigit()
                and (tail.isdigit() or not dot)):
            return float(number) * _UNIT_SECONDS[unit]
    pos, total = 0, 0.0
    for m in _DURATION.finditer(value):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos != len(value) or pos == 0:
        try:
            return float(value)
        except ValueError:
            return None
    return total


def parse_rfc3339(value: str | None, wall: Wall) -> float | None:
    """Seconds until an RFC 3339 instant (Anthropic resets)."""
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(0.0, when.timestamp() - wall())


def classify(provider: str, exc: Exception | None, response: httpx.Response | None,
             idempotent: bool, wall: Wall) -> Exception:
    """Turn a transport failure or a bad status into Retryable or a final RpcError."""
    if exc is not None:
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
            return Retryable(upstream_unavailable(provider, f"{type(exc).__name__}: {exc}"))
        unavailable = upstream_unavailable(provider, f"{type(exc).__name__}: {exc}")
        return Retryable(unavailable) if idempotent else unavailable
    assert response is not None
    status = response.status_code
    detail = response.text[:300] if response.content else response.reason_phrase
    final: RpcError = upstream_error(provider, detail, status)
    retry_after = parse_retry_after(response.headers.get("retry-after"), wall)
    if retry_after is not None and final.data is not None:
        final.data["retry_after"] = retry_after
    if status in SAFE_STATUSES or (status in UNSAFE_STATUSES and idempotent):
        return Retryable(final, retry_after)
    return final


async def send(sender: Callable[[httpx.Request], Awaitable[httpx.Response]],
               request: httpx.Request, provider: str, idempotent: bool, wall: Wall,
               health: ConnectionHealth | None = None) -> httpx.Response:
    """One attempt through ``sender`` (a client's or a transport's send): a 2xx response,
    or raise Retryable / RpcError. ``health`` learns whether the upstream answered."""
    try:
        response = await sender(request)
    except httpx.HTTPError as e:
        if health is not None:
            health.failed(e)
        raise classify(provider, e, None, idempotent, wall) from None
    if health is not None:
        health.reached()
    if response.status_code >= 400:
        raise classify(provider, None, response, idempotent, wall)
    return response
