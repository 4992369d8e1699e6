"""Files and Batch API of the OpenAI fake.

Time does not pass in a batch; polls do. Each `GET /v1/batches/{id}` advances the job one step
(validating -> in_progress -> finalizing -> completed after `polls_to_complete` polls), so tests
drive the whole life cycle without sleeping.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.fakes.common import ApiError, Dialect, guarded_route, json_body, jsonl, require, shuffled
from tests.fakes.strict import KNOWN, check_keys

if TYPE_CHECKING:
    from tests.fakes.openai_fake import FakeOpenAIState

Operation = Callable[["FakeOpenAIState", dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class BatchVariant:
    """How another vendor's OpenAI-shaped Batch API differs (from batch-providers.md):
    where files and batches live, the upload purpose, the windows it takes, how it spells
    statuses on the wire, whether the create reply is wrapped (Together's ``{"job": ...}``),
    whether it keeps ``metadata``, how it pages listings (Groq: ``paging.next_cursor``;
    Together: a bare array), query parameters every request must carry (Azure's
    ``api-version``), and the ``endpoint`` a create names for each line ``url``."""

    files: str = "/v1/files"
    batches: str = "/v1/batches"
    purpose: str = "batch"
    windows: frozenset[str] = frozenset({"24h"})
    spell: Callable[[str], str] = str
    wrap_create: bool = False
    metadata: bool = True
    listing: str = "after"  # "after" (OpenAI), "cursor" (Groq), "array" (Together)
    query: tuple[str, ...] = ()
    create_endpoints: Mapping[str, str] | None = None  # create's endpoint -> the lines' url


OPENAI = BatchVariant()

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
FILE_PURPOSES = frozenset({"batch", "fine-tune", "assistants", "vision", "user_data", "evals"})
MAX_FILE_BYTES = 200 * 1024 * 1024
DAY_S = 24 * 3600


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass
class BatchJob:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    metadata: dict[str, Any] | None
    items: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    status: str = "validating"
    polls: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int = 0
    failed: int = 0
    times: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at")
        more = ("cancelling_at", "cancelled_at")
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.created_at + DAY_S,
            **{name: self.times.get(name) for name in stamps + more},
            "request_counts": {
                "total": 0 if self.errors else len(self.items),
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


def batch_routes(
    state: FakeOpenAIState, dialect: Dialect, operations: Mapping[str, Operation],
    variant: BatchVariant = OPENAI,
) -> list[Route]:
    """Routes for /v1/files and /v1/batches (or the variant's); `operations` run each line's body."""

    def render(job: BatchJob) -> dict[str, Any]:
        body = job.to_json()
        body["status"] = variant.spell(job.status)
        if not variant.metadata:
            body.pop("metadata", None)
        return body

    def check_query(request: Request) -> None:
        for name in variant.query:
            if not request.query_params.get(name):
                raise ApiError(400, f"Missing required query parameter '{name}'", param=name)

    def guarded(path: str, methods: list[str], handler: Any) -> Route:
        async def checked(request: Request) -> Response:
            check_query(request)
            return await handler(request)
        return guarded_route(path, methods, checked, state, dialect)

    def now() -> int:
        return int(state.clock())

    def get_file(request: Request) -> StoredFile:
        file_id = request.path_params["file_id"]
        if file_id not in state.files:
            raise ApiError(404, f"No such File object: {file_id}", param="id")
        return state.files[file_id]

    def get_batch(request: Request) -> BatchJob:
        batch_id = request.path_params["batch_id"]
        if batch_id not in state.batches:
            raise ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
        return state.batches[batch_id]

    def store(filename: str, purpose: str, content: bytes) -> StoredFile:
        stored = StoredFile(state.next_id("file-"), filename, purpose, content, now())
        state.files[stored.id] = stored
        return stored

    async def upload(request: Request) -> Response:
        async with request.form() as form:
            purpose, upload = form.get("purpose"), form.get("file")
            purposes = FILE_PURPOSES | {variant.purpose}
            if not isinstance(purpose, str) or purpose not in purposes:
                raise ApiError(400, f"'purpose' must be one of {sorted(purposes)}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "'file' must be a multipart file part", param="file")
            filename = upload.filename or "upload"
            content = await upload.read()
        if purpose == variant.purpose and not filename.endswith(".jsonl"):
            raise ApiError(400, "Invalid file format for Batch API. Must be .jsonl", param="file")
        if len(content) > MAX_FILE_BYTES:
            raise ApiError(400, "File is larger than 200 MB", param="file")
        return JSONResponse(store(filename, purpose, content).to_json())

    async def file_meta(request: Request) -> Response:
        return JSONResponse(get_file(request).to_json())

    async def file_content(request: Request) -> Response:
        return Response(get_file(request).content, media_type="application/octet-stream")

    async def create(request: Request) -> Response:
        body = await json_body(request)
        file_id = require(body, "input_file_id", str)
        named = require(body, "endpoint", str)
        window = require(body, "completion_window", str)
        endpoint = (variant.create_endpoints or {}).get(named, named)
        if endpoint not in operations:
            raise ApiError(400, f"'endpoint' must be one of {sorted(operations)}", param="endpoint")
        if window not in variant.windows:
            raise ApiError(400, f"'completion_window' must be one of {sorted(variant.windows)}",
                           param="completion_window")
        if state.quota_full_creates > 0:  # Azure: enqueued tokens over the quota, fail fast
            state.quota_full_creates -= 1
            raise ApiError(400, "Enqueued token limit reached for this deployment: "
                           "token_limit_exceeded", code="token_limit_exceeded")
        source = state.files.get(file_id)
        if source is None:
            raise ApiError(404, f"No such File object: {file_id}", param="input_file_id")
        if source.purpose != variant.purpose:
            raise ApiError(400, f"The input file must be uploaded with purpose '{variant.purpose}'",
                           param="input_file_id")
        items, errors = validate_lines(source.content, endpoint, state.max_batch_requests)
        job = BatchJob(
            state.next_id("batch_"), endpoint, file_id, window, now(), body.get("metadata"), items, errors
        )
        state.batches[job.id] = job
        if state.polls_to_complete <= 0:
            advance(job)
        return JSONResponse({"job": render(job)} if variant.wrap_create else render(job))

    async def list_batches(request: Request) -> Response:
        """Newest first, paged with ``limit`` and ``after`` (a batch id), as the real API."""
        jobs = sorted(state.batches.values(), key=lambda j: j.created_at, reverse=True)
        if variant.listing == "array":
            return JSONResponse([render(j) for j in jobs])
        after = request.query_params.get("after" if variant.listing == "after" else "cursor")
        if after:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        limit = max(1, min(100, int(request.query_params.get("limit", "20"))))
        page = jobs[:limit]
        if variant.listing == "cursor":
            more = len(jobs) > limit
            return JSONResponse({"object": "list", "data": [render(j) for j in page],
                                 "paging": {"next_cursor": page[-1].id if more and page else None}})
        return JSONResponse({"object": "list", "data": [render(j) for j in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(jobs) > limit})

    async def poll(request: Request) -> Response:
        job = get_batch(request)
        job.polls += 1
        advance(job)
        return JSONResponse(render(job))

    async def cancel(request: Request) -> Response:
        job = get_batch(request)
        if job.status in TERMINAL:
            raise ApiError(400, f"Cannot cancel a batch with status '{job.status}'.")
        if job.status != "cancelling":
            job.status = "cancelling"
            job.times["cancelling_at"] = now()
        return JSONResponse(render(job))

    def advance(job: BatchJob) -> None:
        if job.status in TERMINAL:
            return
        if job.errors:
            return end(job, "failed", 0)
        if job.status == "cancelling":
            return end(job, "cancelled", state.cancel_after_items)
        forced = state.force_status
        if forced == "failed":
            job.errors = [
                {"code": "batch_failed", "message": "failure forced by the test", "param": None, "line": None}
            ]
            return end(job, "failed", 0)
        if forced == "expired":
            return end(job, "expired", state.expired_cut(len(job.items)))
        if forced == "cancelled":
            return end(job, "cancelled", state.cancel_after_items)
        status = progress(job.polls, state.polls_to_complete)
        if status == "completed":
            return end(job, "completed", len(job.items))
        if status != job.status:
            job.status = status
            job.times[f"{status}_at"] = now()
        return None

    def end(job: BatchJob, status: str, done: int) -> None:
        outputs: list[dict[str, Any]] = []
        failures: list[dict[str, Any]] = []
        for item in job.items[:done]:
            line = run_item(item, operations[job.endpoint])
            (failures if line["error"] or line["response"]["status_code"] != 200 else outputs).append(line)
        if status == "expired" and state.expired_in_error_file:
            failures += [expired_line(item) for item in job.items[done:]]
        rng = state.rng(job.id)
        if outputs:
            job.output_file_id = store(
                f"{job.id}_output.jsonl", "batch_output", jsonl(shuffled(outputs, rng))
            ).id
        if failures:
            job.error_file_id = store(
                f"{job.id}_error.jsonl", "batch_output", jsonl(shuffled(failures, rng))
            ).id
        job.completed, job.failed = len(outputs), len(job.items[:done]) - len(outputs)
        stamp = now()
        if status == "completed":
            job.times.setdefault("in_progress_at", stamp)
            job.times.setdefault("finalizing_at", stamp)
        job.status = status
        job.times[f"{status}_at"] = stamp

    def run_item(item: dict[str, Any], operation: Operation) -> dict[str, Any]:
        line_id, custom_id = state.next_id("batch_req_"), item["custom_id"]
        try:
            if custom_id in state.fail_custom_ids:
                raise ApiError(400, f"fake failure: custom_id {custom_id!r} is in fail_custom_ids")
            if item.get("url") in KNOWN:
                check_keys(state.strict_keys, item["url"], item["body"])
            body = operation(state, item["body"])
        except ApiError as exc:
            error = {
                "message": exc.message,
                "type": exc.kind or "invalid_request_error",
                "param": exc.param,
                "code": exc.code,
            }
            if state.item_error_style == "error":
                return {
                    "id": line_id,
                    "custom_id": custom_id,
                    "response": None,
                    "error": {"code": exc.code or "invalid_request", "message": exc.message},
                }
            response = {
                "status_code": exc.status,
                "request_id": state.next_id("req_"),
                "body": {"error": error},
            }
            return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}
        response = {"status_code": 200, "request_id": state.next_id("req_"), "body": body}
        return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}

    def expired_line(item: dict[str, Any]) -> dict[str, Any]:
        message = "This request could not be executed before the completion window expired."
        return {
            "id": state.next_id("batch_req_"),
            "custom_id": item["custom_id"],
            "response": None,
            "error": {"code": "batch_expired", "message": message},
        }

    async def list_files(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [f.to_json() for f in state.files.values()]})

    files, batches = variant.files, variant.batches
    return [
        guarded(files, ["POST"], upload),
        guarded(files, ["GET"], list_files),
        guarded(files + "/{file_id}", ["GET"], file_meta),
        guarded(files + "/{file_id}/content", ["GET"], file_content),
        guarded(batches, ["POST"], create),
        guarded(batches, ["GET"], list_batches),
        guarded(batches + "/{batch_id}", ["GET"], poll),
        guarded(batches + "/{batch_id}/cancel", ["POST"], cancel),
    ]


def progress(polls: int, polls_to_complete: int) -> str:
    """Status after `polls` GETs: completed at `polls_to_complete`, finalizing one poll before (if room)."""
    if polls >= polls_to_complete:
        return "completed"
    if polls == 0:
        return "validating"
    if polls == polls_to_complete - 1 and polls_to_complete >= 3:
        return "finalizing"
    return "in_progress"


def validate_lines(
    content: bytes, endpoint: str, max_requests: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Parse the input JSONL; any error fails the whole batch, as the real validation step does."""
    items: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    model: str | None = None

    def fail(code: str, message: str, line: int | None, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    lines = [
        (n, text) for n, text in enumerate(content.decode(errors="replace").splitlines(), 1) if text.strip()
    ]
    if not lines:
        fail("empty_file", "The batch input file is empty.", None)
    if len(lines) > max_requests:
        fail("too_many_requests", f"The batch input file has more than {max_requests} requests.", None)
    for number, text in lines:
        try:
            row = json.loads(text)
        except ValueError:
            fail("invalid_json_line", "This line is not parseable as valid JSON.", number)
            continue
        if not isinstance(row, dict):
            fail("invalid_json_line", "Each line must be a JSON object.", number)
            continue
        custom_id, body = row.get("custom_id"), row.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            fail("missing_required_parameter", "custom_id is required.", number, "custom_id")
        elif custom_id in seen:
            fail(
                "duplicate_custom_id",
                "The custom_id for this request is a duplicate of another request.",
                number,
                "custom_id",
            )
        if row.get("method") != "POST":
            fail("invalid_method", "method must be POST.", number, "method")
        if row.get("url") != endpoint:
            fail(
                "invalid_url",
                f"The URL provided for this request does not match the batch endpoint {endpoint}.",
                number,
                "url",
            )
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            fail("missing_required_parameter", "body with a model is required.", number, "body")
        elif model is None:
            model = body["model"]
        elif body["model"] != model:
            fail(
                "mismatched_model",
                "The provided model does not match the model of the other requests.",
                number,
                "body.model",
            )
        if isinstance(custom_id, str):
            seen.add(custom_id)
        items.append(row)
    return items, errors
