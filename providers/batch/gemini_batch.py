"""Gemini's Batch API: ``models/{model}:batchGenerateContent``, a long-running operation polled
at ``batches/{id}``, results inline in the operation or in a responses file.

A small part goes inline (``inputConfig.requests``; results come back in input order, and the
key in their ``metadata`` is not always echoed, so they are matched by position); a larger one
goes up as a JSONL file through the resumable upload (``inputConfig.fileName``; each result line
carries its ``key``). The state is read in either spelling, ``BATCH_STATE_*`` (the wire) or
``JOB_STATE_*`` (the SDKs and the guide). The part id and its token estimate ride in the
batch's display name, so a submission cut short by a crash is found again by listing, and a
restarted gateway counts what is enqueued.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from typing import Any

from multiplexer.core.errors import RpcError, upstream_error

from ..api_client import ApiClient, item_error
from .backend import JobItem, LineResult, RemoteStatus, SubmissionUnknown, Terminal, read_result_lines
from .gemini_enqueued import Enqueued

log = logging.getLogger(__name__)

TERMINAL: dict[str, Terminal] = {"SUCCEEDED": "completed", "PARTIALLY_SUCCEEDED": "completed",
                                 "FAILED": "failed", "CANCELLED": "cancelled", "EXPIRED": "expired"}
PREFIX = "multiplexer"
MAX_LIST_PAGES = 20
FILE_LIMIT = 2 * 1024 ** 3

PartOrder = Callable[[str], Awaitable[list[str]]]
PartStopped = Callable[[str], Awaitable[bool]]


def state_word(raw: Any) -> str:
    """``BATCH_STATE_RUNNING``, ``JOB_STATE_RUNNING`` (or ``{"name": ...}``) as ``RUNNING``."""
    if isinstance(raw, dict):
        raw = raw.get("name")
    word = str(raw or "").upper()
    for prefix in ("BATCH_STATE_", "JOB_STATE_"):
        word = word.removeprefix(prefix)
    return word


def display_name(part_id: str, tokens: int) -> str:
    return f"{PREFIX}:{part_id}:{tokens}"


def parse_display(name: Any) -> tuple[str, int] | None:
    """(part id, token estimate) from a display name this gateway gave; None for any other."""
    if not isinstance(name, str) or not name.startswith(PREFIX + ":"):
        return None
    _, part_id, tokens = [*name.split(":"), "", ""][:3]
    return (part_id, int(tokens)) if tokens.isdigit() and part_id else None


def _metadata(op: dict[str, Any]) -> dict[str, Any]:
    meta = op.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _output(op: dict[str, Any]) -> dict[str, Any]:
    """Where the results are: the operation's ``response`` (the REST guide) or
    ``metadata.output`` (the SDK)."""
    for found in (op.get("response"), _metadata(op).get("output"), op.get("output"), op.get("dest")):
        if isinstance(found, dict) and (found.get("responsesFile") or found.get("inlinedResponses")
                                        or found.get("fileName")):
            return found
    return {}


def _inlined(output: dict[str, Any]) -> list[Any]:
    found = output.get("inlinedResponses")
    if isinstance(found, dict):
        found = found.get("inlinedResponses")
    return found if isinstance(found, list) else []


def line_result(provider: str, key: str, row: dict[str, Any]) -> LineResult:
    """One result (a file line or an inlined response): ``response`` or ``error``."""
    if isinstance(row.get("response"), dict):
        return LineResult(key, "succeeded", result=row["response"])
    error = row.get("error") if isinstance(row.get("error"), dict) else row.get("status")
    if isinstance(error, dict):
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else None
        return LineResult(key, "errored", error=item_error(provider, {"error": error}, status))
    return LineResult(key, "errored", error=upstream_error(provider, "malformed batch result"))


def parse_line(provider: str, text: str) -> LineResult | None:
    try:
        row = json.loads(text)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("key"), str):
        return None
    return line_result(provider, row["key"], row)


def _request(body: str) -> tuple[str, dict[str, Any]]:
    params = json.loads(body)
    model = str(params.get("model", ""))
    return model, {k: v for k, v in params.items() if k not in ("model", "stream")}


class GeminiBatchBackend:
    def __init__(self, api: ApiClient, settings: Any, version: str) -> None:
        self.api = api
        self.name = api.name
        self.version = version
        self.inline_max = settings.batch_inline_max_bytes
        self.max_requests = settings.batch_max_requests
        self.max_bytes = min(settings.batch_max_bytes, FILE_LIMIT)
        self.enqueued = Enqueued(dict(settings.batch_enqueued_tokens), settings.batch_max_jobs, api.ctx.clock,
                                 settings.batch_poll_interval_s)
        self.order: PartOrder | None = None  # the part's custom ids in input order (the job store)
        self.stopped: PartStopped | None = None  # whether the part's job was cancelled

    def split_key(self, operation: str, params: dict[str, Any]) -> Hashable:
        return (operation, str(params.get("model", "")).removeprefix("models/"))

    # -- submit ------------------------------------------------------------------------
    async def submit(self, part_id: str, items: Sequence[JobItem]) -> str:
        requests = [_request(i.body) for i in items]
        model = requests[0][0].removeprefix("models/")
        size = sum(len(i.body) for i in items)
        tokens = max(1, size // 4)
        stopped = self.stopped
        key = await self.enqueued.reserve(
            model, tokens, None if stopped is None else lambda: stopped(part_id))
        try:
            if size <= self.inline_max:
                source: dict[str, Any] = {"requests": {"requests": [
                    {"request": r, "metadata": {"key": i.custom_id}}
                    for i, (_, r) in zip(items, requests, strict=True)]}}
            else:
                source = {"fileName": await self._upload(part_id, items, requests)}
            body = {"batch": {"displayName": display_name(part_id, tokens), "inputConfig": source}}
            path = f"{self.version}/models/{model}:batchGenerateContent"
            created = await self.api.json("POST", path, idempotent=False, deadline=None, json=body)
        except BaseException:
            self.enqueued.release(key)
            raise
        name = created.get("name")
        if not isinstance(name, str) or not name:
            self.enqueued.release(key)
            raise upstream_error(self.name, "batch creation returned no operation name")
        self.enqueued.bind(key, name)
        return name

    async def _upload(self, part_id: str, items: Sequence[JobItem],
                      requests: list[tuple[str, dict[str, Any]]]) -> str:
        """The Files API's resumable upload: start (the URL comes back in a header), then the
        bytes with ``upload, finalize``."""
        content = b"".join(json.dumps({"key": i.custom_id, "request": r}, separators=(",", ":")).encode()
                           + b"\n" for i, (_, r) in zip(items, requests, strict=True))
        start = await self.api.request(
            "POST", f"/upload{self.version}/files", idempotent=True, deadline=None,
            json={"file": {"displayName": f"{PREFIX}-{part_id}"}},
            headers={"x-goog-upload-protocol": "resumable", "x-goog-upload-command": "start",
                     "x-goog-upload-header-content-length": str(len(content)),
                     "x-goog-upload-header-content-type": "application/jsonl"})
        url = start.headers.get("x-goog-upload-url")
        if not url:
            raise upstream_error(self.name, "the upload start returned no x-goog-upload-url")
        done = await self.api.request(
            "POST", url, idempotent=True, deadline=None, content=content,
            headers={"x-goog-upload-command": "upload, finalize", "x-goog-upload-offset": "0",
                     "content-type": "application/jsonl"})
        try:
            uploaded = done.json()
        except ValueError:
            uploaded = None
        file = uploaded.get("file") if isinstance(uploaded, dict) else None
        name = file.get("name") if isinstance(file, dict) else None
        if not isinstance(name, str):
            raise upstream_error(self.name, "the upload returned no file name")
        return name

    async def find(self, part_id: str, since_wall: float, size: int, claimed: set[str]) -> str | None:
        token: str | None = None
        for _ in range(MAX_LIST_PAGES):
            params: dict[str, Any] = {"pageSize": 100}
            if token:
                params["pageToken"] = token
            try:
                page = await self.api.json("GET", f"{self.version}/batches", idempotent=True,
                                           deadline=None, params=params)
            except RpcError as e:
                if (e.data or {}).get("upstream_status") in (404, 405, 501):
                    raise SubmissionUnknown("the upstream cannot list batches") from None
                raise
            for op in page.get("operations") or []:
                if not isinstance(op, dict):
                    continue
                found = parse_display(_metadata(op).get("displayName") or op.get("displayName"))
                if found is not None and found[0] == part_id and op.get("name") not in claimed:
                    return str(op["name"])
            token = page.get("nextPageToken")
            if not token:
                return None
        raise SubmissionUnknown(f"more than {MAX_LIST_PAGES} pages of batches to look through")

    # -- poll, results, cancel ----------------------------------------------------------
    async def poll(self, remote_id: str) -> RemoteStatus:
        op = await self.api.json("GET", f"{self.version}/{remote_id}", idempotent=True, deadline=None)
        meta = _metadata(op)
        word = state_word(meta.get("state") or op.get("state"))
        error = op.get("error")
        if not word and op.get("done"):
            word = "FAILED" if isinstance(error, dict) else "SUCCEEDED"
        terminal = TERMINAL.get(word)
        stats = meta.get("batchStats")
        stats = stats if isinstance(stats, dict) else {}
        counts = {k: int(v) for k, v in stats.items() if str(v).isdigit()}
        detail = str(error.get("message")) if isinstance(error, dict) and error.get("message") else None
        if terminal is None:
            found = parse_display(meta.get("displayName"))
            model = str(meta.get("model", "")).removeprefix("models/")
            if found is not None:
                self.enqueued.learn(remote_id, model, found[1])
        else:
            self.enqueued.release(remote_id)
        return RemoteStatus(remote_id, word or "UNSPECIFIED", terminal, counts, detail, op)

    async def results(self, status: RemoteStatus) -> AsyncIterator[LineResult]:
        output = _output(status.raw)
        file = output.get("responsesFile") or output.get("fileName")
        if isinstance(file, str) and file:
            path = f"/download{self.version}/{file}:download"
            response = await self.api.request("GET", path, idempotent=True, deadline=None, stream=True,
                                              params={"alt": "media"})
            async for line in read_result_lines(self.name, response, parse_line, file):
                yield line
            return
        inlined = _inlined(output)
        if not inlined:
            return
        keys: list[str] = []
        found = parse_display(_metadata(status.raw).get("displayName"))
        if found is not None and self.order is not None:
            keys = await self.order(found[0])
        for pos, row in enumerate(inlined):
            if not isinstance(row, dict):
                continue
            meta = row.get("metadata")
            echoed = meta.get("key") if isinstance(meta, dict) else None
            key = echoed if isinstance(echoed, str) else (keys[pos] if pos < len(keys) else None)
            if key is None:
                log.warning("%s: an inline result of %s matches no request", self.name, status.remote_id)
                continue
            yield line_result(self.name, key, row)

    async def cancel(self, remote_id: str) -> None:
        await self.api.json("POST", f"{self.version}/{remote_id}:cancel", idempotent=True, deadline=None,
                            json={})
