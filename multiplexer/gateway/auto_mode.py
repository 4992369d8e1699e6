"""``mode: auto``: a route that runs a call on its provider's batch API when the call's deadline
allows the completion window, and now otherwise; decided at admission, per call. A stream is
always answered now (a batch API cannot stream)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import BatchCapable, Provider
from multiplexer.core.router import Resolved

_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FLEX_MARGIN_S = 3600.0  # OpenAI's flex tier on an auto route: the completion window and an hour
_AS_MODE: dict[tuple[int, str], RouteConfig] = {}  # an auto route as batch or sync, made once


def completion_window_s(provider: Provider) -> float | None:
    """The provider's batch completion window in seconds (``batch_completion_window: 24h``);
    None when it has no batch API."""
    if not isinstance(provider, BatchCapable):
        return None
    raw = getattr(getattr(provider, "settings", None), "batch_completion_window", "24h")
    m = _WINDOW.match(str(raw))
    return float(m.group(1)) * _UNIT[m.group(2)] if m else None


def flex_deadline_s(provider: Provider) -> float | None:
    """The deadline ``service_tier: "flex"`` stands for on an auto route (``/v1``): long enough
    for the provider's batch API; None when it has none (the call goes now)."""
    window = completion_window_s(provider)
    return None if window is None else window + FLEX_MARGIN_S


def deadline_mode(resolved: Resolved, timeout_ms: float | None, provider: Provider,
                  stream: bool = False) -> Resolved:
    """``mode: auto``: the route as ``mode: batch`` for a whole call whose deadline (its own, else
    the route's ``max_latency_s``) allows the provider's completion window, as ``sync`` otherwise."""
    route = resolved.route
    window = completion_window_s(provider)
    allowed = timeout_ms / 1000.0 if timeout_ms is not None else route.max_latency_s
    mode = "batch" if not stream and window is not None and allowed is not None and allowed >= window \
        else "sync"
    as_mode = _AS_MODE.get((id(route), mode))
    if as_mode is None:
        update: dict[str, Any] = {"mode": mode}
        if mode == "batch" and route.timeout_ms is None and route.max_latency_s is not None:
            update["timeout_ms"] = route.max_latency_s * 1000.0  # a job's call waits its window
        as_mode = _AS_MODE[(id(route), mode)] = route.model_copy(update=update)
    return dataclasses.replace(resolved, route=as_mode)
