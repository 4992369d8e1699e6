"""What an asynchronous batch API looks like to the job manager, whatever the vendor.

A backend submits one *part* (a set of request lines under the vendor's size
limits), reports its status, streams back per-request results matched by
``custom_id``, and cancels. The job manager owns everything durable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from multiplexer.core.errors import RpcError, upstream_unavailable

log = logging.getLogger(__name__)

Terminal = Literal["completed", "failed", "expired", "cancelled"]
LineKind = Literal["succeeded", "errored", "unfinished", "cancelled"]


class BatchApiOptions(BaseModel):
    """How a vendor's OpenAI-shaped batch API differs from OpenAI's (``batch_api: {...}``): the
    settings that let Groq, Together and the like ride the same backend without a kind each."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True, description="false: jobs run through the synchronous endpoint (vLLM, "
        "Ollama, ...); `batch_api: false` says the same")
    completion_window: str | None = Field(
        default=None, description="the batch's completion_window (Groq takes 24h to 7d; Azure and "
        "Together only 24h); default batch_completion_window")
    max_lines: int | None = Field(
        default=None, ge=1, description="requests per uploaded file (Groq, Together 50,000); "
        "default batch_max_requests")
    max_file_bytes: int | None = Field(
        default=None, ge=1024, description="bytes per uploaded file (Groq 200 MB, Together 100 MB); "
        "default batch_max_bytes")
    file_purpose: str = Field(
        default="batch", description="the upload's purpose (Together: batch-api)")
    metadata: bool = Field(
        default=True, description="the vendor keeps a batch's metadata: a submission cut short by a "
        "crash is found by it; false: found by its uploaded file's name, and no metadata is sent")
    max_enqueued_tokens: int | None = Field(
        default=None, ge=1, description="estimated prompt tokens per model in batches not yet "
        "ended (the vendor's enqueued-token quota): a part waits to be submitted until it fits")
    max_active_batches: int | None = Field(
        default=None, ge=1, description="batches of this provider not yet ended: a part waits "
        "to be submitted until one ends")


class BatchApiSettings(BaseModel):
    """Batch-job keys shared by remote provider kinds (flat keys in the provider's config)."""

    model_config = ConfigDict(extra="forbid")

    batch_api: BatchApiOptions = Field(
        default_factory=BatchApiOptions, description="the vendor's batch API: true (the default), "
        "false (jobs run through the synchronous endpoint: vLLM, Ollama, ...), or its settings")
    batch_poll_interval_s: float = Field(default=10.0, gt=0)
    batch_max_requests: int = Field(default=50_000, ge=1)
    batch_max_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)
    batch_resubmit_expired: bool = True
    batch_completion_window: str = "24h"

    @field_validator("batch_api", mode="before")
    @classmethod
    def _plain_bool(cls, value: Any) -> Any:
        """``batch_api: true|false`` (the key's first form) is the object with ``enabled``."""
        if isinstance(value, bool):
            return {"enabled": value}
        if not isinstance(value, dict | BatchApiOptions):
            raise ValueError("batch_api is true, false or an object of the vendor's batch settings")
        return value

    @property
    def batch_options(self) -> BatchApiOptions:
        return self.batch_api

    @property
    def batch_on(self) -> bool:
        return self.batch_api.enabled

    def batch_limits(self, max_requests: int, max_bytes: int) -> tuple[int, int]:
        """Lines and bytes per file: the ``batch_api`` object's, else the flat keys under the
        kind's caps (``max_requests``, ``max_bytes``)."""
        opts = self.batch_options
        lines = opts.max_lines or min(self.batch_max_requests, max_requests)
        size = opts.max_file_bytes or min(self.batch_max_bytes, max_bytes)
        return lines, size


@dataclass(slots=True)
class JobItem:
    """One request line: its custom id and the provider's own request body, as stored JSON text
    (spliced into the upload as is: 50,000 bodies are never decoded and encoded again)."""

    custom_id: str
    operation: str
    body: str


