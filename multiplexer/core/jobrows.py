"""The rows of the job store as plain values, and their JSON encoding."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .jsonrpc import is_unicode


def dumps(value: Any) -> str:
    """Compact JSON for a TEXT column; lone surrogates (valid JSON escapes) stay escaped, as SQLite
    takes only UTF-8."""
    out = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    return out if is_unicode(out) else json.dumps(value, separators=(",", ":"), default=str)


def custom_id(job_id: str, idx: int) -> str:
    """The id an item carries in a remote batch (and in the store): its job's id and position."""
    return f"{job_id}-{idx}"


@dataclass(frozen=True, slots=True)
class JobRow:
    id: str
    identity: str | None
    source: str
    state: str
    total: int
    created: float
    updated: float


@dataclass(frozen=True, slots=True)
class PartRow:
    id: str
    job_id: str
    provider: str
    attempt: int
    state: str
    remote_id: str | None
    remote_status: str | None
    detail: str | None
    intent_wall: float | None


@dataclass(frozen=True, slots=True)
class ItemRow:
    idx: int
    custom_id: str
    route: str | None
    operation: str | None
    method: str | None
    params: str | None
    options: str | None
    tokens: int
    state: str


@dataclass(frozen=True, slots=True)
class NewItem:
    idx: int
    provider: str | None
    route: str | None
    operation: str | None
    method: str | None
    params: Any
    options: dict[str, Any]
    tokens: int
    custom_id: str
    state: str = "queued"
    error: dict[str, Any] | None = None
    split: str | None = None  # items with different split keys never share a part


def loads_many(texts: Sequence[str | None]) -> list[Any]:
    """Decode many stored JSON texts in one pass: the decoder then shares one copy of each
    object key among them all, which matters when 50,000 results wait in memory."""
    present = [t for t in texts if t]
    if not present:
        return [None] * len(texts)
    decoded = iter(json.loads("[" + ",".join(present) + "]"))
    return [next(decoded) if t else None for t in texts]
