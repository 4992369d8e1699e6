"""Anthropic Message Batches: inline ``requests[]``, ``processing_status``, results as JSONL.

A batch carries no metadata, so a submission cut short by a crash is found
again by what the vendor lists: created after the recorded intent, with as
many requests as the part, not claimed by another part. Anything ambiguous is
reported as unknown (and not submitted twice).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

from multiplexer.core.errors import RpcError, upstream_error

from ..api_client import ApiClient, item_error
from ..http_util import parse_rfc3339
from .backend import (
    BatchApiSettings,
    JobItem,
    LineResult,
    RemoteStatus,
    SubmissionUnknown,
    read_result_lines,
    result_row,
    status_word,
)

log = logging.getLogger(__name__)

PATH = "/v1/messages/batches"
CLOCK_SKEW_S = 120.0


def parse_line(provider: str, text: str) -> LineResult | None:
    parsed = result_row(text)
    if parsed is None:
        return None
    cid, row = parsed
    result = row.get("result")
    kind = result.get("type") if isinstance(result, dict) else None
    if kind == "succeeded" and isinstance(result.get("message"), dict):  # type: ignore[union-attr]
        return LineResult(cid, "succeeded", result=result["message"])  # type: ignore[index]
    if kind == "errored":
        return LineResult(cid, "errored", error=item_error(provider, result.get("error"), None))  # type: ignore[union-attr]
    if kind == "canceled":
        return LineResult(cid, "cancelled")
    if kind == "expired":
        return LineResult(cid, "unfinished")
    return LineResult(cid, "errored", error=upstream_error(provider, "malformed batch result line"))


def _created(batch: dict[str, Any]) -> float | None:
    value = batch.get("created_at")
    if not isinstance(value, str):
        return None
    # parse_rfc3339 gives "seconds until"; with now=0 that is the timestamp itself
    return parse_rfc3339(value, lambda: 0.0)


class AnthropicBatchBackend:
    operations = frozenset({"messages", "count_tokens"})  # one batch may mix them (no split key)

    def __init__(self, api: ApiClient, settings: BatchApiSettings) -> None:
        self.api = api
        self.name = api.name
        self.max_requests, self.max_bytes = settings.batch_limits(100_000, 256 * 1024 * 1024)
        opts = settings.batch_options
        self.max_enqueued_tokens = opts.max_enqueued_tokens
        self.max_active_batches = opts.max_active_batches

    def split_key(self, operation: str, params: dict[str, Any]) -> Hashable:
        return None  # one batch may mix models

    async def submit(self, part_id: str, items: Sequence[JobItem]) -> str:
        content = b'{"requests":[' + b",".join(
            b'{"custom_id":' + json.dumps(i.custom_id).encode() + b',"params":' + i.body.encode() + b"}"
            for i in items) + b"]}"
        created = await self.api.json("POST", PATH, idempotent=False, deadline=None, content=content,
                                      headers={"content-type": "application/json"})
        if not isinstance(created.get("id"), str):
            raise upstream_error(self.name, "message batch creation returned no id")
        return created["id"]

    async def find(self, part_id: str, since_wall: float, size: int, claimed: set[str]) -> str | None:
        after: str | None = None
        matches: list[str] = []
        while True:
            params: dict[str, Any] = {"limit": 100}
            if after:
                params["after_id"] = after
            try:
                page = await self.api.json("GET", PATH, idempotent=True, deadline=None, params=params)
            except RpcError as e:
                if (e.data or {}).get("upstream_status") in (404, 405, 501):
                    raise SubmissionUnknown("the upstream cannot list message batches") from None
                raise
            data = [b for b in page.get("data") or [] if isinstance(b, dict)]
            too_old = False
            for batch in data:
                created = _created(batch)
                if created is not None and created < since_wall - CLOCK_SKEW_S:
                    too_old = True
                    continue
                counts = batch.get("request_counts") or {}
                total = sum(v for v in counts.values() if isinstance(v, int))
                if total == size and batch.get("id") not in claimed:
                    matches.append(str(batch["id"]))
            if not page.get("has_more") or not data or too_old:
                break
            after = page.get("last_id") or data[-1].get("id")
        if len(matches) > 1:
            raise SubmissionUnknown(f"{len(matches)} batches could be this submission")
        return matches[0] if matches else None

    async def poll(self, remote_id: str) -> RemoteStatus:
        body = await self.api.json("GET", f"{PATH}/{remote_id}", idempotent=True, deadline=None)
        status = str(body.get("processing_status"))
        counts = body.get("request_counts") if isinstance(body.get("request_counts"), dict) else {}
        terminal = None
        if status_word(status) == "ended":
            if body.get("cancel_initiated_at"):
                terminal = "cancelled"
            elif counts.get("expired"):
                terminal = "expired"
            else:
                terminal = "completed"
        return RemoteStatus(remote_id, status, terminal, counts, None, body)  # type: ignore[arg-type]

    async def results(self, status: RemoteStatus) -> AsyncIterator[LineResult]:
        url = status.raw.get("results_url") or f"{PATH}/{status.remote_id}/results"
        response = await self.api.request("GET", str(url), idempotent=True, deadline=None, stream=True)
        async for line in read_result_lines(self.name, response, parse_line, status.remote_id):
            yield line

    async def cancel(self, remote_id: str) -> None:
        await self.api.json("POST", f"{PATH}/{remote_id}/cancel", idempotent=True, deadline=None)
