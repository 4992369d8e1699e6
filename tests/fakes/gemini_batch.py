"""Files (resumable upload, download of generated files) and the Batch API of the Gemini fake.

As in the other fakes, polls rather than time move a batch: it ends on the
`polls_to_complete`-th `GET /v1beta/batches/{id}`, so tests never sleep. File results are
written shuffled (matched by `key`), inline results in input order without their keys (unless
`echo_inline_keys`), failed requests as `{key, error: {code, message}}`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.fakes.common import ApiError, Dialect, guarded_route, json_body, shuffled, word_count

if TYPE_CHECKING:
    from tests.fakes.gemini_fake import FakeGeminiState

OUTPUT_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatchOutput"
META_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch"
RUNNING = ("PENDING", "RUNNING")


def _get(body: dict[str, Any], camel: str) -> Any:
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    return body.get(camel, body.get(snake))


def _tokens(request: dict[str, Any]) -> int:
    return sum(word_count(p.get("text", "")) for turn in request.get("contents") or []
               for p in turn.get("parts") or [] if isinstance(p, dict))


def create_batch(fake: FakeGeminiState, model: str, body: dict[str, Any], base: str) -> dict[str, Any]:
    batch = body.get("batch")
    if not isinstance(batch, dict):
        raise ApiError(400, "* batch: batch is not specified")
    source = _get(batch, "inputConfig")
    if not isinstance(source, dict):
        raise ApiError(400, "* batch.input_config: input_config is not specified")
    inline, file_name = _get(source, "requests"), _get(source, "fileName")
    if (inline is None) == (file_name is None):
        raise ApiError(400, "input_config needs exactly one of requests and file_name")
    if inline is not None:
        entries = inline.get("requests") if isinstance(inline, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ApiError(400, "input_config.requests.requests must not be empty")
        requests = [(None, e.get("request")) for e in entries]
    else:
        if file_name not in fake.files:
            raise ApiError(404, f"File {file_name} not found")
        requests = []
        for n, line in enumerate(fake.files[file_name].splitlines()):
            row = json.loads(line)
            if not isinstance(row.get("key"), str) or not isinstance(row.get("request"), dict):
                raise ApiError(400, f"line {n + 1} of {file_name}: needs key and request")
            requests.append((row["key"], row["request"]))
    if any(not isinstance(r, dict) for _, r in requests):
        raise ApiError(400, "every request must be a GenerateContentRequest")
    running = [b for b in fake.batches.values() if b["state"] in RUNNING]
    if len(running) >= fake.max_concurrent_batches:
        raise ApiError(429, "Resource has been exhausted (concurrent batch jobs).")
    tokens = sum(_tokens(r) for _, r in requests)
    if fake.enqueued_token_limit is not None:
        held = sum(b["tokens"] for b in running if b["model"] == model)
        if held + tokens > fake.enqueued_token_limit:
            raise ApiError(429, f"Resource has been exhausted (enqueued tokens: {held} + {tokens} > "
                           f"{fake.enqueued_token_limit}).")
    bid = fake.next_id("b")
    fake.batches[bid] = {"id": bid, "model": model, "display": _get(batch, "displayName"), "state": "PENDING",
                         "polls": 0, "requests": requests, "inline": inline is not None, "tokens": tokens,
                         "output": None, "error": None, "created": fake.clock()}
    return operation(fake, fake.batches[bid])


def operation(fake: FakeGeminiState, batch: dict[str, Any]) -> dict[str, Any]:
    state = batch["state"]
    done = state not in RUNNING
    meta: dict[str, Any] = {"@type": META_TYPE, "model": f"models/{batch['model']}",
                            "displayName": batch["display"], "state": fake.state_prefix + state,
                            "batchStats": {"requestCount": str(len(batch["requests"])),
                                           "pendingRequestCount": str(0 if done else len(batch["requests"]))}}
    op: dict[str, Any] = {"name": f"batches/{batch['id']}", "metadata": meta}
    if done:
        op["done"] = True
        if batch["error"] is not None:
            op["error"] = batch["error"]
        elif batch["output"] is not None:
            output = {"@type": OUTPUT_TYPE, **batch["output"]}
            if fake.output_in == "response":
                op["response"] = output
            else:
                meta["output"] = output
    return op


def advance(fake: FakeGeminiState, batch: dict[str, Any]) -> None:
    if batch["state"] not in RUNNING:
        return
    batch["polls"] += 1
    if batch["state"] == "CANCELLING":
        return
    batch["state"] = "RUNNING"
    if fake.force_state == "EXPIRED":
        batch["state"] = "EXPIRED"  # no results at all
    elif fake.force_state == "FAILED":
        batch["state"], batch["error"] = "FAILED", {"code": 400, "message": "fake batch failure"}
    elif batch["polls"] >= fake.polls_to_complete:
        finish(fake, batch, len(batch["requests"]), "SUCCEEDED")


def finish(fake: FakeGeminiState, batch: dict[str, Any], done: int, state: str) -> None:
    from tests.fakes.gemini_fake import error_object, generate

    results = []
    for i, (key, request) in enumerate(batch["requests"][:done]):
        try:
            row: dict[str, Any] = {"response": generate(fake, batch["model"], request)}
        except ApiError as exc:
            row = {"error": {k: v for k, v in error_object(exc)["error"].items() if k in ("code", "message")}}
        if key is not None:
            row = {"key": key, **row}
        elif fake.echo_inline_keys:
            row["metadata"] = {"key": f"inline-{i}"}
        results.append(row)
    if batch["inline"]:
        batch["output"] = {"inlinedResponses": {"inlinedResponses": results}}
    else:
        name = f"files/batch-{batch['id']}-out"
        lines = shuffled(results, fake.rng(batch["id"]))
        fake.files[name] = b"".join(json.dumps(r).encode() + b"\n" for r in lines)
        batch["output"] = {"responsesFile": name}
    batch["state"] = state


def batch_routes(fake: FakeGeminiState, dialect: Dialect) -> list[Route]:
    def get_batch(request: Request) -> tuple[dict[str, Any], str]:
        bid, _, method = request.path_params["name"].partition(":")
        if bid not in fake.batches:
            raise ApiError(404, f"Batch batches/{bid} not found")
        return fake.batches[bid], method

    async def upload(request: Request) -> Response:
        command = request.headers.get("x-goog-upload-command", "")
        if request.headers.get("x-goog-upload-protocol") == "resumable" and command == "start":
            length = request.headers.get("x-goog-upload-header-content-length")
            if not (length or "").isdigit():
                raise ApiError(400, "X-Goog-Upload-Header-Content-Length is required")
            meta = await json_body(request)
            uid = fake.next_id("u")
            fake.uploads[uid] = {"length": int(length), "file": meta.get("file") or {}}
            url = f"{str(request.base_url).rstrip('/')}/upload/v1beta/files?upload_id={uid}"
            return Response(b"", headers={"x-goog-upload-url": url, "x-goog-upload-status": "active"})
        uid = request.query_params.get("upload_id", "")
        if uid not in fake.uploads or "upload" not in command:
            raise ApiError(400, "unknown upload session or command")
        if request.headers.get("x-goog-upload-offset") != "0":
            raise ApiError(400, "X-Goog-Upload-Offset must be 0 for a one-shot upload")
        content = await request.body()
        if len(content) != fake.uploads[uid]["length"]:
            raise ApiError(400, "the upload's size differs from the declared content length")
        name = f"files/{fake.next_id('f')}"
        fake.files[name] = content
        body = {"file": {"name": name, "mimeType": "application/jsonl", "sizeBytes": str(len(content)),
                         "uri": f"{str(request.base_url).rstrip('/')}/v1beta/{name}", "state": "ACTIVE"}}
        return JSONResponse(body, headers={"x-goog-upload-status": "final"})

    async def download(request: Request) -> Response:
        fid, _, method = request.path_params["name"].partition(":")
        name = f"files/{fid}"
        if method != "download" or request.query_params.get("alt") != "media":
            raise ApiError(400, "use files/{id}:download?alt=media")
        if name not in fake.files or not fid.startswith("batch-"):
            raise ApiError(404 if name not in fake.files else 400, f"{name} cannot be downloaded")
        return Response(fake.files[name], media_type="application/jsonl")

    async def poll(request: Request) -> Response:
        batch, method = get_batch(request)
        if method:
            raise ApiError(404, f"GET {method} is not a batch method")
        advance(fake, batch)
        if batch["state"] == "CANCELLING":
            finish(fake, batch, min(fake.cancel_after_items, len(batch["requests"])), "CANCELLED")
        return JSONResponse(operation(fake, batch))

    async def action(request: Request) -> Response:
        batch, method = get_batch(request)
        if method != "cancel":
            raise ApiError(404, f"unknown batch method {method!r}")
        if batch["state"] in RUNNING:
            batch["state"] = "CANCELLING"
        return JSONResponse({})

    async def list_batches(request: Request) -> Response:
        size = int(request.query_params.get("pageSize", "50"))
        start = int(request.query_params.get("pageToken") or 0)
        ops = [operation(fake, b) for b in reversed(list(fake.batches.values()))]
        page = ops[start:start + size]
        body: dict[str, Any] = {"operations": page}
        if start + size < len(ops):
            body["nextPageToken"] = str(start + size)
        return JSONResponse(body)

    return [
        guarded_route("/upload/v1beta/files", ["POST"], upload, fake, dialect),
        guarded_route("/download/v1beta/files/{name}", ["GET"], download, fake, dialect),
        guarded_route("/v1beta/batches", ["GET"], list_batches, fake, dialect),
        guarded_route("/v1beta/batches/{name}", ["GET"], poll, fake, dialect),
        guarded_route("/v1beta/batches/{name}", ["POST"], action, fake, dialect),
    ]
