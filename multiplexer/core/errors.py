"""Error codes and the one exception type that carries them to clients.

Errors are data: every failure a caller can see is a JSON-RPC error object with a
documented code and a ``data`` dict (``retry_after``, ``upstream_status``, ...).
"""

from __future__ import annotations

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


def method_not_found(method: str) -> RpcError:
    return RpcError(Code.METHOD_NOT_FOUND, "Method not found", {"method": method})


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