@dataclass(frozen=True, slots=True)
class RemoteStatus:
    remote_id: str
    status: str  # the vendor's own word
    terminal: Terminal | None  # None while it runs
    counts: dict[str, int] = field(default_factory=dict)
    detail: str | None = None  # why a failed batch failed
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class LineResult:
    custom_id: str
    kind: LineKind
    result: Any = None
    error: RpcError | None = None


class SubmissionUnknown(Exception):
    """The vendor cannot tell whether a half-finished submission created a batch."""


class BatchBackend(Protocol):
    """Optional attributes, read through ``operations_of`` and ``quotas_of``:
    ``operations`` (a frozenset: what its batches carry; other operations run as sync calls;
    absent: all), ``max_enqueued_tokens`` (per split key, i.e. model, across its batches not
    yet ended) and ``max_active_batches`` (absent or None: no such quota)."""

    max_requests: int
    max_bytes: int

    def split_key(self, operation: str, params: dict[str, Any]) -> Hashable:
        """Items with different keys never share a part (OpenAI: one model per file)."""
        ...

    async def submit(self, part_id: str, items: Sequence[JobItem]) -> str:
        """Create the remote batch; returns its id."""
        ...

    async def find(self, part_id: str, since_wall: float, size: int,
                   claimed: set[str]) -> str | None:
        """The batch a crashed submission created, None if it created none, or SubmissionUnknown."""
        ...

    async def poll(self, remote_id: str) -> RemoteStatus: ...

    def results(self, status: RemoteStatus) -> AsyncIterator[LineResult]: ...

    async def cancel(self, remote_id: str) -> None: ...


def operations_of(backend: BatchBackend) -> frozenset[str] | None:
    """The operations a backend's batches carry; None: every one."""
    return getattr(backend, "operations", None)


def quotas_of(backend: BatchBackend) -> tuple[int | None, int | None]:
    """(max_active_batches, max_enqueued_tokens) of a backend; None where it has no such quota."""
    return getattr(backend, "max_active_batches", None), getattr(backend, "max_enqueued_tokens", None)


@dataclass(slots=True)
class Planned:
    index: int
    key: Hashable
    size: int
    tokens: int = 0


def plan_parts(items: Sequence[Planned], max_requests: int, max_bytes: int,
               max_tokens: int | None = None) -> list[list[int]]:
    """Split into parts: one key per part, at most ``max_requests`` lines, ``max_bytes`` and
    ``max_tokens`` (the vendor's enqueued-token quota: a bigger part could never be submitted)."""
    by_key: dict[Hashable, list[Planned]] = {}
    for p in items:
        by_key.setdefault(p.key, []).append(p)
    parts: list[list[int]] = []
    for group in by_key.values():
        cur: list[int] = []
        size = tokens = 0
        for p in group:
            if cur and (len(cur) >= max_requests or size + p.size > max_bytes or (
                    max_tokens is not None and tokens + p.tokens > max_tokens)):
                parts.append(cur)
                cur, size, tokens = [], 0, 0
            cur.append(p.index)
            size += p.size
            tokens += p.tokens
        if cur:
            parts.append(cur)
    return parts


def status_word(status: Any) -> str:
    """A vendor's status in lower case: Azure's samples spell ``Completed``, Together and Mistral
    ``COMPLETED``; every comparison goes through here."""
    return str(status).strip().lower()


def result_row(text: str) -> tuple[str, dict[str, Any]] | None:
    """A results line as (custom_id, row); None when it is not JSON or has no custom_id."""
    try:
        row = json.loads(text)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("custom_id"), str):
        return None
    return row["custom_id"], row


async def read_result_lines(
    provider: str, response: httpx.Response, parse: Callable[[str, str], LineResult | None],
    where: str,
) -> AsyncIterator[LineResult]:
    """Stream a JSONL results body line by line (results can be hundreds of MB), skipping
    blank and malformed lines; a broken stream is -32007 for the caller to retry later."""
    try:
        async for text in response.aiter_lines():
            if not text.strip():
                continue
            line = parse(provider, text)
            if line is None:
                log.warning("%s: skipped a malformed result line in %s", provider, where)
                continue
            yield line
    except httpx.HTTPError as e:
        raise upstream_unavailable(provider, f"reading {where}: {type(e).__name__}") from None
    finally:
        await response.aclose()
