"""How long a ``/v1`` caller can wait, as its call's deadline (``Call.timeout_ms``): the
``x-multiplexer-deadline`` header (seconds, or an RFC 3339 time), else ``_meta.timeout_ms``, else
OpenAI's ``service_tier: "flex"`` on a ``mode: auto`` route. A ``mode: auto`` route runs a call on
its provider's batch API when the deadline allows the completion window (``gateway/auto_mode``);
the SDKs have no other way to say a call is patient."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from multiplexer.core.errors import invalid_params, invalid_request
from multiplexer.faces.v1.common import HttpError
from multiplexer.gateway.auto_mode import flex_deadline_s
from multiplexer.gateway.gateway import Gateway

HEADER = b"x-multiplexer-deadline"
_NAME = HEADER.decode()


def deadline_ms(gateway: Gateway, headers: list[tuple[bytes, bytes]], name: str,
                body: dict[str, Any]) -> float | None:
    """The call's deadline in ms, or None (the route's own). Costs a scan of the headers and two
    key lookups when the caller says nothing."""
    for key, value in headers:
        if key == HEADER:
            return header_ms(value)
    if "_meta" in body and (ms := meta_timeout_ms(body["_meta"])) is not None:
        return ms
    if body.get("service_tier") == "flex":
        route = gateway.resolve(name).route  # a group's: its first route
        if route.mode == "auto" and (s := flex_deadline_s(gateway.providers[route.provider])) is not None:
            return s * 1000.0
    return None


def header_ms(raw: bytes, now: Callable[[], float] = time.time) -> float:
    """``x-multiplexer-deadline``: seconds the caller can wait, or the RFC 3339 time it waits
    until (with its offset: ``2026-12-07T09:00:00Z``); anything else, or a time past, is a 400."""
    text = raw.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = until(text, now())
    if not (math.isfinite(seconds) and seconds > 0):
        raise HttpError(400, invalid_request(
            f"{_NAME} must be the seconds the caller can wait (a positive number) or an RFC 3339 "
            f"time to come, like 2026-12-07T09:00:00Z; got {text[:64]!r}"), param=_NAME)
    return seconds * 1000.0


def until(text: str, now: float) -> float:
    """Seconds from ``now`` to the RFC 3339 time ``text``; NaN when it is not one (no offset)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return math.nan
    return when.timestamp() - now if when.tzinfo is not None else math.nan


def meta_timeout_ms(meta: Any) -> float | None:
    """``_meta.timeout_ms``, as on ``/rpc`` (``_meta``'s other keys are not read on ``/v1``)."""
    if not isinstance(meta, dict):
        raise HttpError(400, invalid_params("_meta must be an object"), param="_meta")
    ms = meta.get("timeout_ms")
    if ms is None:
        return None
    if not isinstance(ms, int | float) or isinstance(ms, bool) or not math.isfinite(ms) or ms <= 0:
        raise HttpError(400, invalid_params("_meta.timeout_ms must be a positive number"),
                        param="_meta.timeout_ms")
    return float(ms)
