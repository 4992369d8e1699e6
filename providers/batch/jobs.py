"""The job manager: durable batch jobs driven to a terminal state, across restarts.

A job is split into parts (vendor size limits, one model per OpenAI file); each
part has one driver task in the manager's task group (started by the
provider's ``start``, cancelled by its ``aclose``): submit, poll, collect,
and for an expired batch resubmit what did not run, once. Every state change is
written to the store first, so a restarted gateway picks each part up where
it stopped and submits nothing twice.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio

from multiplexer.call import Item, Outcome
from multiplexer.errors import RpcError, cancelled, internal_error, upstream_error
from multiplexer.provider import ProviderContext

from .backend import (
    BatchApiSettings,
    BatchBackend,
    JobItem,
    Planned,
    RemoteStatus,
    SubmissionUnknown,
    plan_parts,
)
from .store import JobStore, NewItem, PartRow, acquire, release
from .sync_fallback import SyncFallback

log = logging.getLogger(__name__)

SUBMIT_TRIES = 6
COLLECT_TRIES = 5
FLUSH_EVERY = 1000
LINE_OVERHEAD = 160  # custom_id, method, url and JSON punctuation around the body


def new_job_id() -> str:
    return "job_" + secrets.token_hex(8)


def to_outcome(state: str, result: Any, error: Any) -> Outcome:
    if state == "succeeded":
        return Outcome(result=result)
    if state == "failed":
        return Outcome.fail(RpcError.from_dict(error))
    return Outcome.fail(internal_error(f"batch item ended in state {state!r}"))


def _rejected(error: RpcError) -> bool:
    """The upstream refused the submission outright: trying again will not help."""
    status = (error.data or {}).get("upstream_status")
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 425, 429)


class JobManager:
    def __init__(self, ctx: ProviderContext, settings: BatchApiSettings,
                 backend: BatchBackend | None, sync: SyncFallback) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.settings = settings
        self.backend = backend if settings.batch_api else None
        self.sync = sync
        self._store: JobStore | None = None
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._done: dict[str, anyio.Event] = {}
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._driving: set[str] = set()
        self._cancel_sent: set[str] = set()

    # -- lifecycle -------------------------------------------------------------
    def store(self) -> JobStore:
        """Opened on first use, or at start when the file exists (jobs may be pending)."""
        if self._store is None:
            self._store = acquire(self.ctx.store_path)
        return self._store

    async def start(self) -> None:
        stack = AsyncExitStack()
        await stack.__aenter__()
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        if self.ctx.store_path.exists():
            await self.resume()

    async def aclose(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()
        if self._store is not None:
            release(self._store)
            self._store = None

    async def resume(self) -> None:
        """Pick up what a previous run left: unplanned items, then every open part."""
        st = self.store()
        for job_id in await st.run(st.jobs_with_unplanned, self.name):
            await self.plan(job_id)
        parts = await st.run(st.open_parts, self.name)
        if parts:
            log.info("%s: resuming %d batch part(s)", self.name, len(parts))
            self.ctx.metrics.events.labels(self.name, "batch_resumed").inc(len(parts))
        for part in parts:
            self._spawn(part.id)

    # -- jobs ------------------------------------------------------------------
    def new_item(self, job_id: str, idx: int, item: Item) -> NewItem:
        split = None
        if self.backend is not None and isinstance(item.params, dict):
            split = json.dumps(self.backend.split_key(item.operation, item.params), default=str)
        return NewItem(idx=idx, provider=self.name, route=item.route, operation=item.operation,
                       method=item.method, params=item.params, options=item.options,
                       tokens=int(item.options.get("tokens", item.tokens)),
                       custom_id=f"{job_id}-{idx}", split=split)

    async def run_items(self, items: Sequence[Item]) -> list[Outcome]:
        """A lane's batch from a ``mode: batch`` route: one job; outcomes when it ends."""
        st = self.store()
        job_id = new_job_id()
        identities = {i.identity for i in items}
        identity = identities.pop() if len(identities) == 1 else None
        await st.run(st.create_job, job_id, identity, "route", "open")
        await st.run(st.add_items, job_id, (self.new_item(job_id, i, it) for i, it in enumerate(items)))
        done = self._done[job_id] = anyio.Event()
        await st.run(st.set_job_state, job_id, "running")
        await self.plan(job_id)
        await done.wait()
        rows = await st.run(st.outcomes, job_id, len(items))
        return [to_outcome(*row) for row in rows]

    def watch(self, job_id: str) -> anyio.Event:
        return self._done.setdefault(job_id, anyio.Event())

    async def plan(self, job_id: str) -> None:
        """Split this provider's unplanned items of a sealed job into parts and drive them."""
        st = self.store()
        rows = await st.run(st.unplanned, job_id, self.name)
        if not rows:
            await self._finish_job(job_id)
            return
        if self.backend is None:
            limit, max_bytes = self.settings.batch_max_requests, 1 << 62
        else:
            limit, max_bytes = self.backend.max_requests, self.backend.max_bytes
        planned = [Planned(idx, split, (size or 0) + LINE_OVERHEAD) for idx, split, size in rows]
        await self._create_parts(job_id, 0, plan_parts(planned, limit, max_bytes))

    async def _create_parts(self, job_id: str, attempt: int, groups: list[list[int]]) -> None:
        st = self.store()
        parts = [(f"{job_id}.{secrets.token_hex(4)}", idxs) for idxs in groups]
        await st.run(st.create_parts, job_id, self.name, attempt, parts)
        for part_id, _ in parts:
            self._spawn(part_id)

    async def cancel(self, job_id: str) -> None:
        """The job is already marked cancelling: stop what has not run, ask upstream for the rest."""
        st = self.store()
        err = cancelled("batch job cancelled").to_dict()
        await st.run(st.fail_open, job_id, err, None, self.name, True)
        for part in await st.run(st.job_parts, job_id):
            if part.provider != self.name or part.state == "done":
                continue
            if part.id in self._scopes:
                self._scopes[part.id].cancel()
            elif part.state == "pending":
                await st.run(st.fail_open, job_id, err, part.id)
                await st.run(st.finish_part, part.id, "cancelled", None)
            elif part.state == "submitted" and part.remote_id and self.backend is not None:
                await self._cancel_remote(part.remote_id)
        await self._finish_job(job_id)

    async def _cancel_remote(self, remote_id: str) -> None:
        assert self.backend is not None
        if remote_id in self._cancel_sent:  # cancel() and a just-finished submit may both ask
            return
        self._cancel_sent.add(remote_id)
        try:
            await self.backend.cancel(remote_id)
        except RpcError as e:  # already ended, most often: polling will tell
            log.info("%s: cancel of %s refused: %s", self.name, remote_id, e.message)

    async def _finish_job(self, job_id: str) -> None:
        st = self.store()
        final = await st.run(st.finish_job_if_done, job_id)
        if final is not None:
            event = self._done.pop(job_id, None)
            if event is not None:
                event.set()
            self.ctx.notify("batch_job_ended", {"job_id": job_id, "state": final})

    async def _cancelling(self, job_id: str) -> bool:
        st = self.store()
        job = await st.run(st.job, job_id)
        return job is not None and job.state in ("cancelling", "cancelled")

    # -- driving one part ------------------------------------------------------
    def _spawn(self, part_id: str) -> None:
        if part_id in self._driving:
            return
        assert self._tg is not None, "JobManager used before start()"
        self._driving.add(part_id)
        self._tg.start_soon(self._drive, part_id)

    async def _drive(self, part_id: str) -> None:
        st = self.store()
        try:
            await self._drive_part(part_id)
        except Exception as e:  # a bug must neither lose the items nor stop the gateway
            log.exception("%s: batch part %s failed", self.name, part_id)
            part = await st.run(st.part, part_id)
            if part is not None:
                await self._end_part(part, internal_error(f"batch part failed: {type(e).__name__}"))
        finally:
            self._driving.discard(part_id)

    async def _drive_part(self, part_id: str) -> None:
        st = self.store()
        part = await st.run(st.part, part_id)
        if part is None or part.state == "done":
            return
        if self.backend is None:
            await self._run_sync(part)
            return
        remote = part.remote_id if part.state == "submitted" else await self._submit(part)
        if remote is None:
            return
        status = await self._wait_terminal(part, remote)
        if status is not None:
            await self._collect(part, status)

    async def _sleep(self, seconds: float) -> None:
        await self.ctx.clock.sleep_until(self.ctx.clock.now() + seconds)

    def _backoff(self, tries: int) -> float:
        return min(self.settings.batch_poll_interval_s * 2 ** max(tries - 1, 0), 300.0)

    async def _end_part(self, part: PartRow, error: RpcError | None, status: str | None = None,
                        detail: str | None = None) -> None:
        """Fail what is still open in the part (if ``error``), close it, maybe close the job."""
        st = self.store()
        if error is not None:
            await st.run(st.fail_open, part.job_id, error.to_dict(), part.id)
        await st.run(st.finish_part, part.id, status, detail)
        await self._finish_job(part.job_id)

    async def _submit(self, part: PartRow) -> str | None:
        """Create the remote batch exactly once; after an unclear failure, look before retrying."""
        assert self.backend is not None
        st = self.store()
        last: RpcError | None = None
        for tries in range(SUBMIT_TRIES):
            if tries:
                await self._sleep(self._backoff(tries))
            current = await st.run(st.part, part.id)
            assert current is not None
            open_items = await st.run(st.part_open, part.id)
            if current.state == "submitting":
                claimed = await st.run(st.claimed_remote_ids, self.name)
                try:
                    found = await self.backend.find(part.id, current.intent_wall or 0.0,
                                                    len(open_items), claimed)
                except SubmissionUnknown as e:
                    await self._end_part(part, upstream_error(
                        self.name, f"batch submission outcome unknown after an interruption ({e}); "
                        "not resubmitted, to avoid running it twice", part_id=part.id), "unknown")
                    return None
                except RpcError as e:
                    last = e
                    continue
                if found is not None:
                    await st.run(st.mark_submitted, part.id, found)
                    return await self._submitted(part, found)
            if not open_items:
                await self._end_part(part, None, "empty")
                return None
            if await self._cancelling(part.job_id):
                await self._end_part(part, cancelled("batch job cancelled"), "cancelled")
                return None
            items = [JobItem(cid, op or "", body or "{}")
                     for cid, op, body in await st.run(st.part_requests, part.id)]
            await st.run(st.mark_submitting, part.id, time.time())
            try:
                remote = await self.backend.submit(part.id, items)
            except RpcError as e:
                if _rejected(e):
                    await self._end_part(part, e, "rejected")
                    return None
                log.warning("%s: batch submit failed (%s); will retry", self.name, e.message)
                last = e
                continue
            await st.run(st.mark_submitted, part.id, remote)
            return await self._submitted(part, remote)
        await self._end_part(part, last or upstream_error(self.name, "batch submission failed"),
                             "unsubmitted")
        return None

    async def _submitted(self, part: PartRow, remote: str) -> str:
        self.ctx.metrics.events.labels(self.name, "batch_submitted").inc()
        self.ctx.notify("batch_submitted", {"job_id": part.job_id, "part_id": part.id,
                                            "remote_id": remote})
        if await self._cancelling(part.job_id):
            await self._cancel_remote(remote)
        return remote

    async def _wait_terminal(self, part: PartRow, remote: str) -> RemoteStatus | None:
        assert self.backend is not None
        st = self.store()
        seen, errors = part.remote_status, 0
        while True:
            try:
                status = await self.backend.poll(remote)
            except RpcError as e:
                if (e.data or {}).get("upstream_status") == 404:
                    await self._end_part(part, e, "missing")
                    return None
                errors += 1
                log.warning("%s: polling %s failed (%s)", self.name, remote, e.message)
                await self._sleep(self._backoff(errors))
                continue
            errors = 0
            if status.status != seen:
                seen = status.status
                await st.run(st.set_remote_status, part.id, seen)
            if status.terminal is not None:
                return status
            await self._sleep(self.settings.batch_poll_interval_s)

    async def _collect(self, part: PartRow, status: RemoteStatus) -> None:
        assert self.backend is not None
        st = self.store()
        if status.terminal == "failed":
            detail = status.detail or "batch failed"
            await self._end_part(part, upstream_error(self.name, detail, batch_id=status.remote_id,
                                                      batch_status=status.status),
                                 status.status, detail)
            return
        unfinished: set[int] = set()
        for tries in range(COLLECT_TRIES):
            rows = await st.run(st.part_open, part.id)
            try:
                unfinished = await self._read_results(part, status, rows)
                break
            except RpcError as e:
                if tries == COLLECT_TRIES - 1:
                    await self._end_part(part, e, status.status)
                    return
                log.warning("%s: reading results of %s failed (%s)", self.name,
                            status.remote_id, e.message)
                await self._sleep(self._backoff(tries + 1))
        leftover = {idx for idx, _ in await st.run(st.part_open, part.id)}
        missing = leftover - unfinished
        if status.terminal == "completed" and missing:
            err = upstream_error(self.name, "the batch ended without a result for this request",
                                 batch_id=status.remote_id).to_dict()
            await st.run(st.record, part.job_id, [(i, "failed", None, err) for i in sorted(missing)])
            leftover -= missing
        if not leftover:
            await self._end_part(part, None, status.status)
        elif status.terminal == "cancelled" or await self._cancelling(part.job_id):
            await self._end_part(part, cancelled("batch job cancelled"), status.status)
        elif self.settings.batch_resubmit_expired and part.attempt == 0:
            log.info("%s: %d request(s) of %s did not run; resubmitting once", self.name,
                     len(leftover), status.remote_id)
            await self._create_parts(part.job_id, 1, [sorted(leftover)])
            await self._end_part(part, None, status.status)
        else:
            again = " (also after one resubmission)" if part.attempt else ""
            await self._end_part(part, upstream_error(
                self.name, f"the batch expired before this request ran{again}",
                batch_id=status.remote_id, batch_status=status.status, expired=True),
                status.status)

    async def _read_results(self, part: PartRow, status: RemoteStatus,
                            rows: list[tuple[int, str]]) -> set[int]:
        """Record every finished line; return items the vendor reports as not run."""
        assert self.backend is not None
        st = self.store()
        by_id = {cid: idx for idx, cid in rows}
        unfinished: set[int] = set()
        buf: list[tuple[int, str, Any, Any]] = []
        stop = cancelled("batch job cancelled").to_dict()
        async for line in self.backend.results(status):
            idx = by_id.pop(line.custom_id, None)
            if idx is None:
                continue
            if line.kind == "succeeded":
                buf.append((idx, "succeeded", line.result, None))
            elif line.kind == "errored":
                err = line.error or upstream_error(self.name, "batch request failed")
                buf.append((idx, "failed", None, err.to_dict()))
            elif line.kind == "cancelled":
                buf.append((idx, "failed", None, stop))
            else:
                unfinished.add(idx)
            if len(buf) >= FLUSH_EVERY:
                await st.run(st.record, part.job_id, buf)
                buf = []
        if buf:
            await st.run(st.record, part.job_id, buf)
        return unfinished

    async def _run_sync(self, part: PartRow) -> None:
        """No batch API: the same items through the synchronous endpoint, results kept as they come."""
        st = self.store()
        rows = await st.run(st.part_items, part.id, True)
        await st.run(st.mark_submitted, part.id, "sync")
        items = [(r.idx, Item(route=r.route or "", operation=r.operation or "", method=r.method or "",
                              params=json.loads(r.params or "null"), tokens=r.tokens,
                              options=json.loads(r.options or "{}"))) for r in rows]
        buf: list[tuple[int, str, Any, Any]] = []

        async def flush() -> None:
            if buf:
                chunk = buf[:]
                buf.clear()
                await st.run(st.record, part.job_id, chunk)

        async def on_result(idx: int, outcome: Outcome) -> None:
            if outcome.ok:
                buf.append((idx, "succeeded", outcome.result, None))
            else:
                assert outcome.error is not None
                buf.append((idx, "failed", None, outcome.error.to_dict()))
            if len(buf) >= 100:
                await flush()

        with anyio.CancelScope() as scope:
            self._scopes[part.id] = scope
            try:
                await self.sync.run(items, on_result)
            finally:
                self._scopes.pop(part.id, None)
                with anyio.CancelScope(shield=True):
                    await flush()
        error = cancelled("batch job cancelled") if scope.cancelled_caught else None
        await self._end_part(part, error, "cancelled" if error else "completed")
