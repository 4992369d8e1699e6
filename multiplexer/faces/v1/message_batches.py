"""Anthropic's Message Batches served by the gateway: ``/v1/messages/batches`` (create, list),
``/{id}`` (retrieve, delete), ``/{id}/cancel`` and ``/{id}/results``, in Anthropic's shapes, so
``client.messages.batches.create/retrieve/list/cancel/results/delete`` work unchanged.

A batch runs as an OpenAI batch does (``Batches.open``): its requests for an ``anthropic``
route with a batch API go up as one Message Batch of that provider (the job system), the rest
run through their lanes. It belongs to the key that made it; another key gets 404.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from multiplexer.core.errors import Code, RpcError, invalid_request
from multiplexer.faces.v1.anthropic import ANTHROPIC
from multiplexer.faces.v1.batch_run import Batches, body_json
from multiplexer.faces.v1.common import V1, HttpError, page_limit, send_chunks, send_json
from multiplexer.faces.v1.endpoint import Endpoint
from multiplexer.faces.v1.requests import MESSAGES
from multiplexer.faces.v1.store import BatchRecord, new_batch_id, now

MAX_REQUESTS = 100_000  # Anthropic's own cap per batch
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
COUNT_KEYS = ("processing", "succeeded", "errored", "canceled", "expired")
DAY_S = 86_400


def bad(message: str) -> HttpError:
    return HttpError(400, invalid_request(message))


def parse_requests(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(custom_id, params) per request, or the 400 that refuses the whole batch."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise bad("requests: must be a non-empty array of {custom_id, params}")
    if len(requests) > MAX_REQUESTS:
        raise bad(f"requests: at most {MAX_REQUESTS} requests per batch")
    seen: set[str] = set()
    out = []
    for i, entry in enumerate(requests):
        cid = entry.get("custom_id") if isinstance(entry, dict) else None
        if not isinstance(cid, str) or not CUSTOM_ID.fullmatch(cid):
            raise bad(f"requests.{i}.custom_id: must be 1 to 64 letters, digits, '_' or '-'")
        if cid in seen:
            raise bad(f"requests.{i}.custom_id: {cid!r} appears more than once")
        params = entry.get("params")
        if not isinstance(params, dict):
            raise bad(f"requests.{i}.params: must be an object (a Messages API request)")
        seen.add(cid)
        out.append((cid, params))
    return out


def rfc3339(t: int | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def outcome_of(entry: dict[str, Any] | None, cancelled: bool) -> str:
    """A request's ``result.type``: a line with no result ended by a cancel is canceled; one
    whose job is gone (``store.retention_s``) counts as expired."""
    if entry is None:
        return "canceled" if cancelled else "expired"
    if entry.get("canceled"):
        return "canceled"
    if entry.get("expired"):
        return "expired"
    return "succeeded" if entry["status"] == 200 else "errored"


class MessageBatches:
    """Anthropic's view of the gateway's batches: the ``message_batch`` object and results."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    async def wire(self, record: BatchRecord, base: str) -> dict[str, Any]:
        """``request_counts`` move as requests finish (Anthropic's own hold them in
        ``processing`` until the end); they always add up to the batch's size."""
        p = await self.batches.progress(record)
        if p.ended:
            counts = await self.final_counts(record)
        else:
            done = p.succeeded + p.failed
            counts = {"processing": record.total - done, "succeeded": p.succeeded,
                      "errored": p.failed, "canceled": 0, "expired": 0}
        status = "ended" if p.ended else (
            "canceling" if record.cancelled_at is not None else "in_progress")
        return {
            "id": record.id, "type": "message_batch", "processing_status": status,
            "request_counts": counts, "ended_at": rfc3339(p.stamp) if p.ended else None,
            "created_at": rfc3339(record.created_at),
            "expires_at": rfc3339(record.created_at + DAY_S), "archived_at": None,
            "cancel_initiated_at": rfc3339(record.cancelled_at),
            "results_url": f"{base}/v1/messages/batches/{record.id}/results" if p.ended else None,
        }

    async def final_counts(self, record: BatchRecord) -> dict[str, int]:
        """Counted once from the results when the batch has ended, then kept in the record."""
        if record.counts is None:
            entries = await self.batches.statuses(record)
            counts = dict.fromkeys(COUNT_KEYS, 0)
            for n in range(record.total):
                counts[outcome_of(entries.get(n), record.cancelled_at is not None)] += 1
            record.counts = counts
            if record.id not in self.batches.live:
                await self.batches.store.update(record, "counts")
        return record.counts

    def results(self, record: BatchRecord) -> AsyncIterator[bytes]:
        """One JSON line per ``custom_id``, in request order, in chunks."""
        cancelled = record.cancelled_at is not None

        def line(n: int, cid: str, entry: dict[str, Any] | None) -> bytes:
            kind = outcome_of(entry, cancelled)
            field = {"succeeded": "message", "errored": "error"}.get(kind) if entry is not None else None
            tail = f',"{field}":{body_json(entry)}' if field and entry is not None else ""
            return f'{{"custom_id":{json.dumps(cid)},"result":{{"type":"{kind}"{tail}}}}}\n'.encode()

        return self.batches.lines_out(record, line)


