"""The request log: one record per call, whatever ended it, searchable by the operator.

The gateway hands each call's end to ``RequestLog.ended`` (``Gateway._finish``): it takes the
wall time and the HTTP request's id, puts the call's finished objects on a ``RecordSink`` and
returns; nothing is read, built or written on the call's path. The sink's writer makes the rows
on its worker thread (the route and model asked and served, the error, the attempts, the tokens
from the provider's usage, the cost, the path the call took as JSON, the bodies when
``log.bodies`` is on, through the redaction hook) and adds them a batch at a time to the table
in the job store's database (``request_store.py``). Old rows are deleted in steps of a few
thousand every ``log.prune_interval_s``, by age (``log.retention_days``) and by count
(``log.max_rows``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import orjson
from prometheus_client import CollectorRegistry

from multiplexer.core.json_codec import loads
from multiplexer.money.prices import tokens_of, usage_of
from multiplexer.records.context import REQUEST_ID
from multiplexer.records.redact import redacted_text
from multiplexer.records.request_store import LISTED, STEP, PgRequestStore, Query, RequestStore
from multiplexer.records.settings import RequestLogConfig
from multiplexer.records.sink import RecordSink

log = logging.getLogger(__name__)

MAX_USAGE_JSON = 256 * 1024  # a result only its JSON holds is read for its usage up to this size
# what ``ended`` queues: (wall time, request id, plan, provider outcome, answer, lane, shared, seconds)
Ended = tuple[float, bytes | None, Any, Any, Any, str | None, str | None, float]


class RequestLog:
    def __init__(self, config: RequestLogConfig, *, store_path: str | Path, store_url: str | None,
                 store_schema: str, registry: CollectorRegistry | None, wall: Callable[[], float],
                 team_of: Callable[[str | None], str | None]) -> None:
        self.config = config
        self.wall = wall
        self.team_of = team_of
        self._store_args = (store_path, store_url, store_schema)
        self._writer: RequestStore | None = None
        self._reader: RequestStore | None = None
        self.sink: RecordSink[Ended] = RecordSink(
            "requests", self._write, registry=registry, capacity=config.queue, batch=config.batch,
            interval_s=config.flush_interval_s)

    # -- the call's path -------------------------------------------------------------
    def ended(self, plan: Any, outcome: Any, answer: Any, lane: str | None, shared: str | None,
              seconds: float) -> None:
        """A call ended (``Gateway._finish``): queued as it is, never waited for."""
        self.sink.put((self.wall(), REQUEST_ID.get(), plan, outcome, answer, lane, shared, seconds))

    # -- the writer ------------------------------------------------------------------
    def _open(self) -> RequestStore:
        path, url, schema = self._store_args
        return PgRequestStore(url, schema) if url else RequestStore(path)

    def _write(self, batch: Sequence[Ended]) -> None:
        if self._writer is None:
            self._writer = self._open()
        self._writer.add([self.row(e) for e in batch])

    def row(self, ended: Ended) -> tuple[Any, ...]:
        """A record's row (``request_store.COLUMNS``), built on the writer's thread."""
        at, rid, plan, outcome, answer, lane, shared, seconds = ended
        call = plan.call
        item = plan.item
        asked = call.params.get("model") if isinstance(call.params, dict) else None
        served = item.params.get("model") if item is not None and isinstance(item.params, dict) else None
        error = answer.error
        message = None
        if error is not None:
            data = error.data if isinstance(error.data, dict) else {}
            detail = data.get("detail")
            message = error.message if not isinstance(detail, str) else f"{error.message}: {detail}"
        attempts = plan.attempts
        tried: list[tuple[str, str]] = list(attempts.tried) if attempts is not None else []
        # its own upstream attempts: none when refused before a lane took it, or when it shared
        # another call's (joined in flight, answered from the cache)
        ran = attempts.number if attempts is not None else int(lane is not None and shared is None)
        mode = item.options.get("mode") if item is not None else None
        tokens = self._tokens(outcome) if error is None else None
        cost = None if answer.cost_pico is None else -(-answer.cost_pico // 1000)
        saved = -(-answer.saved_pico // 1000) if answer.saved_pico else 0
        first = getattr(plan, "first_chunk_s", None)
        latency_ms = round(seconds * 1000, 3)
        first_ms = None if first is None else round(first * 1000, 3)
        path = self._path(plan, answer, lane, shared, tried, mode, latency_ms, first_ms, cost, saved)
        bodies: tuple[str | None, str | None] = (None, None)
        if self.config.bodies:
            limit = self.config.max_body_bytes
            reply: Any = answer.built() if error is None else {"code": error.code, "message": message,
                                                                "data": error.data}
            if reply is None and error is None:
                reply = answer.result_json
            bodies = (redacted_text(call.params, limit), redacted_text(reply, limit))
        key = call.identity
        return (at, None if rid is None else rid.decode("ascii", "replace"), key, self.team_of(key),
                call.face or "rpc", call.method[:200], plan.label, _text(asked), _text(served),
                "ok" if error is None else "error", None if error is None else error.code,
                None if message is None else message[:2000], ran, len(tried),
                _batch_of(call, answer), mode, shared,
                None if tokens is None else tokens.input, None if tokens is None else tokens.output,
                None if tokens is None else tokens.cache_read, cost, saved, latency_ms, first_ms,
                orjson.dumps(path).decode(), *bodies)  # its numbers are finite: no check

    @staticmethod
    def _tokens(outcome: Any) -> Any:
        result = outcome.built()
        if result is None and outcome.result_json is not None and len(outcome.result_json) <= MAX_USAGE_JSON:
            try:
                result = loads(outcome.result_json)
            except ValueError:
                return None
        return tokens_of(usage_of(result)) if isinstance(result, dict) else None

    @staticmethod
    def _path(plan: Any, answer: Any, lane: str | None, shared: str | None, tried: list[tuple[str, str]],
              mode: Any, latency_ms: float, first_ms: float | None, cost: int | None,
              saved: int) -> dict[str, Any]:
        """What ``GET /admin/requests/{id}`` draws: admission, lane, batch, attempts, cost, and
        the timeline (ms from admission)."""
        call, item = plan.call, plan.item
        deadline = plan.deadline - plan.started
        admission: dict[str, Any] = {
            "method": call.method[:200], "route": plan.label, "mode": mode, "auto": bool(plan.auto),
            "deadline_ms": round(deadline * 1000, 3) if math.isfinite(deadline) else None,
            "gateway_method": plan.handler is not None, "group": getattr(plan.attempts, "group", "") or None,
            "refused": plan.error.code if plan.error is not None else None}
        share = item.options.get("upstream_share") if item is not None else None
        batch = {"mode": mode, "share": share if isinstance(share, float) else None,
                 "shared": shared}
        attempts = [{"route": r, "outcome": why} for r, why in tried]
        if lane is not None and shared is None:  # its last attempt (a lane took it)
            attempts.append({"route": plan.label, "outcome": "ok" if answer.error is None
                             else f"error {answer.error.code}"})
        timeline = [{"at_ms": 0.0, "event": "admitted"}]
        if first_ms is not None:
            timeline.append({"at_ms": first_ms, "event": "first chunk"})
        timeline.append({"at_ms": latency_ms, "event": "answered" if answer.error is None else "failed"})
        return {"admission": admission, "lane": lane, "batch": batch, "attempts": attempts,
                "cost": {"cost_nano_usd": cost, "saved_nano_usd": saved}, "timeline": timeline}

    # -- lifetime ----------------------------------------------------------------------
    async def run(self) -> None:
        """The writer and the pruner, for the gateway's lifetime (in its task group)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sink.run)
            while True:
                await anyio.sleep(self.config.prune_interval_s)
                await self.prune()

    async def prune(self) -> int:
        """Old rows deleted, a step at a time; how many went."""
        days, rows = self.config.retention_days, self.config.max_rows
        if (days is None and rows is None) or self._writer is None:
            return 0
        store = self._writer
        before = None if days is None else self.wall() - days * 86400
        gone = 0
        try:
            while True:
                n = await anyio.to_thread.run_sync(store.prune_step, before, rows)
                gone += n
                if n < STEP:
                    return gone
        except Exception:
            log.exception("old request records could not be deleted")
            return gone

    async def aclose(self) -> None:
        await self.sink.aclose()
        with anyio.CancelScope(shield=True):
            for store in (self._writer, self._reader):
                if store is not None:
                    await anyio.to_thread.run_sync(store.close)
            self._writer = self._reader = None

    # -- reading ---------------------------------------------------------------------
    async def _catch_up(self) -> None:
        """What this replica has not written yet shows too, when that is one insert; a longer
        queue is the writer's (a read never waits for thousands of rows)."""
        if 0 < len(self.sink) <= self.config.batch:
            await self.sink.flush()

    async def _read(self) -> RequestStore:
        if self._reader is None:
            self._reader = await anyio.to_thread.run_sync(self._open)
        return self._reader

    async def page(self, q: Query) -> dict[str, Any]:
        """A page of records, newest first, and the cursor of the next page (None: the last)."""
        await self._catch_up()
        store = await self._read()
        rows = await anyio.to_thread.run_sync(store.page, q)
        out = [dict(zip(LISTED, r, strict=True)) for r in rows]
        cursor = f"{rows[-1][1]!r}:{rows[-1][0]}" if len(rows) == q.limit else None
        return {"requests": out, "next_cursor": cursor}

    async def get(self, row_id: int) -> dict[str, Any] | None:
        await self._catch_up()
        store = await self._read()
        row = await anyio.to_thread.run_sync(store.get, row_id)
        if row is not None and isinstance(row.get("path"), str):
            row["path"] = loads(row["path"])
        return row


def _batch_of(call: Any, answer: Any) -> str | None:
    """The client's batch a call is a line of, or the job a ``jobs.submit`` made."""
    if call.batch_id is not None:
        return str(call.batch_id)
    if call.method == "jobs.submit" and answer.error is None:
        result = answer.built()
        job = result.get("job_id") if isinstance(result, dict) else None
        return job if isinstance(job, str) else None
    return None


def _text(value: Any) -> str | None:
    return value[:200] if isinstance(value, str) else None


def parse_cursor(raw: str) -> tuple[float, int]:
    """A ``next_cursor`` as ``list`` wrote it (``AT:ID``); ValueError when it is not one."""
    at, _, row_id = raw.rpartition(":")
    value = (float(at), int(row_id))
    if not math.isfinite(value[0]):
        raise ValueError(raw)
    return value
