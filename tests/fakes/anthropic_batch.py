"""Message Batches of the Anthropic fake.

As in the OpenAI fake, polls rather than time move a batch: it ends on the
`polls_to_complete`-th `GET`, so tests never sleep.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.fakes.common import ApiError, Dialect, guarded_route, json_body, jsonl, require, rfc3339, shuffled
from tests.fakes.strict import check_keys

if TYPE_CHECKING:
    from tests.fakes.anthropic_fake import FakeAnthropicState

CreateMessage = Callable[["FakeAnthropicState", dict[str, Any]], dict[str, Any]]
ErrorObject = Callable[[ApiError], dict[str, Any]]

CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
DAY_S = 24 * 3600
COUNT_KEYS = ("processing", "succeeded", "errored", "canceled", "expired")


@dataclass
class MessageBatch:
    id: str
    created_at: float
    requests: list[dict[str, Any]]
    processing_status: str = "in_progress"
    polls: int = 0
    results: list[dict[str, Any]] | None = None
    ended_at: float | None = None
    cancel_initiated_at: float | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self, base_url: str) -> dict[str, Any]:
        ended = self.processing_status == "ended"
        counts = self.counts if ended else {**dict.fromkeys(COUNT_KEYS, 0), "processing": len(self.requests)}
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.processing_status,
            "request_counts": counts,
            "ended_at": None if self.ended_at is None else rfc3339(self.ended_at),
            "created_at": rfc3339(self.created_at),
            "expires_at": rfc3339(self.created_at + DAY_S),
            "archived_at": None,
            "cancel_initiated_at": None
            if self.cancel_initiated_at is None
            else rfc3339(self.cancel_initiated_at),
            "results_url": f"{base_url}/v1/messages/batches/{self.id}/results" if ended else None,
        }


def batch_routes(
    state: FakeAnthropicState, dialect: Dialect, create_message: CreateMessage, error_object: ErrorObject
) -> list[Route]:
    """Routes for /v1/messages/batches; each request's params run through `create_message`."""

    def base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    def get_batch(request: Request) -> MessageBatch:
        batch_id = request.path_params["batch_id"]
        if batch_id not in state.batches:
            raise ApiError(404, f"message batch {batch_id!r} not found")
        return state.batches[batch_id]

    async def create(request: Request) -> Response:
        requests = require(await json_body(request), "requests", list)
        if not requests:
            raise ApiError(400, "requests: must contain at least one request")
        if len(requests) > state.max_batch_requests:
            raise ApiError(400, f"requests: at most {state.max_batch_requests} requests per batch")
        seen: set[str] = set()
        for index, entry in enumerate(requests):
            custom_id = entry.get("custom_id") if isinstance(entry, dict) else None
            if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
                raise ApiError(400, f"requests.{index}.custom_id: must match {CUSTOM_ID.pattern}")
            if custom_id in seen:
                raise ApiError(400, f"requests.{index}.custom_id: duplicate custom_id {custom_id!r}")
            if not isinstance(entry.get("params"), dict):
                raise ApiError(400, f"requests.{index}.params: must be an object")
            check_keys(state.strict_keys, "/v1/messages", entry["params"])
            seen.add(custom_id)
        batch = MessageBatch(state.next_id("msgbatch_"), state.clock(), requests)
        state.batches[batch.id] = batch
        if state.polls_to_complete <= 0:
            advance(batch)
        return JSONResponse(batch.to_json(base(request)))

    async def list_batches(request: Request) -> Response:
        """Newest first, paged with ``limit`` and ``after_id``, as the real API."""
        batches = list(reversed(state.batches.values()))
        after = request.query_params.get("after_id")
        if after:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        limit = max(1, min(1000, int(request.query_params.get("limit", "20"))))
        page = batches[:limit]
        return JSONResponse({"data": [b.to_json(base(request)) for b in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(batches) > limit})

    async def poll(request: Request) -> Response:
        batch = get_batch(request)
        batch.polls += 1
        advance(batch)
        return JSONResponse(batch.to_json(base(request)))

    async def cancel(request: Request) -> Response:
        batch = get_batch(request)
        if batch.processing_status == "ended":
            raise ApiError(400, f"message batch {batch.id!r} has already ended")
        if batch.processing_status != "canceling":
            batch.processing_status = "canceling"
            batch.cancel_initiated_at = state.clock()
        return JSONResponse(batch.to_json(base(request)))

    async def results(request: Request) -> Response:
        batch = get_batch(request)
        if batch.results is None:
            raise ApiError(
                400, f"message batch {batch.id!r} is still {batch.processing_status}; no results yet"
            )
        return Response(jsonl(batch.results), media_type="application/x-jsonl")

    def advance(batch: MessageBatch) -> None:
        if batch.processing_status == "ended":
            return
        total = len(batch.requests)
        if batch.processing_status == "canceling" or state.force_status == "canceled":
            end(batch, state.cancel_after_items, "canceled")
        elif state.force_status == "expired":
            end(batch, state.expired_cut(total), "expired")
        elif batch.polls >= state.polls_to_complete:
            end(batch, total)

    def end(batch: MessageBatch, done: int, rest: str = "expired") -> None:
        """Settle every request: the first `done` run, the rest become `rest` (expired or canceled)."""
        rows = [
            {"custom_id": entry["custom_id"], "result": run(entry) if i < done else {"type": rest}}
            for i, entry in enumerate(batch.requests)
        ]
        counts = dict.fromkeys(COUNT_KEYS, 0)
        for row in rows:
            counts[row["result"]["type"]] += 1
        batch.counts = counts
        batch.results = shuffled(rows, state.rng(batch.id))
        batch.processing_status = "ended"
        batch.ended_at = state.clock()

    def run(entry: dict[str, Any]) -> dict[str, Any]:
        try:
            if entry["custom_id"] in state.fail_custom_ids:
                raise ApiError(400, f"fake failure: custom_id {entry['custom_id']!r} is in fail_custom_ids")
            return {"type": "succeeded", "message": create_message(state, entry["params"])}
        except ApiError as exc:
            return {"type": "errored", "error": error_object(exc)}

    return [
        guarded_route("/v1/messages/batches", ["POST"], create, state, dialect),
        guarded_route("/v1/messages/batches", ["GET"], list_batches, state, dialect),
        guarded_route("/v1/messages/batches/{batch_id}", ["GET"], poll, state, dialect),
        guarded_route("/v1/messages/batches/{batch_id}/cancel", ["POST"], cancel, state, dialect),
        guarded_route("/v1/messages/batches/{batch_id}/results", ["GET"], results, state, dialect),
    ]
