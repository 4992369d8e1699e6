"""The request log: one record per call, whatever ended it, searchable by the operator.

The gateway hands each call's end to ``RequestLog.ended`` (``Gateway._finish``): it takes the
wall time, the HTTP request's id and the call's scalars, puts them on a ``RecordSink`` and
returns; nothing is built or written on the call's path. The sink's writer makes the rows on its
worker thread (the route and model asked and served, the error, the attempts, the tokens
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

from multiplexer.core.errors import RpcError
from multiplexer.core.json_codec import loads
from multiplexer.money.prices import tokens_of, usage_of
from multiplexer.records.context import REQUEST_ID
from multiplexer.records.redact import redacted_text, storable
from multiplexer.records.request_store import LISTED, STEP, PgRequestStore, Query, RequestStore
from multiplexer.records.settings import RequestLogConfig
from multiplexer.records.sink import RecordSink

log = logging.getLogger(__name__)

MAX_USAGE_JSON = 256 * 1024  # a result only its JSON holds is kept for its usage up to this size
# what ``ended`` queues: the call's scalars (``Ended`` below), never its params or its answer
# unless ``log.bodies`` keeps them, so a full queue holds small tuples
Ended = tuple[Any, ...]


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

    def reconfigure(self, config: RequestLogConfig) -> None:
        """A config reload's ``log:`` (``enabled`` waits for a restart): bodies from the next
        call's end, the queue's size, batch and interval from the writer's next look, the limits
        from the next prune (its interval once the current one has passed)."""
        self.config = config
        self.sink.capacity, self.sink.batch, self.sink.interval_s = (
            config.queue, config.batch, config.flush_interval_s)

    # -- the call's path -------------------------------------------------------------
    def ended(self, plan: Any, outcome: Any, answer: Any, lane: str | None, shared: str | None,
              seconds: float) -> None:
        """A call ended (``Gateway._finish``): its scalars queued, never waited for. What is read
        here is attributes and two dict lookups; the row is made on the writer."""
        call, item, error = plan.call, plan.item, answer.error
        params = call.params
        asked = params.get("model") if type(params) is dict else None
        if item is not None:
            options = item.options
            served = item.params.get("model") if type(item.params) is dict else None
            mode, share = options.get("mode"), options.get("upstream_share")
        else:
            served = mode = share = None
        usage: Any = None
        if error is None:
            result = outcome.built()
            if type(result) is dict:
                usage = usage_of(result)
            elif result is None and outcome.result_json is not None \
                    and len(outcome.result_json) <= MAX_USAGE_JSON:
                usage = outcome.result_json  # read on the writer
        attempts = plan.attempts
        bodies = None
        if self.config.bodies:
            bodies = (params, answer.built() if error is None else None, answer.result_json)
        batch = call.batch_id
        if batch is None and call.method == "jobs.submit" and error is None:
            built = answer.built()
            batch = built.get("job_id") if type(built) is dict else None
        self.sink.put((
            self.wall(), REQUEST_ID.get(), call.identity, call.face, call.method, plan.label, asked,
            served, mode, share, error, answer.cost_pico, answer.saved_pico,
            None if attempts is None else attempts.tried, None if attempts is None else attempts.number,
            None if attempts is None else attempts.group, None if plan.error is None else plan.error.code,
            plan.handler is not None, plan.auto, plan.deadline - plan.started, plan.first_chunk_s, batch,
            usage, lane, shared, seconds, bodies))

    # -- the writer ------------------------------------------------------------------
    def _open(self) -> RequestStore:
        path, url, schema = self._store_args
        return PgRequestStore(url, schema) if url else RequestStore(path)

    def _write(self, batch: Sequence[Ended]) -> None:
        if self._writer is None:
            self._writer = self._open()
        self._writer.add([self.line_row(e) if type(e) is BatchLine else self.row(e) for e in batch])

    # -- a batch job's lines ---------------------------------------------------------
    def on_event(self, event: str, data: dict[str, Any]) -> None:
        """A gateway listener: a batch job's lines that a provider ran outside the gateway's
        lanes (its batch API, or its synchronous endpoint for a job), one record each, queued
        like a call's end. ``Money.on_event`` runs before this one and leaves each successful
        line's cost in ``costs``."""
        if event != "batch_results":
            return
        at = self.wall()
        job_id, source = data.get("job_id"), data.get("source")
        batch_id, face = _batch_of(job_id, source)
        mode = "batch" if data.get("batch") else "sync"
        created = data.get("created")
        seconds = max(at - created, 0.0) if isinstance(created, float | int) else 0.0
        costs = iter(data.get("costs") or ())
        for method, route, model, usage, error in data.get("ended") or ():
            cost = next(costs, None) if error is None else None
            self.sink.put(BatchLine((at, data.get("identity"), face, method, route, model, mode,
                                     usage, error, cost, batch_id, job_id, data.get("provider"),
                                     seconds)))

    def line_row(self, line: BatchLine) -> tuple[Any, ...]:
        """A batch line's row, built on the writer's thread."""
        (at, key, face, method, route, model, mode, usage, error, cost_pico, batch_id, job_id,
         provider, seconds) = line
        message = code = None
        if isinstance(error, dict):  # as the job's results keep it (``RpcError.to_dict``)
            failed = RpcError.from_dict(error)
            code, message = failed.code, _message(failed)
        tokens = _tokens(usage)
        cost = _nano(cost_pico)
        latency_ms = round(seconds * 1000, 3)
        path = {"admission": {"method": (method or "")[:200], "route": route, "mode": mode},
                "batch": {"mode": mode, "job": job_id, "provider": provider},
                "attempts": [{"route": route, "outcome": "ok" if error is None else f"error {code}"}],
                "cost": {"cost_nano_usd": cost, "saved_nano_usd": 0},
                "timeline": [{"at_ms": 0.0, "event": "submitted"},
                             {"at_ms": latency_ms, "event": "answered" if error is None else "failed"}]}
        return (at, None, key, self.team_of(key), face, storable((method or route or "")[:200]), route,
                _text(model), _text(model), "ok" if error is None else "error", code,
                None if message is None else message[:2000], 1, 0, batch_id, mode, None,
                None if tokens is None else tokens.input, None if tokens is None else tokens.output,
                None if tokens is None else tokens.cache_read, cost, 0, latency_ms, None,
                orjson.dumps(path).decode(), None, None)

    def row(self, ended: Ended) -> tuple[Any, ...]:
        """A record's row (``request_store.COLUMNS``), built on the writer's thread."""
        (at, rid, key, face, method, label, asked, served, mode, share, error, cost_pico, saved_pico,
         tried, number, group, refused, gateway_method, auto, deadline, first, batch, usage, lane,
         shared, seconds, bodies) = ended
        method, label, group = storable(method), storable(label), storable(group)
        message = None if error is None else _message(error)
        tried = list(tried or ())
        # its own upstream attempts: none when refused before a lane took it, or when it shared
        # another call's (joined in flight, answered from the cache)
        ran = number if number is not None else int(lane is not None and shared is None)
        tokens = _tokens(usage)
        cost = _nano(cost_pico)
        saved = _nano(saved_pico) or 0
        latency_ms = round(seconds * 1000, 3)
        first_ms = None if first is None else round(first * 1000, 3)
        attempts = [{"route": r, "outcome": why} for r, why in tried]
        if lane is not None and shared is None:  # its last attempt (a lane took it)
            attempts.append({"route": label, "outcome": "ok" if error is None else f"error {error.code}"})
        timeline = [{"at_ms": 0.0, "event": "admitted"}]
        if first_ms is not None:
            timeline.append({"at_ms": first_ms, "event": "first chunk"})
        timeline.append({"at_ms": latency_ms, "event": "answered" if error is None else "failed"})
        path = {  # what GET /admin/requests/{id} draws
            "admission": {"method": method[:200], "route": label, "mode": mode, "auto": bool(auto),
                          "deadline_ms": round(deadline * 1000, 3) if math.isfinite(deadline) else None,
                          "gateway_method": gateway_method, "group": group or None, "refused": refused},
            "lane": lane, "batch": {"mode": mode, "share": share if isinstance(share, float) else None,
                                    "shared": shared},
            "attempts": attempts, "cost": {"cost_nano_usd": cost, "saved_nano_usd": saved},
            "timeline": timeline}
        texts: tuple[str | None, str | None] = (None, None)
        if bodies is not None:
            limit = self.config.max_body_bytes
            sent, built, encoded = bodies
            reply: Any = {"code": error.code, "message": message, "data": error.data} if error is not None \
                else (built if built is not None else encoded)
            texts = (redacted_text(sent, limit), redacted_text(reply, limit))
        return (at, None if rid is None else rid.decode("ascii", "replace"), key, self.team_of(key),
                face or "rpc", method[:200], label, _text(asked), _text(served),
                "ok" if error is None else "error", None if error is None else error.code,
                None if message is None else message[:2000], ran, len(tried),
                None if batch is None else str(batch), mode, shared,
                None if tokens is None else tokens.input, None if tokens is None else tokens.output,
                None if tokens is None else tokens.cache_read, cost, saved, latency_ms, first_ms,
                orjson.dumps(path).decode(), *texts)  # its numbers are finite: no check

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
        """A page of records, newest first, and the cursor of the next page (None: the last).
        A page whose filters the store read ``SCAN`` rows for without filling it says how far
        back it searched (``searched_to``, the time of the last row read); its cursor goes on
        from there."""
        await self._catch_up()
        store = await self._read()
        rows, stopped = await anyio.to_thread.run_sync(store.page, q)
        out = [dict(zip(LISTED, r, strict=True)) for r in rows]
        last = stopped  # (at, id): where the next page starts (``parse_cursor`` reads it back)
        if last is None and len(rows) == q.limit:
            last = (rows[-1][1], rows[-1][0])
        cursor = None if last is None else f"{last[0]!r}:{last[1]}"
        return {"requests": out, "next_cursor": cursor,
                "searched_to": None if stopped is None else stopped[0]}

    async def get(self, row_id: int) -> dict[str, Any] | None:
        await self._catch_up()
        store = await self._read()
        row = await anyio.to_thread.run_sync(store.get, row_id)
        if row is not None and isinstance(row.get("path"), str):
            row["path"] = loads(row["path"])
        return row


