"""What a failed call's error means for fallbacks and circuit breakers.

One reason per error, from its code and data (never from the provider's kind):
``rate_limit`` (429/529 after the route's retries, or this gateway's own limit), ``server_error``
(5xx), ``connection`` (never reached or lost the upstream), ``timeout`` (the upstream request
timed out), ``malformed`` (a reply that is not the API's), ``overloaded`` (the lane's queue is
full), ``breaker_open``, ``batch_failed`` (a remote batch failed whole: its status failed,
expired or cancelled by the vendor, or its submission refused), ``context_window`` (the prompt is
too long for the model), or None: the caller's own error (400, 401, 403, 404, 422), a cancel,
the call's deadline; those never fall back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from multiplexer.core.errors import Code, RpcError

_CONTEXT_CODES = {"context_length_exceeded", "string_above_max_length", "model_context_window_exceeded"}
_CONTEXT_TEXT = re.compile(
    r"context[ _-]?(length|window)|maximum context|prompt is too long|too many (input )?tokens"
    r"|input is too long|reduce the length of the messages", re.IGNORECASE)
_TIMEOUTS = ("ReadTimeout", "WriteTimeout", "PoolTimeout", "ConnectTimeout", "TimeoutException")

# the reasons that say the upstream is unwell (a breaker counts them); the others do not
UNWELL = frozenset({"rate_limit", "server_error", "connection", "timeout", "malformed"})


def reason_of(error: RpcError) -> str | None:
    """Why ``error`` happened, as a fallback reason; None for the caller's own errors."""
    data = error.data or {}
    code = error.code
    if data.get("batch_failed") is True:
        return "batch_failed"
    if code == Code.UPSTREAM_ERROR:
        status = data.get("upstream_status")
        detail = str(data.get("detail", ""))
        if status in (429, 529):
            return "rate_limit"
        if status in (400, 413, 422) and _is_context(data.get("upstream_code"), detail):
            return "context_window"
        if isinstance(status, int) and status >= 500:
            return "server_error"
        if status == 408:
            return "timeout"
        if "malformed" in detail:
            return "malformed"
        return None
    if code == Code.UPSTREAM_UNAVAILABLE:
        if data.get("breaker") is not None:
            return "breaker_open"
        detail = str(data.get("detail", ""))
        return "timeout" if detail.startswith(_TIMEOUTS) else "connection"
    if code == Code.RATE_LIMITED:
        return "rate_limit"
    if code == Code.OVERLOADED:
        return "overloaded"
    return None


def _is_context(upstream_code: object, detail: str) -> bool:
    return upstream_code in _CONTEXT_CODES or bool(_CONTEXT_TEXT.search(detail))


def matches(error: RpcError, reason: str | None, on: Iterable[str | int]) -> bool:
    """Whether ``on`` (reasons and upstream statuses) covers this error."""
    status = (error.data or {}).get("upstream_status")
    return any(o == reason if isinstance(o, str) else o == status for o in on)