class MessageBatchEndpoint(Endpoint):
    metered = True
    surface = ANTHROPIC

    def __init__(self, v1: V1, batches: MessageBatches) -> None:
        super().__init__(v1)
        self.batches = batches

    @staticmethod
    def base(scope: Scope) -> str:
        """Where the client reached us: ``results_url`` points back there."""
        return str(Request(scope).base_url).rstrip("/")

    async def record(self, scope: Scope, identity: str | None) -> BatchRecord:
        batch_id = scope["path_params"]["batch_id"]
        record = await self.batches.batches.get(batch_id, identity, "anthropic")
        if record is None:
            missing = f"No such message batch: {batch_id!r}; GET /v1/messages/batches lists yours"
            raise HttpError(404, RpcError(Code.NOT_FOUND, missing))
        return record

    async def reply(self, send: Send, scope: Scope, record: BatchRecord,
                    headers: list[tuple[bytes, bytes]]) -> None:
        await send_json(send, 200, await self.batches.wire(record, self.base(scope)), headers)


class CreateMessageBatch(MessageBatchEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        requests = parse_requests(await self.v1.read_json(scope, receive))
        record = BatchRecord(new_batch_id("msgbatch_"), identity, MESSAGES, "", "24h", now(),
                             custom_ids=[cid for cid, _ in requests], kind="anthropic")
        bodies = [params for _, params in requests]
        # refused (a quota, say): nothing is kept
        await self.batches.batches.open(record, bodies, json.dumps(bodies, separators=(",", ":")).encode())
        await self.reply(send, scope, record, headers)


class GetMessageBatch(MessageBatchEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        await self.reply(send, scope, await self.record(scope, identity), headers)


class ListMessageBatches(MessageBatchEndpoint):
    """Newest first; ``after_id`` pages to older batches, ``before_id`` to newer ones."""

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        query = Request(scope).query_params
        limit = page_limit(query, 1000)
        before, after = query.get("before_id"), query.get("after_id")
        if before and after:
            raise bad("give before_id or after_id, not both")
        page, more = await self.batches.batches.mine(identity, "anthropic", limit, after, before)
        base = self.base(scope)
        data = [await self.batches.wire(r, base) for r in page]
        await send_json(send, 200, {"data": data, "has_more": more,
                                    "first_id": data[0]["id"] if data else None,
                                    "last_id": data[-1]["id"] if data else None}, headers)


class CancelMessageBatch(MessageBatchEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        record = await self.record(scope, identity)
        if (await self.batches.batches.progress(record)).ended and record.cancelled_at is None:
            raise bad(f"message batch {record.id} has ended; only a running batch can be canceled")
        await self.batches.batches.cancel(record)
        await self.reply(send, scope, record, headers)


class MessageBatchResults(MessageBatchEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        record = await self.record(scope, identity)
        if not (await self.batches.batches.progress(record)).ended:
            raise bad(f"message batch {record.id} is still processing; its results come once "
                      "it has ended")
        await send_chunks(send, b"application/x-jsonl", self.batches.results(record), headers)


class DeleteMessageBatch(MessageBatchEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        record = await self.record(scope, identity)
        if not (await self.batches.batches.progress(record)).ended:
            raise bad(f"message batch {record.id} is still processing; cancel it and delete it "
                      "once it has ended")
        await self.batches.batches.delete(record)
        await send_json(send, 200, {"id": record.id, "type": "message_batch_deleted"}, headers)
