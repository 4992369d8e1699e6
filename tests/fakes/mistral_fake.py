"""A fake Mistral API: OpenAI-compatible chat and embeddings, files and batch jobs.

Written from ``shared/notes/batch-providers.md`` section 3: ``Authorization: Bearer``; files
``POST /v1/files`` (``purpose`` fine-tune, batch or ocr), ``GET /v1/files/{id}/content``; jobs
``POST|GET /v1/batch/jobs``, ``GET /v1/batch/jobs/{id}``, ``POST /v1/batch/jobs/{id}/cancel``;
create ``{input_files, endpoint, model, metadata, timeout_hours}``; input lines
``{custom_id, body}`` (``body.model`` optional when the job sets it); one model per job; job
fields ``id, input_files, endpoint, model, output_file, error_file, errors[{message, count}],
status, created_at, ..., total_requests, completed_requests, succeeded_requests,
failed_requests, metadata``; statuses ``QUEUED, RUNNING, SUCCESS, FAILED, TIMEOUT_EXCEEDED,
CANCELLATION_REQUESTED, CANCELLED``; output lines ``{custom_id, response{status_code, body}}``.
The error-file line shape is unverified: failed lines are written there as a response with a
non-2xx status and an error body, like the output file's. Like the OpenAI fake, time does not
pass in a job; polls do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.fakes.common import (
    ApiError,
    Dialect,
    guarded_route,
    json_body,
    jsonl,
    not_found_handlers,
    shuffled,
)
from tests.fakes.openai_batch import StoredFile
from tests.fakes.openai_fake import DIALECT, FakeOpenAIState, chat_completion, embeddings
from tests.fakes.streaming import sse, words

__all__ = ["FakeMistralState", "create_app"]

PURPOSES = frozenset({"fine-tune", "batch", "ocr"})
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/embeddings"})
ENDED = frozenset({"SUCCESS", "FAILED", "TIMEOUT_EXCEEDED", "CANCELLED"})


@dataclass
class MistralJob:
    id: str
    input_files: list[str]
    endpoint: str
    model: str | None
    metadata: dict[str, Any] | None
    timeout_hours: int
    created_at: int
    items: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    status: str = "QUEUED"
    polls: int = 0
    output_file: str | None = None
    error_file: str | None = None
    succeeded: int = 0
    failed: int = 0

    def to_json(self) -> dict[str, Any]:
        done = self.succeeded + self.failed
        return {"id": self.id, "object": "batch", "input_files": self.input_files,
                "endpoint": self.endpoint, "model": self.model, "metadata": self.metadata,
                "output_file": self.output_file, "error_file": self.error_file,
                "errors": self.errors, "status": self.status, "created_at": self.created_at,
                "started_at": self.created_at if self.status != "QUEUED" else None,
                "completed_at": self.created_at if self.status in ENDED else None,
                "total_requests": len(self.items), "completed_requests": done,
                "succeeded_requests": self.succeeded, "failed_requests": self.failed}


@dataclass
class FakeMistralState(FakeOpenAIState):
    """`force_status` ("failed", "expired" = TIMEOUT_EXCEEDED, "cancelled") ends the next polled job."""

    jobs: dict[str, MistralJob] = field(default_factory=dict)


def _render_error(exc: ApiError) -> Response:
    # Mistral's error body (unverified in the notes): the message at the top level
    return JSONResponse({"object": "error", "message": exc.message,
                         "type": exc.kind or "invalid_request_error", "param": exc.param,
                         "code": exc.code}, status_code=exc.status)


MISTRAL_DIALECT = Dialect(check_auth=DIALECT.check_auth, render_error=_render_error,
                          limit_headers=DIALECT.limit_headers, request_id_header="x-kong-request-id")


def _stream(fake: FakeMistralState, result: dict[str, Any]) -> Response:
    """Chunks of the reply; the last carries the finish reason and the usage, then ``[DONE]``."""
    head = {k: result[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    text = result["choices"][0]["message"]["content"]

    async def events() -> Any:
        yield None, {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}]}
        for word in words(text):
            yield None, {**head, "choices": [{"index": 0, "delta": {"content": word},
                                              "finish_reason": None}]}
        yield None, {**head, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}],
                     "usage": result["usage"]}
        yield None, "[DONE]"

    return sse(events, fake, lambda: (None, {"object": "error", "message": "fake failure mid-stream"}))


def create_app(state: FakeMistralState | None = None) -> Starlette:
    fake = FakeMistralState() if state is None else state

    def now() -> int:
        return int(fake.clock())

    async def chat(request: Request) -> Response:
        body = await json_body(request)
        if "stream_options" in body:  # not part of Mistral's API (the notes name none)
            raise ApiError(422, "Extra inputs are not permitted: stream_options", param="stream_options")
        result = chat_completion(fake, body)
        fake.bodies.setdefault("/v1/chat/completions", []).append(body)
        return _stream(fake, result) if body.get("stream") else JSONResponse(result)

    async def embed(request: Request) -> Response:
        result = embeddings(fake, await json_body(request))
        fake.embedding_batch_sizes.append(len(result["data"]))
        return JSONResponse(result)

    async def upload(request: Request) -> Response:
        async with request.form() as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str) or purpose not in PURPOSES:
                raise ApiError(422, f"'purpose' must be one of {sorted(PURPOSES)}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(422, "'file' must be a multipart file part", param="file")
            stored = StoredFile(fake.next_id("file-"), upload.filename or "upload", purpose,
                                await upload.read(), now())
        fake.files[stored.id] = stored
        return JSONResponse(stored.to_json())

    async def content(request: Request) -> Response:
        stored = fake.files.get(request.path_params["file_id"])
        if stored is None:
            raise ApiError(404, "File not found")
        return Response(stored.content, media_type="application/octet-stream")

    async def create(request: Request) -> Response:
        body = await json_body(request)
        files, endpoint, model = body.get("input_files"), body.get("endpoint"), body.get("model")
        if endpoint not in ENDPOINTS:
            raise ApiError(422, f"'endpoint' must be one of {sorted(ENDPOINTS)}", param="endpoint")
        if not isinstance(files, list) or not files or any(f not in fake.files for f in files):
            raise ApiError(422, "'input_files' must name uploaded files", param="input_files")
        if any(fake.files[f].purpose != "batch" for f in files):
            raise ApiError(422, "input files must have purpose 'batch'", param="input_files")
        items, errors = _lines(b"".join(fake.files[f].content for f in files), model)
        job = MistralJob(fake.next_id("job-"), files, endpoint, model, body.get("metadata"),
                         int(body.get("timeout_hours") or 24), now(), items, errors)
        fake.jobs[job.id] = job
        return JSONResponse(job.to_json())

    async def list_jobs(request: Request) -> Response:
        jobs = sorted(fake.jobs.values(), key=lambda j: j.created_at, reverse=True)
        page = int(request.query_params.get("page", "0"))
        size = int(request.query_params.get("page_size", "100"))
        return JSONResponse({"object": "list", "total": len(jobs),
                             "data": [j.to_json() for j in jobs[page * size:(page + 1) * size]]})

    def job_of(request: Request) -> MistralJob:
        job = fake.jobs.get(request.path_params["job_id"])
        if job is None:
            raise ApiError(404, "Batch job not found")
        return job

    async def poll(request: Request) -> Response:
        job = job_of(request)
        job.polls += 1
        advance(job)
        return JSONResponse(job.to_json())

    async def cancel(request: Request) -> Response:
        job = job_of(request)
        if job.status not in ENDED:
            job.status = "CANCELLATION_REQUESTED"
        return JSONResponse(job.to_json())

    def advance(job: MistralJob) -> None:
        if job.status in ENDED:
            return
        if job.errors:
            return end(job, "FAILED", 0)
        if job.status == "CANCELLATION_REQUESTED":
            return end(job, "CANCELLED", fake.cancel_after_items)
        if fake.force_status == "failed":
            job.errors = [{"message": "failure forced by the test", "count": 1}]
            return end(job, "FAILED", 0)
        if fake.force_status == "expired":
            return end(job, "TIMEOUT_EXCEEDED", fake.expired_cut(len(job.items)))
        if fake.force_status == "cancelled":
            return end(job, "CANCELLED", fake.cancel_after_items)
        if job.polls >= fake.polls_to_complete:
            return end(job, "SUCCESS", len(job.items))
        job.status = "RUNNING"
        return None

    def end(job: MistralJob, status: str, done: int) -> None:
        answer = chat_completion if job.endpoint == "/v1/chat/completions" else embeddings
        outputs, failures = [], []
        for row in job.items[:done]:
            body = {**row["body"], "model": row["body"].get("model") or job.model}
            try:
                if row["custom_id"] in fake.fail_custom_ids:
                    raise ApiError(400, f"fake failure: custom_id {row['custom_id']!r}")
                result = answer(fake, body)
                outputs.append({"id": fake.next_id("req-"), "custom_id": row["custom_id"],
                                "response": {"status_code": 200, "body": result}})
            except ApiError as exc:
                failures.append({"id": fake.next_id("req-"), "custom_id": row["custom_id"],
                                 "response": {"status_code": exc.status, "body": {
                                     "object": "error", "message": exc.message,
                                     "type": "invalid_request_error", "code": exc.code}}})
        rng = fake.rng(job.id)
        for rows, attr in ((outputs, "output_file"), (failures, "error_file")):
            if rows:
                stored = StoredFile(fake.next_id("file-"), f"{job.id}_{attr}.jsonl", "batch_result",
                                    jsonl(shuffled(rows, rng)), now())
                fake.files[stored.id] = stored
                setattr(job, attr, stored.id)
        job.succeeded, job.failed = len(outputs), len(failures)
        job.status = status

    routes = [
        guarded_route("/v1/chat/completions", ["POST"], chat, fake, MISTRAL_DIALECT),
        guarded_route("/v1/embeddings", ["POST"], embed, fake, MISTRAL_DIALECT),
        guarded_route("/v1/files", ["POST"], upload, fake, MISTRAL_DIALECT),
        guarded_route("/v1/files/{file_id}/content", ["GET"], content, fake, MISTRAL_DIALECT),
        guarded_route("/v1/batch/jobs", ["POST"], create, fake, MISTRAL_DIALECT),
        guarded_route("/v1/batch/jobs", ["GET"], list_jobs, fake, MISTRAL_DIALECT),
        guarded_route("/v1/batch/jobs/{job_id}", ["GET"], poll, fake, MISTRAL_DIALECT),
        guarded_route("/v1/batch/jobs/{job_id}/cancel", ["POST"], cancel, fake, MISTRAL_DIALECT),
    ]
    app = Starlette(routes=routes, exception_handlers=not_found_handlers(MISTRAL_DIALECT))
    app.state.fake = fake
    return app


def _lines(content: bytes, model: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``{custom_id, body}`` lines; a malformed file fails the whole job, one model per job."""
    items: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for text in content.decode(errors="replace").splitlines():
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError:
            errors.append({"message": "invalid JSON line", "count": 1})
            continue
        cid, body = row.get("custom_id"), row.get("body")
        if not isinstance(cid, str) or cid in seen or not isinstance(body, dict):
            errors.append({"message": "each line needs a unique custom_id and a body", "count": 1})
            continue
        if set(row) - {"custom_id", "body"}:
            errors.append({"message": f"unexpected keys {sorted(set(row) - {'custom_id', 'body'})}",
                           "count": 1})
        line_model = body.get("model") or model
        if not isinstance(line_model, str) or (model is not None and line_model != model):
            errors.append({"message": "one model per job: set model on the job", "count": 1})
        seen.add(cid)
        items.append(row)
    if not items and not errors:
        errors.append({"message": "empty input file", "count": 1})
    return items, errors
