"""Mistral batch jobs: a JSONL file of ``{custom_id, body}`` lines, a job over it, files back.

Mistral's job API is its own (``/v1/batch/jobs``, one model and endpoint per job,
``QUEUED`` .. ``SUCCESS`` statuses, ``output_file`` / ``error_file``), but its result
lines are OpenAI's (``{custom_id, response: {status_code, body}}``), so they are
read by the OpenAI parser. The part id rides in the job's ``metadata``, so a
submission cut short by a crash is found again by listing jobs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

from multiplexer.core.errors import RpcError, upstream_error

from ..api_client import ApiClient
from ..http_util import parse_rfc3339
from .backend import (
    BatchApiSettings,
    JobItem,
    LineResult,
    RemoteStatus,
    SubmissionUnknown,
    Terminal,
    read_result_lines,
    status_word,
)
from .openai_batch import LIST_WINDOW_S, META_KEY, parse_line

log = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}
TERMINAL: dict[str, Terminal] = {"success": "completed", "failed": "failed",
                                 "timeout_exceeded": "expired", "cancelled": "cancelled"}
JOBS = "/v1/batch/jobs"
PAGE = 100


def jsonl_line(item: JobItem) -> bytes:
    return b'{"custom_id":' + json.dumps(item.custom_id).encode() + b',"body":' + \
        item.body.encode() + b"}\n"


def _created(job: dict[str, Any]) -> float | None:
    value = job.get("created_at")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return parse_rfc3339(value, lambda: 0.0)
    return None


class MistralBatchBackend:
    operations = frozenset(ENDPOINTS)

    def __init__(self, api: ApiClient, settings: BatchApiSettings, timeout_hours: int) -> None:
        self.api = api
        self.name = api.name
        opts = settings.batch_options
        self.max_requests, self.max_bytes = settings.batch_limits(100_000, 512 * 1024 * 1024)
        self.purpose = opts.file_purpose
        self.max_enqueued_tokens = opts.max_enqueued_tokens
        self.max_active_batches = opts.max_active_batches
        self.timeout_hours = timeout_hours
        self._uploaded: dict[str, str] = {}

    def split_key(self, operation: str, params: dict[str, Any]) -> Hashable:
        return (ENDPOINTS.get(operation, operation), params.get("model"))  # one model per job

    async def submit(self, part_id: str, items: Sequence[JobItem]) -> str:
        file_id = self._uploaded.get(part_id)
        if file_id is None:
            content = b"".join(jsonl_line(i) for i in items)
            uploaded = await self.api.json(
                "POST", "/v1/files", idempotent=True, deadline=None, data={"purpose": self.purpose},
                files={"file": (f"{part_id}.jsonl", content, "application/jsonl")})
            del content
            file_id = uploaded.get("id")
            if not isinstance(file_id, str):
                raise upstream_error(self.name, "file upload returned no id")
            self._uploaded[part_id] = file_id
        model = json.loads(items[0].body).get("model")
        body = {"input_files": [file_id], "endpoint": ENDPOINTS[items[0].operation],
                "model": model, "metadata": {META_KEY: part_id},
                "timeout_hours": self.timeout_hours}
        created = await self.api.json("POST", JOBS, idempotent=False, deadline=None, json=body)
        if not isinstance(created.get("id"), str):
            raise upstream_error(self.name, "batch job creation returned no id")
        self._uploaded.pop(part_id, None)
        return created["id"]

    async def find(self, part_id: str, since_wall: float, size: int, claimed: set[str]) -> str | None:
        page_no = 0
        while True:
            try:
                page = await self.api.json("GET", JOBS, idempotent=True, deadline=None,
                                           params={"page": page_no, "page_size": PAGE})
            except RpcError as e:
                if (e.data or {}).get("upstream_status") in (404, 405, 501):
                    raise SubmissionUnknown("the upstream cannot list batch jobs") from None
                raise
            data = [j for j in page.get("data") or [] if isinstance(j, dict)]
            for job in data:
                if "metadata" not in job:  # a job this cannot recognise: never guess
                    raise SubmissionUnknown("the listed batch jobs carry no metadata")
                meta = job.get("metadata") or {}
                if isinstance(meta, dict) and meta.get(META_KEY) == part_id \
                        and job.get("id") not in claimed:
                    return str(job["id"])
            created = [c for c in map(_created, data) if c is not None]
            too_old = bool(created) and min(created) < since_wall - LIST_WINDOW_S
            total = page.get("total")
            seen = (page_no + 1) * PAGE
            if len(data) < PAGE or too_old or (isinstance(total, int) and seen >= total):
                return None
            page_no += 1

    async def poll(self, remote_id: str) -> RemoteStatus:
        body = await self.api.json("GET", f"{JOBS}/{remote_id}", idempotent=True, deadline=None)
        status = str(body.get("status"))
        errors = body.get("errors")
        messages = [str(e.get("message")) for e in errors if isinstance(e, dict)] \
            if isinstance(errors, list) else []
        counts = {k: body[k] for k in ("total_requests", "completed_requests", "succeeded_requests",
                                       "failed_requests") if isinstance(body.get(k), int)}
        return RemoteStatus(remote_id, status, TERMINAL.get(status_word(status)), counts,
                            "; ".join(messages[:5]) or None, body)

    async def results(self, status: RemoteStatus) -> AsyncIterator[LineResult]:
        for key in ("output_file", "error_file"):
            file_id = status.raw.get(key)
            if not isinstance(file_id, str) or not file_id:
                continue
            response = await self.api.request("GET", f"/v1/files/{file_id}/content", idempotent=True,
                                              deadline=None, stream=True)
            async for line in read_result_lines(self.name, response, parse_line, file_id):
                yield line

    async def cancel(self, remote_id: str) -> None:
        await self.api.json("POST", f"{JOBS}/{remote_id}/cancel", idempotent=True, deadline=None)