def _tokens(usage: Any) -> Any:
    """The usage's tokens in one shape; ``usage`` as ``ended`` kept it (a result's JSON: read here)."""
    if isinstance(usage, bytes):
        try:
            result = loads(usage)
        except ValueError:
            return None
        usage = usage_of(result) if isinstance(result, dict) else None
    return tokens_of(usage)


def _message(error: RpcError) -> str:
    """An error's text as a record keeps it: its message, and its detail when it has one."""
    data = error.data if isinstance(error.data, dict) else {}
    detail = data.get("detail")
    return storable(error.message if not isinstance(detail, str) else f"{error.message}: {detail}")


def _nano(pico: int | None) -> int | None:
    """Picodollars as the table's nanodollars, rounded up (a cost never shows as less)."""
    return None if pico is None else -(-pico // 1000)


V1_SOURCE = "v1:"  # a /v1 batch's job: its source names the batch (``batch_source``)


class BatchLine(tuple[Any, ...]):
    """A batch job's line as ``on_event`` queues it (``line_row`` reads it)."""

    __slots__ = ()


def batch_source(batch_id: str) -> str:
    """The job source of a ``/v1`` batch's (or a message batch's) lines sent to a provider's batch
    API: its records then carry the batch's id, which its caller knows, not the job's."""
    return V1_SOURCE + batch_id


def _batch_of(job_id: Any, source: Any) -> tuple[str | None, str]:
    """The batch id a job's line records carry, and the face it came in on."""
    if isinstance(source, str) and source.startswith(V1_SOURCE):
        return source[len(V1_SOURCE):], "v1"
    return (str(job_id) if job_id is not None else None), "mcp" if source == "task" else "jobs"


def _text(value: Any) -> str | None:
    return storable(value[:200]) if isinstance(value, str) else None



def parse_cursor(raw: str) -> tuple[float, int]:
    """A ``next_cursor`` as ``list`` wrote it (``AT:ID``); ValueError when it is not one."""
    at, _, row_id = raw.rpartition(":")
    value = (float(at), int(row_id))
    if not math.isfinite(value[0]):
        raise ValueError(raw)
    return value
