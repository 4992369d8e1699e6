"""OpenAI Batch API: a JSONL file of requests, a batch over it, output and error files back.

Output order is not input order, so every line is matched by ``custom_id``. The
part id rides in the batch's ``metadata`` so a submission cut short by a crash
can be found again instead of being made twice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

from multiplexer.core.errors import RpcError, upstream_error

from ..api_client import ApiClient, item_error
from .backend import (
    BatchApiSettings,
    JobItem,
    LineResult,
    RemoteStatus,
    SubmissionUnknown,
    Terminal,
    read_result_lines,
    result_row,
)

log = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings", "responses": "/v1/responses",
             "completions": "/v1/completions"}
TERMINAL: dict[str, Terminal] = {"completed": "completed", "failed": "failed", "expired": "expired",
                                 "cancelled": "cancelled"}
META_KEY = "multiplexer_part"
LIST_WINDOW_S = 300.0  # how far before the recorded intent a batch may claim to be created


def jsonl_line(item: JobItem) -> bytes:
    head = {"custom_id": item.custom_id, "method": "POST", "url": ENDPOINTS[item.operation]}
    return (json.dumps(head, separators=(",", ":"))[:-1] + ',"body":').encode() + \
        item.body.encode() + b"}\n"


def parse_line(provider: str, text: str) -> LineResult | None:
    """One output/error file line; None when it is not a usable line."""
    parsed = result_row(text)
    if parsed is None:
        return None
    cid, row = parsed
    response, error = row.get("response"), row.get("error")
    if isinstance(response, dict):
        status = response.get("status_code")
        body = response.get("body")
        if isinstance(status, int) and 200 <= status < 300 and isinstance(body, dict):
            return LineResult(cid, "succeeded", result=body)
        if isinstance(status, int):
            return LineResult(cid, "errored", error=item_error(provider, body, status))
    if isinstance(error, dict):
        code = error.get("code")
        if code == "batch_expired":
            return LineResult(cid, "unfinished")
        if code == "batch_cancelled":
            return LineResult(cid, "cancelled")
        return LineResult(cid, "errored", error=item_error(provider, {"error": error}, None))
    return LineResult(cid, "errored",
                      error=upstream_error(provider, "malformed batch result line"))


class OpenAIBatchBackend:
    def __init__(self, api: ApiClient, settings: BatchApiSettings) -> None:
        self.api = api
        self.name = api.name
        self.window = settings.batch_completion_window
        self.max_requests = min(settings.batch_max_requests, 50_000)
        self.max_bytes = min(settings.batch_max_bytes, 200 * 1024 * 1024)

    def split_key(self, operation: str, params: dict[str, Any]) -> Hashable:
        return (ENDPOINTS.get(operation, operation), params.get("model"))

    async def submit(self, part_id: str, items: Sequence[JobItem]) -> str:
        content = b"".join(jsonl_line(i) for i in items)
        uploaded = await self.api.json(
            "POST", "/files", idempotent=True, deadline=None, data={"purpose": "batch"},
            files={"file": (f"{part_id}.jsonl", content, "application/jsonl")})
        del content
        file_id = uploaded.get("id")
        if not isinstance(file_id, str):
            raise upstream_error(self.name, "file upload returned no id")
        body = {"input_file_id": file_id, "endpoint": ENDPOINTS[items[0].operation],
                "completion_window": self.window, "metadata": {META_KEY: part_id}}
        created = await self.api.json("POST", "/batches", idempotent=False, deadline=None, json=body)
        if not isinstance(created.get("id"), str):
            raise upstream_error(self.name, "batch creation returned no id")
        return created["id"]

    async def find(self, part_id: str, since_wall: float, size: int, claimed: set[str]) -> str | None:
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 100}
            if after:
                params["after"] = after
            try:
                page = await self.api.json("GET", "/batches", idempotent=True, deadline=None,
                                           params=params)
            except RpcError as e:
                status = (e.data or {}).get("upstream_status")
                if status in (404, 405, 501):
                    raise SubmissionUnknown("the upstream cannot list batches") from None
                raise
            data = page.get("data") if isinstance(page.get("data"), list) else []
            for batch in data:
                meta = batch.get("metadata") or {}
                if meta.get(META_KEY) == part_id and batch.get("id") not in claimed:
                    return str(batch["id"])
            created = [b.get("created_at") for b in data if isinstance(b.get("created_at"), int | float)]
            too_old = bool(created) and min(created) < since_wall - LIST_WINDOW_S
            if not page.get("has_more") or not data or too_old:
                return None
            after = data[-1].get("id")

    async def poll(self, remote_id: str) -> RemoteStatus:
        body = await self.api.json("GET", f"/batches/{remote_id}", idempotent=True, deadline=None)
        status = str(body.get("status"))
        detail = None
        errors = body.get("errors")
        if isinstance(errors, dict) and isinstance(errors.get("data"), list):
            messages = [str(e.get("message")) for e in errors["data"] if isinstance(e, dict)]
            detail = "; ".join(messages[:5]) or None
        counts = body.get("request_counts") if isinstance(body.get("request_counts"), dict) else {}
        return RemoteStatus(remote_id, status, TERMINAL.get(status), counts, detail, body)

    async def results(self, status: RemoteStatus) -> AsyncIterator[LineResult]:
        for key in ("output_file_id", "error_file_id"):
            file_id = status.raw.get(key)
            if not isinstance(file_id, str):
                continue
            response = await self.api.request("GET", f"/files/{file_id}/content", idempotent=True,
                                              deadline=None, stream=True)
            async for line in read_result_lines(self.name, response, parse_line, file_id):
                yield line

    async def cancel(self, remote_id: str) -> None:
        await self.api.json("POST", f"/batches/{remote_id}/cancel", idempotent=True, deadline=None)
