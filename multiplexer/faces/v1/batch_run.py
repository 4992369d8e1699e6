"""OpenAI's Batch API (and, through ``open``, Anthropic's Message Batches) on the gateway's
job system.

A batch's input file holds one request per line. Lines whose route is on a provider with a
batch API become one job (submitted to the job room through ``faces/jobs_port.py``, not as a
``jobs.submit`` call through the gateway: the batch's request is its key's one charge, the job
adds only its lines' batch charge; the provider's own batch API underneath); the other
lines (local models, providers without one) run through their lanes on the job engine's runner
(``multiplexer/jobs/line_runner.py``: pages, the hold one gateway has on a batch, resuming),
which this face tells what a line is as a call and what an outcome is as a result line. Output
and error files are built on request, one line per ``custom_id``, in OpenAI's format.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from multiplexer.core.cache_affinity import call_key, prefix_order
from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.core.provider import BatchCapable
from multiplexer.faces.jobs_port import JobPort, port_of
from multiplexer.faces.v1.common import V1, HttpError, Surface, http_error
from multiplexer.faces.v1.requests import EMBEDDINGS, MESSAGES, OPERATIONS, Shape, operation_for, plan
from multiplexer.faces.v1.store import BatchRecord, V1Store, new_batch_id, now
from multiplexer.gateway.admission import call_most
from multiplexer.jobs.line_runner import LineRunner, Refused, Row
from multiplexer.records.requests import batch_source

log = logging.getLogger(__name__)
ENDED = ("completed", "failed", "cancelled")
CHUNK = 256  # results file lines built (on a worker thread) and sent at once
MAX_LINES = 50_000
PIECE = 1 << 16  # characters split into lines at once
PAGE = 10_000  # a job's results read at once
T = TypeVar("T")


def split_lines(text: str, piece: int = PIECE) -> Iterator[str]:
    """``text.splitlines()``, a piece at a time: over a 50,000-line file the one call holds the
    GIL 5-16 ms, all that time the event loop's thread waits for it. Each piece ends just after
    a newline, where ``splitlines`` splits anyway (after the whole of a CR LF), so the lines
    are the same."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + piece)
        end = len(text) if end < 0 else end + 1
        yield from text[start:end].splitlines()
        start = end


def parse_lines(content: bytes, endpoint: str) -> tuple[list[tuple[str, dict[str, Any]]],
                                                        list[dict[str, Any]]]:
    """(custom_id, body) per line, or the validation errors that fail the whole batch."""
    lines: list[tuple[str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def bad(n: int, code: str, message: str) -> None:
        errors.append({"code": code, "message": message, "param": None, "line": n})

    try:
        text = content.decode()
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the file is not UTF-8 text", "param": None,
                     "line": None}]
    for n, raw in enumerate(split_lines(text, PIECE), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:
            bad(n, "invalid_json_line", "this line is not valid JSON")
            continue
        if not isinstance(row, dict):
            bad(n, "invalid_request", "each line must be a JSON object")
            continue
        cid, body = row.get("custom_id"), row.get("body")
        if not isinstance(cid, str) or not cid:
            bad(n, "missing_required_parameter", "custom_id must be a non-empty string")
        elif cid in seen:
            bad(n, "duplicate_custom_id", f"custom_id {cid!r} appears more than once")
        elif row.get("url") != endpoint:
            bad(n, "mismatched_url", f"url must be the batch's endpoint {endpoint}")
        elif row.get("method", "POST") != "POST":
            bad(n, "invalid_method", "method must be POST")
        elif not isinstance(body, dict):
            bad(n, "invalid_request", "body must be a JSON object")
        else:
            seen.add(cid)
            lines.append((cid, body))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the file has no requests", "param": None,
                       "line": None})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"at most {MAX_LINES} requests",
                       "param": None, "line": None})
    return lines, errors


