"""Error codes and the one exception type that carries them to clients.

Errors are data: every failure a caller can see is a JSON-RPC error object with a
documented code and a ``data`` dict (``retry_after``, ``upstream_status``, ...). A refusal the
caller can fix says how in its message (docs/operations.md, "Error codes", lists each fix).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from datetime import UTC, datetime
from enum import IntEnum
from typing import Any


class Code(IntEnum):
    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    # Gateway errors, -32000..-32099.
    UPSTREAM_ERROR = -32000
    TIMEOUT = -32001
    OVERLOADED = -32002
    RATE_LIMITED = -32003
    CANCELLED = -32004
    UNAUTHORIZED = -32005
    TOO_LARGE = -32006
    UPSTREAM_UNAVAILABLE = -32007
    SHUTTING_DOWN = -32008
    NOT_FOUND = -32009
    TOOL_QUARANTINED = -32010  # an MCP tool whose definition changed since an admin approved it


class RpcError(Exception):
    """A JSON-RPC error object raised or returned anywhere in the gateway."""

    def __init__(self, code: int, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = int(code)
        self.message = message
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err

    @classmethod
    def from_dict(cls, obj: Any) -> RpcError:
        if isinstance(obj, dict) and isinstance(obj.get("code"), int):
            data = obj.get("data")
            return cls(
                obj["code"],
                str(obj.get("message", "")),
                data if isinstance(data, dict) else ({"value": data} if data is not None else None),
            )
        return cls(Code.UPSTREAM_ERROR, "upstream sent a malformed error", {"error": repr(obj)[:200]})

    def __repr__(self) -> str:
        return f"RpcError({self.code}, {self.message!r}, {self.data!r})"


def parse_error(detail: str) -> RpcError:
    return RpcError(Code.PARSE_ERROR, "Parse error", {"detail": detail})


def invalid_request(detail: str) -> RpcError:
    return RpcError(Code.INVALID_REQUEST, "Invalid Request", {"detail": detail})


def method_not_found(method: str, did_you_mean: str | None = None) -> RpcError:
    """-32601; ``did_you_mean``: the served name closest to ``method`` (``closest``), if any."""
    data: dict[str, Any] = {"method": method}
    if did_you_mean is not None:
        data["did_you_mean"] = did_you_mean
    return RpcError(Code.METHOD_NOT_FOUND, f"Method not found: {not_served('method', method, did_you_mean)}",
                    data)


def closest(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` a typo of ``name`` most likely meant (difflib's ratio of 0.6 or more)."""
    found = difflib.get_close_matches(name, list(names), n=1)
    return found[0] if found else None


def not_served(what: str, name: str, did_you_mean: str | None) -> str:
    """``model 'mock-gtp' is not served here; did you mean 'mock-gpt'?``"""
    said = f"{what} {name[:200]!r} is not served here"
    return f"{said}; did you mean {did_you_mean!r}?" if did_you_mean is not None else said


def unauthorized(detail: str, expired_at: float | None = None) -> RpcError:
    """-32005 for a bearer no live key matches (a revoked key matches none): ``detail`` for
    programs, one of ``UNAUTHORIZED_MESSAGES``' keys; the message one sentence with the fix."""
    message = UNAUTHORIZED_MESSAGES.get(detail, f"Invalid API key: {detail}")
    if expired_at is not None:
        when = datetime.fromtimestamp(expired_at, UTC).isoformat().replace("+00:00", "Z")
        message = message.replace("this key expired", f"this key expired at {when}")
    return RpcError(Code.UNAUTHORIZED, message, {"detail": detail})


SEND_KEY = "send Authorization: Bearer <key>"
UNAUTHORIZED_MESSAGES = {
    "missing bearer key": f"Invalid API key: no key was sent; {SEND_KEY}",
    "malformed Authorization header": f"Invalid API key: the Authorization header is not 'Bearer <key>'; "
                                      f"{SEND_KEY}",
    "unknown key": f"Invalid API key: no key matches this bearer; {SEND_KEY}",
    "key expired": "Invalid API key: this key expired; ask an admin for a new key, then "
                   f"{SEND_KEY}",
    "the key store is unreachable": "Unauthorized: the key store is unreachable, so no key can be "
                                    "checked; retry in a few seconds",
}


def body_too_large(limit: int, content_length: bytes | str | None,
                   setting: str = "server.max_body_bytes") -> RpcError:
    """-32006 naming the limit and the setting that raises it, and the body's size where its
    ``content-length`` declared it (a chunked one is cut off at the limit, its size unknown)."""
    size = int(content_length) if content_length is not None and content_length.isdigit() else None
    data: dict[str, Any] = {"max_body_bytes": limit}
    if size is not None and size > limit:
        data["body_bytes"] = size
        said = f"the body is {size:,} bytes; the limit is {limit:,}"
    else:
        said = f"the body is over the limit of {limit:,} bytes"
    return RpcError(Code.TOO_LARGE, f"Request body too large: {said} ({setting})", data)


def invalid_params(detail: str, **extra: Any) -> RpcError:
    return RpcError(Code.INVALID_PARAMS, "Invalid params", {"detail": detail, **extra})


def internal_error(detail: str = "internal error") -> RpcError:
    return RpcError(Code.INTERNAL_ERROR, "Internal error", {"detail": detail})


def timeout_error(stage: str, **extra: Any) -> RpcError:
    """``stage``: where the deadline found the call (queued, running, upstream, or rate_limit:
    it never reached the upstream, waiting for the ``limit`` of ``provider`` named in ``extra``)."""
    return RpcError(Code.TIMEOUT, "Deadline exceeded", {"stage": stage, **extra})


def overloaded(provider: str, retry_after: float) -> RpcError:
    return RpcError(
        Code.OVERLOADED,
        "Overloaded: queue full",
        {"provider": provider, "retry_after": round(max(retry_after, 0.001), 3)},
    )


def rate_limited(limit: str, retry_after: float, **extra: Any) -> RpcError:
    return RpcError(
        Code.RATE_LIMITED,
        "Rate limited",
        {"limit": limit, "retry_after": round(max(retry_after, 0.001), 3), **extra},
    )


def cancelled(detail: str = "cancelled") -> RpcError:
    return RpcError(Code.CANCELLED, "Cancelled", {"detail": detail})


def upstream_error(provider: str, detail: str, status: int | None = None, **extra: Any) -> RpcError:
    data: dict[str, Any] = {"provider": provider, "detail": detail, **extra}
    if status is not None:
        data["upstream_status"] = status
    return RpcError(Code.UPSTREAM_ERROR, "Upstream error", data)


def upstream_unavailable(provider: str, detail: str) -> RpcError:
    return RpcError(
        Code.UPSTREAM_UNAVAILABLE, "Upstream unavailable", {"provider": provider, "detail": detail}
    )


def shutting_down() -> RpcError:
    return RpcError(Code.SHUTTING_DOWN, "Shutting down", {"retry_after": 1.0})
