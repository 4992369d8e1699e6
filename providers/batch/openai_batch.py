"""OpenAI Batch API: a JSONL file of requests, a batch over it, output and error files back.

Output order is not input order, so every line is matched by ``custom_id``. The
part id rides in the batch's ``metadata`` (or, for a vendor that keeps none, in
the uploaded file's name) so a submission cut short by a crash can be found
again instead of being made twice.

The same backend serves the vendors whose batch APIs are OpenAI's with small
differences (``batch_api: {...}`` settings, or a thin kind): Azure OpenAI (its
own paths and ``api-version``, capitalised statuses), Groq (cursor listing, up to
7-day windows), Together (``batch-api`` files, the create reply wrapped in
``job``, upper-case statuses). Statuses are compared in lower case everywhere.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any
from urllib.parse import parse_qsl

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
    status_word,
)

log = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings", "responses": "/v1/responses",
             "completions": "/v1/completions"}
TERMINAL: dict[str, Terminal] = {"completed": "completed", "failed": "failed", "expired": "expired",
                                 "cancelled": "cancelled", "canceled": "cancelled"}
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


def unwrap(body: dict[str, Any]) -> dict[str, Any]:
    """Together wraps the created batch in ``{"job": {...}}``; everyone else sends it bare."""
    job = body.get("job")
    return job if isinstance(job, dict) and "id" in job and "id" not in body else body


def page_rows(page: Any) -> list[dict[str, Any]]:
    """The batches of one listing page: OpenAI's and Groq's ``data``, or a bare array."""
    rows = page.get("data") if isinstance(page, dict) else page
    return [unwrap(b) for b in rows if isinstance(b, dict)] if isinstance(rows, list) else []


class OpenAIBatchBackend:
    """``paths`` maps ``files`` and ``batches`` to the vendor's (Azure: under ``/openai``);
    ``query`` is appended to every path (Azure's ``?api-version=``); ``create_endpoints`` is
    the ``endpoint`` a create names per operation when it differs from the lines' ``url``."""

    operations = frozenset(ENDPOINTS)

    def __init__(self, api: ApiClient, settings: BatchApiSettings, *, query: str = "",
                 create_endpoints: dict[str, str] | None = None,
                 operations: frozenset[str] | None = None, max_requests: int = 50_000,
                 max_bytes: int = 200 * 1024 * 1024) -> None:
        self.api = api
        self.name = api.name
        opts = settings.batch_options
        self.window = opts.completion_window or settings.batch_completion_window
        self.max_requests, self.max_bytes = settings.batch_limits(max_requests, max_bytes)
        self.purpose = opts.file_purpose
        self.metadata = opts.metadata
        self.max_enqueued_tokens = opts.max_enqueued_tokens
        self.max_active_batches = opts.max_active_batches
        self.query = query
        self.create_endpoints = create_endpoints or ENDPOINTS
        if operations is not None:
            self.operations = operations
        self._uploaded: dict[str, str] = {}  # part id -> its file, while its create is retried

    def _path(self, path: str) -> str:
        return path + self.query

    def split_key(self, operation: str, params: dict[str, Any]) -> Hashable:
        return (ENDPOINTS.get(operation, operation), params.get("model"))

    async def submit(self, part_id: str, items: Sequence[JobItem]) -> str:
        file_id = self._uploaded.get(part_id)
        if file_id is None:
            content = b"".join(jsonl_line(i) for i in items)
            uploaded = await self.api.json(
                "POST", self._path("/files"), idempotent=True, deadline=None,
                data={"purpose": self.purpose},
                files={"file": (f"{part_id}.jsonl", content, "application/jsonl")})
            del content
            file_id = unwrap(uploaded).get("id")
            if not isinstance(file_id, str):
                raise upstream_error(self.name, "file upload returned no id")
            self._uploaded[part_id] = file_id
        body: dict[str, Any] = {"input_file_id": file_id,
                                "endpoint": self.create_endpoints[items[0].operation],
                                "completion_window": self.window}
        if self.metadata:
            body["metadata"] = {META_KEY: part_id}
        created = unwrap(await self.api.json("POST", self._path("/batches"), idempotent=False,
                                             deadline=None, json=body))
        if not isinstance(created.get("id"), str):
            raise upstream_error(self.name, "batch creation returned no id")
        self._uploaded.pop(part_id, None)
        return created["id"]

    async def _get(self, path: str, params: dict[str, Any]) -> Any:
        """A listing page, which may be a bare JSON array (``api.json`` takes objects only)."""
        try:
            # httpx replaces a URL's query with ``params``: the api-version goes in with them
            query = dict(parse_qsl(self.query.lstrip("?")))
            response = await self.api.request("GET", path, idempotent=True, deadline=None,
                                              params={**query, **params})
        except RpcError as e:
            if (e.data or {}).get("upstream_status") in (404, 405, 501):
                raise SubmissionUnknown(f"the upstream cannot list {path.strip('/')}") from None
            raise
        try:
            return json.loads(response.content)
        except ValueError:
            raise upstream_error(self.name, f"malformed {path.strip('/')} listing") from None

    async def _files_named(self, filename: str) -> set[str]:
        """Ids of uploaded files with this name: how a batch without metadata is recognised."""
        page = await self._get("/files", {"purpose": self.purpose})
        rows = page_rows(page)
        return {str(f["id"]) for f in rows if f.get("filename") == filename and "id" in f}

    async def find(self, part_id: str, since_wall: float, size: int, claimed: set[str]) -> str | None:
        files = set() if self.metadata else await self._files_named(f"{part_id}.jsonl")
        if not self.metadata and not files:
            return None  # nothing was uploaded, so nothing was created
        params: dict[str, Any] = {"limit": 100}
        while True:
            page = await self._get("/batches", params)
            data = page_rows(page)
            for batch in data:
                if self.metadata and "metadata" not in batch:
                    raise SubmissionUnknown("the vendor's batches carry no metadata (set "
                                            "batch_api.metadata: false)")
                meta = batch.get("metadata") or {}
                mine = (meta.get(META_KEY) == part_id if self.metadata
                        else batch.get("input_file_id") in files)
                if mine and batch.get("id") not in claimed:
                    return str(batch["id"])
            created = [float(b["created_at"]) for b in data if isinstance(b.get("created_at"), int | float)]
            too_old = bool(created) and min(created) < since_wall - LIST_WINDOW_S
            paging = page.get("paging") if isinstance(page, dict) else None
            cursor = paging.get("next_cursor") if isinstance(paging, dict) else None
            if not data or too_old:
                return None
            if isinstance(cursor, str) and cursor:  # Groq: cursor paging
                params = {"limit": 100, "cursor": cursor}
            elif isinstance(page, dict) and page.get("has_more"):
                params = {"limit": 100, "after": data[-1].get("id")}
            else:
                return None

    async def poll(self, remote_id: str) -> RemoteStatus:
        body = unwrap(await self.api.json("GET", self._path(f"/batches/{remote_id}"),
                                          idempotent=True, deadline=None))
        status = str(body.get("status"))
        detail = None
        errors = body.get("errors")
        if isinstance(errors, dict) and isinstance(errors.get("data"), list):
            errors = errors["data"]
        if isinstance(errors, list):  # OpenAI's {data: [...]}, Groq's bare list
            messages = [str(e.get("message")) for e in errors if isinstance(e, dict)]
            detail = "; ".join(messages[:5]) or None
        elif isinstance(body.get("error"), str | dict):  # Together: one error
            detail = str(body["error"].get("message") if isinstance(body["error"], dict)
                         else body["error"]) or None
        raw_counts = body.get("request_counts")
        counts = {k: v for k, v in raw_counts.items() if isinstance(v, int)} \
            if isinstance(raw_counts, dict) else {}
        return RemoteStatus(remote_id, status, TERMINAL.get(status_word(status)), counts, detail, body)

    async def results(self, status: RemoteStatus) -> AsyncIterator[LineResult]:
        for key in ("output_file_id", "error_file_id"):
            file_id = status.raw.get(key)
            if not isinstance(file_id, str) or not file_id:
                continue
            response = await self.api.request("GET", self._path(f"/files/{file_id}/content"),
                                              idempotent=True, deadline=None, stream=True)
            async for line in read_result_lines(self.name, response, parse_line, file_id):
                yield line

    async def cancel(self, remote_id: str) -> None:
        await self.api.json("POST", self._path(f"/batches/{remote_id}/cancel"), idempotent=True,
                            deadline=None)