def error_entry(surface: Surface, error: RpcError) -> dict[str, Any]:
    e = http_error(error, surface)
    return {"status": e.status, "body": surface.error_body(e.status, e.error, e.param, e.code)}


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a batch stands, whatever API shows it: counts, not results (a poll must not page
    through 50,000 answers)."""

    status: str  # in_progress, cancelling, completed, cancelled, failed (its input was invalid)
    succeeded: int
    failed: int
    ended: bool
    stamp: int  # when ``status`` was first seen


class Batches:
    def __init__(self, v1: V1, store: V1Store, surfaces: dict[str, Surface]) -> None:
        self.v1 = v1
        self.gateway = v1.gateway
        self.store = store
        self.surfaces = surfaces  # endpoint -> error dialect for its lines
        self.runner = LineRunner(self.gateway, store, self._line, self._answer, self._bodies,
                                 ended=self._let_go)
        self.holds: dict[str, Any] = {}  # a batch's lane lines' budget reservation, while they run

    # -- creation ----------------------------------------------------------------------------
    async def create(self, identity: str | None, body: dict[str, Any]) -> BatchRecord:
        endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
        if not isinstance(endpoint, str) or endpoint not in OPERATIONS:
            raise HttpError(400, invalid_params(f"endpoint must be one of {sorted(OPERATIONS)}"),
                            param="endpoint")
        if window != "24h":
            raise HttpError(400, invalid_params("completion_window must be '24h'"),
                            param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise HttpError(400, invalid_params("metadata must be an object"), param="metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or (record_file := await self.store.file(file_id, identity)) is None:
            missing = f"No such file: {file_id!r}; GET /v1/files lists yours"
            raise HttpError(404, RpcError(Code.NOT_FOUND, missing), param="input_file_id")
        content = await self.store.content(record_file)
        lines, errors = await anyio.to_thread.run_sync(parse_lines, content, endpoint)
        record = BatchRecord(new_batch_id("batch_"), identity, endpoint, file_id, window, now(), metadata,
                             [cid for cid, _ in lines])
        if errors:
            record.errors = errors[:100]
            await self.store.create_batch(record)
            return record
        return await self.open(record, [body for _, body in lines])

    async def open(self, record: BatchRecord, bodies: list[dict[str, Any]],
                   requests: bytes | None = None) -> BatchRecord:
        """Send a new batch's lines on their way (``bodies`` in ``record.custom_ids`` order):
        those for a provider with a batch API as one job, the rest through the lanes; its
        record is written once, with ``requests`` (a message batch's, kept for its lane lines)."""
        endpoint, identity = record.endpoint, record.owner
        # 50,000 lines planned off the event loop (planning reads the config, changes nothing)
        early, job_calls = await anyio.to_thread.run_sync(self._sort_lines, record, bodies)
        try:
            await self._hold_lanes(record, bodies)  # refused whole, before anything is sent
            if job_calls:  # every line of a file is for one endpoint, so one operation for the job
                try:  # the job charges its lines to the key's batch calls and budget, once
                    submitted = await port_of(self.gateway, "jobs.submit").submit(
                        identity, job_calls, operation_for(endpoint, None),
                        source=batch_source(record.id))  # its lines' records carry the batch's id
                except RpcError as e:
                    raise http_error(e, self.surfaces[endpoint]) from None
                record.job_id = submitted.job_id
            # live before it is stored: no resume pass starts a second runner
            scope = self.runner.reserve(record) if record.lane_lines else None
            try:
                await self.store.create_batch(record, early, requests)
            except BaseException:
                self.live.pop(record.id, None)
                raise
        except BaseException:
            self._let_go(record)
            raise
        if scope is not None:
            self.runner.start(record, bodies, scope)
        return record

    async def _hold_lanes(self, record: BatchRecord, bodies: list[dict[str, Any]]) -> None:
        """The lane lines' budget, reserved whole (each line's most on the route it would take),
        or the batch refused naming the shortfall; each line then draws its own from it."""
        money = self.gateway.money
        if not record.lane_lines or money is None or not money.budgets.applies(record.owner):
            return
        most = money.budgets.most_of
        total = 0
        for n in record.lane_lines:
            try:
                call = self._line(record, bodies[n])[0]
            except Refused:
                continue
            total += call_most(self.gateway, call, most) or 0
        held = await money.budgets.hold(record.owner, total)
        if isinstance(held, RpcError):
            raise http_error(held, self.surfaces[record.endpoint])
        if held is not None:
            self.holds[record.id] = held

    def _let_go(self, record: BatchRecord) -> None:
        """What the lane lines' budget still holds, given back: the batch ended here, or was never
        made (a line that did not run costs nothing)."""
        held = self.holds.pop(record.id, None)
        money = self.gateway.money
        if held is not None and money is not None:
            money.budgets.settle(held, 0)

    def _sort_lines(self, record: BatchRecord, bodies: list[dict[str, Any]],
                    ) -> tuple[list[Row], list[dict[str, Any]]]:
        """Each line to the job (its calls returned), the lanes, or refused at once (its result
        returned), noted in ``record``."""
        endpoint = record.endpoint
        job_calls = []
        early: list[Row] = []  # lines refused at once: their results
        for n, line in enumerate(bodies):
            try:
                name, params, shape = plan(self.v1, endpoint, line)
            except HttpError as e:
                early.append((n, record.custom_ids[n], e.status, self.surfaces[endpoint].error_body(
                    e.status, e.error, e.param, e.code)))
                continue
            # a line translated to another API (Gemini) goes through its route, which answers in
            # the caller's shape (a mode: batch route still takes it to the vendor's batch API)
            if self._batchable(name) and shape is None:
                job_calls.append({"method": name, "params": params})
                record.job_lines.append(n)
            else:
                record.lane_lines.append(n)
        if endpoint != EMBEDDINGS:  # lines that share a prompt prefix go consecutively
            order = prefix_order([call_key(c["params"], "prefix") for c in job_calls])
            job_calls = [job_calls[i] for i in order]
            record.job_lines = [record.job_lines[i] for i in order]
            order = prefix_order([call_key(bodies[n], "prefix") for n in record.lane_lines])
            record.lane_lines = [record.lane_lines[i] for i in order]
        return early, job_calls

    def _batchable(self, name: str) -> bool:
        """Whether the line's route (for a model group, one of its routes: the job picks which by
        the group's strategy) is on a provider with a batch API."""
        gw = self.gateway
        resolved = gw.resolve(name)
        names = gw.config.groups[resolved.group].routes if resolved.group is not None else [resolved.name]
        return any(isinstance(gw.providers[gw.config.routes[n].provider], BatchCapable) for n in names)

    # -- lane lines: run by the job engine's runner, in this API's shapes ---------------------
    def _line(self, record: BatchRecord, body: dict[str, Any]) -> tuple[Call, Shape | None]:
        """A lane line's call, and the shaper of its result (``LineRunner``'s ``Plan``)."""
        try:
            name, params, shape = plan(self.v1, record.endpoint, body)
        except HttpError as e:
            raise Refused(e.error) from None
        return Call(name, params, identity=record.owner, operation=operation_for(record.endpoint, shape),
                    budget=self.holds.get(record.id), batch_id=record.id), shape

    def _answer(self, record: BatchRecord, outcome: Outcome, shape: Shape | None) -> tuple[int, Any]:
        """A lane line's outcome as (HTTP status, body) of its API (``LineRunner``'s ``Answer``)."""
        if outcome.error is not None:
            entry = error_entry(self.surfaces[record.endpoint], outcome.error)
            return entry["status"], entry["body"]
        return 200, shape(outcome.result) if shape else outcome.result

    @property
    def live(self) -> dict[str, tuple[BatchRecord, anyio.CancelScope]]:
        """Batches whose lane lines run here."""
        return self.runner.live

    async def _run_lanes(self, record: BatchRecord, bodies: list[dict[str, Any]],
                         scope: anyio.CancelScope) -> None:
        """Run a stored batch's lane lines here and now (``LineRunner.run_lines``)."""
        await self.runner.run_lines(record, bodies, scope)

    async def resume(self) -> None:
        """Start the lane lines that no gateway runs (``LineRunner.resume``)."""
        await self.runner.resume()

    async def _bodies(self, record: BatchRecord) -> list[dict[str, Any]] | None:
        """A batch's request bodies, in line order: its kept requests (a message batch's, or
        those kept when its input file was deleted), else its input file's; None when gone."""
        raw = await self.store.requests(record.id)
        if raw is not None or record.kind == "anthropic":
            return None if raw is None else json.loads(raw)
        found = await self.store.file(record.input_file_id, record.owner)
        if found is None:
            return None
        content = await self.store.content(found)
        lines, _ = await anyio.to_thread.run_sync(parse_lines, content, record.endpoint)
        return [body for _, body in lines]

    async def keep_bodies(self, file_id: str, owner: str | None) -> None:
        """Before an input file is deleted: its batches' unfinished lane lines still need their
        bodies should the gateway restart, so they are kept beside each such batch."""
        for batch_id in await self.store.reading(owner, file_id):
            record = await self.store.batch(batch_id, owner)
            if record is not None and await self.runner.owes(record):
                bodies = await self._bodies(record)
                if bodies is not None:
                    await self.store.put_requests(
                        record.id, json.dumps(bodies, separators=(",", ":")).encode())

    # -- reading -------------------------------------------------------------------------------
    async def get(self, batch_id: str, identity: str | None,
                  kind: str = "openai") -> BatchRecord | None:
        """The batch, if ``identity`` owns it and it is of the API asking (``kind``)."""
        live = self.live.get(batch_id)
        record = live[0] if live is not None else await self.store.batch(batch_id, identity)
        return record if record is not None and record.owner == identity and (
            record.kind == kind) else None

    async def mine(self, identity: str | None, kind: str, limit: int, after: str | None = None,
                   before: str | None = None) -> tuple[list[BatchRecord], bool]:
        """A page of the key's batches of one API, newest first (a running one as it is in
        memory), and whether there are more beyond it."""
        page, more = await self.store.page(identity, kind, limit, after, before)
        return [self.live[r.id][0] if r.id in self.live else r for r in page], more

    async def purge(self, retention_s: float, at: float | None = None) -> list[str]:
        """Forget the batches that ended more than ``retention_s`` before ``at`` (default now),
        as their jobs are; their input files stay until their owner deletes them."""
        cutoff = (time.time() if at is None else at) - retention_s
        gone = []
        for record in await self.store.created_before(int(cutoff) + 1):
            if record.id in self.live:
                continue
            try:
                status = (await self.progress(record)).status
            except HttpError:
                continue  # asked again on the next sweep
            stamp = record.ended.get(status)
            if status in ENDED and stamp is not None and stamp < cutoff:
                await self.store.delete_batch(record.id)
                gone.append(record.id)
        return gone

    async def purge_forever(self, retention_s: float) -> None:
        while True:
            if self.store.exists():
                await self.purge(retention_s)
            await anyio.sleep(min(3600.0, retention_s / 4))

    async def cancel(self, record: BatchRecord) -> None:
        if record.cancelled_at is not None:
            return
        record.cancelled_at = now()
        if record.job_id is not None:
            try:
                await port_of(self.gateway, "jobs.cancel").cancel(record.job_id, record.owner)
            except RpcError as e:  # its job ended or went meanwhile: the batch is cancelled all the same
                log.info("batch %s: its job %s was not cancelled (%s)", record.id, record.job_id,
                         e.message)
        self.runner.stop(record.id)
        await self.store.update(record, "cancelled_at")

    async def delete(self, record: BatchRecord) -> None:
        """Forget an ended batch now, and its job with its results (``jobs.delete``)."""
        if record.job_id is not None:
            try:
                await port_of(self.gateway, "jobs.delete").delete(record.job_id, record.owner)
            except RpcError as e:
                if e.code != Code.NOT_FOUND:
                    log.warning("batch %s: its job %s stays until store.retention_s (%s)", record.id,
                                record.job_id, e.message)
        await self.store.delete_batch(record.id)

    async def _job(self, record: BatchRecord, method: str,
                   ask: Callable[[JobPort], Awaitable[T]]) -> T | None:
        """``ask``'s answer about the batch's job (``method``: the ``jobs.*`` it stands for); None
        once the job is gone (deleted after ``store.retention_s``): its lines then count as
        ended without results. Another error is the batch's, in its API's shape."""
        try:
            return await ask(port_of(self.gateway, method))
        except RpcError as e:
            if e.code == Code.NOT_FOUND:
                return None
            raise http_error(e, self.surfaces[record.endpoint]) from None

    async def job_entries(self, record: BatchRecord) -> dict[int, dict[str, Any]]:
        """Line -> {status, body} for every finished line of the batch's job (lines still
        running are absent, and so are those a cancel stopped); a line whose remote batch
        expired, or was cancelled upstream, says so (``expired`` / ``canceled``: true)."""
        out: dict[int, dict[str, Any]] = {}
        job_id = record.job_id
        if job_id is None:
            return out
        await self.store.load_lines(record)
        surface = self.surfaces[record.endpoint]
        cursor: int | None = 0
        while cursor is not None:
            page = await self._job(record, "jobs.results", functools.partial(
                JobPort.results, job_id=job_id, identity=record.owner, cursor=cursor, limit=PAGE))
            if page is None:
                break
            for row in page.rows:
                n = record.job_lines[row["index"]]
                if row["status"] == "succeeded":
                    out[n] = {"status": 200, "body": row["result"]}
                elif row["status"] == "failed":
                    error = RpcError.from_dict(row["error"])
                    if error.code == Code.CANCELLED and record.cancelled_at is not None:
                        continue  # never ran: the error file says the batch was cancelled
                    out[n] = error_entry(surface, error)
                    if error.code == Code.CANCELLED:
                        out[n]["canceled"] = True
                    elif (error.data or {}).get("expired"):
                        out[n]["expired"] = True
            cursor = page.next_cursor
        return out

    async def statuses(self, record: BatchRecord) -> dict[int, dict[str, Any]]:
        """Line -> {status} (and the job's ``canceled`` / ``expired`` marks) of every finished
        line, without bodies."""
        return {**await self.store.results(record.id, bodies=False), **await self.job_entries(record)}

    async def lines_out(self, record: BatchRecord,
                        line: Callable[[int, str, dict[str, Any] | None], bytes]) -> AsyncIterator[bytes]:
        """A results file, ``CHUNK`` lines at a time: ``line(n, custom_id, entry or None)`` for
        each line in order, built on a worker thread; an entry of the lines that ended outside
        the job holds its body's stored JSON text (``raw``), spliced in as it is."""
        job = await self.job_entries(record)
        cids = (await self.store.load_lines(record)).custom_ids
        for lo in range(0, len(cids), CHUNK):
            hi = min(lo + CHUNK, len(cids))
            own = await self.store.results(record.id, lo, hi)

            def build(lo: int = lo, hi: int = hi, own: dict[int, dict[str, Any]] = own) -> bytes:
                return b"".join(line(n, cids[n], own.get(n) or job.get(n)) for n in range(lo, hi))

            yield await anyio.to_thread.run_sync(build)

    async def progress(self, record: BatchRecord) -> Progress:
        """Counts and status from the record and its job's status; an end, when first seen,
        is stamped and saved."""
        if record.errors:
            status, completed, failed, ended = "failed", 0, 0, True
        else:
            lanes = await self.runner.counts(record)  # counts, not results
            completed, failed = lanes.succeeded, lanes.ended - lanes.succeeded
            job_done = True
            job_id = record.job_id
            if job_id is not None:
                job = await self._job(record, "jobs.status",
                                      lambda jobs: jobs.status(job_id, record.owner))
                if job is not None:
                    completed += job.succeeded
                    failed += job.failed
                    job_done = job.done
            ended = job_done and lanes.done
            if record.cancelled_at is not None:
                status = "cancelled" if ended else "cancelling"
            else:
                status = "completed" if ended else "in_progress"
        stamp = record.ended.get(status)
        if stamp is None:
            stamp = record.ended[status] = now()
            if status in ENDED and record.id not in self.live:
                await self.store.update(record, "ended")  # the end time stays what it first was
        return Progress(status, completed, failed, ended, stamp)

    async def wire(self, record: BatchRecord) -> dict[str, Any]:
        """The batch as OpenAI's ``batch`` object."""
        total = record.total
        p = await self.progress(record)
        status, completed, failed, ended, stamp = p.status, p.succeeded, p.failed, p.ended, p.stamp
        out: dict[str, Any] = {
            "id": record.id, "object": "batch", "endpoint": record.endpoint,
            "errors": {"object": "list", "data": record.errors} if record.errors else None,
            "input_file_id": record.input_file_id, "completion_window": record.completion_window,
            "status": status, "created_at": record.created_at,
            "in_progress_at": None if record.errors else record.created_at,
            "expires_at": record.created_at + 86_400, "finalizing_at": None,
            "completed_at": stamp if status == "completed" else None,
            "failed_at": stamp if status == "failed" else None, "expired_at": None,
            "cancelling_at": record.cancelled_at, "cancelled_at": stamp if status == "cancelled" else None,
            "output_file_id": None, "error_file_id": None,
            "request_counts": {"total": total, "completed": completed, "failed": failed},
            "metadata": record.metadata,
        }
        if ended and not record.errors:
            out["output_file_id"] = f"file-{record.id}-output" if completed else None
            out["error_file_id"] = f"file-{record.id}-error" if failed or status == "cancelled" else None
        return out

    def output(self, record: BatchRecord, errors: bool) -> AsyncIterator[bytes]:
        """The output file (``errors`` False) or the error file, one JSON line per custom_id,
        in chunks."""
        cancelled = record.cancelled_at is not None

        def line(n: int, cid: str, entry: dict[str, Any] | None) -> bytes:
            if entry is None:
                if errors and cancelled:
                    return _dumps({"id": "batch_req_" + uuid.uuid4().hex, "custom_id": cid,
                                   "response": None, "error": {
                                       "code": "batch_cancelled",
                                       "message": "the batch was cancelled before this request ran"}})
                return b""
            if (entry["status"] == 200) == errors:
                return b""
            return (f'{{"id":"batch_req_{uuid.uuid4().hex}","custom_id":{_json(cid)},"response":'
                    f'{{"status_code":{int(entry["status"])},"request_id":"req_{uuid.uuid4().hex}",'
                    f'"body":{body_json(entry)}}},"error":null}}\n').encode()

        return self.lines_out(record, line)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _dumps(row: dict[str, Any]) -> bytes:
    return _json(row).encode() + b"\n"


def body_json(entry: dict[str, Any]) -> str:
    """An entry's body as JSON text: as stored (``raw``), or encoded now."""
    raw = entry.get("raw")
    return raw if raw is not None else _json(entry["body"])


def surfaces_for(openai: Surface, anthropic: Surface) -> dict[str, Surface]:
    return {endpoint: anthropic if endpoint == MESSAGES else openai for endpoint in OPERATIONS}
