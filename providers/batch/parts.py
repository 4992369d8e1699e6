"""Driving one part of a batch job: submit once, poll, collect, resubmit what expired.

Separate from the manager (which owns jobs, planning and the task group) so each
step's durability rule sits next to the step: the store is written before
anything irreversible happens upstream.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, cancelled, internal_error, upstream_error
from multiplexer.core.jobrows import PartRow
from multiplexer.jobs.store import LeaseLost

from .backend import JobItem, RemoteStatus, SubmissionUnknown, operations_of
from .quota import over_quota, take_room

if TYPE_CHECKING:
    from multiplexer.core.provider import ProviderContext
    from multiplexer.jobs.store import JobStore

    from .backend import BatchApiSettings, BatchBackend
    from .sync_fallback import SyncFallback

log = logging.getLogger(__name__)

SUBMIT_TRIES = 6
COLLECT_TRIES = 5
FLUSH_EVERY = 1000


def _rejected(error: RpcError) -> bool:
    """The upstream refused the submission outright: trying again will not help."""
    status = (error.data or {}).get("upstream_status")
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 425, 429)


class PartDriver:
    """The steps of one part; mixed into ``JobManager``, which provides the attributes below."""

    ctx: ProviderContext
    name: str
    settings: BatchApiSettings
    backend: BatchBackend | None
    sync: SyncFallback
    _scopes: dict[str, anyio.CancelScope]
    _admit: anyio.Lock  # one part at a time checks the quotas and claims its room
    _driving: set[str]
    _stopped: set[str]  # parts whose driver a closing manager stopped: their claims to hand back

    def store(self) -> JobStore:
        raise NotImplementedError

    async def _sleep(self, seconds: float) -> None:
        await self.ctx.clock.sleep_until(self.ctx.clock.now() + seconds)

    async def _create_parts(self, job_id: str, attempt: int, groups: list[list[int]]) -> None:
        raise NotImplementedError

    async def _finish_job(self, job_id: str) -> None:
        raise NotImplementedError

    async def _cancelling(self, job_id: str) -> bool:
        raise NotImplementedError

    async def _cancel_remote(self, remote_id: str, job_id: str) -> None:
        raise NotImplementedError

    async def _drive(self, part_id: str) -> None:
        st = self.store()
        try:
            await self._drive_claimed(part_id)
        except anyio.get_cancelled_exc_class():  # the manager is closing: it hands the claim
            self._stopped.add(part_id)            # back once every driver has stopped
            raise
        else:
            st.release_claim(part_id)
        finally:
            self._driving.discard(part_id)

    async def _drive_claimed(self, part_id: str) -> None:
        """Claim the part and drive it to its end; a lost lease or a bug stops here."""
        st = self.store()
        try:
            if not await st.run(st.claim_part, part_id):
                return  # another replica drives it
            await self._drive_part(part_id)
        except LeaseLost:  # paused past the lease: the part's new owner goes on from the store
            log.warning("%s: batch part %s is driven by another replica now", self.name, part_id)
        except Exception as e:  # a bug must neither lose the items nor stop the gateway
            log.exception("%s: batch part %s failed", self.name, part_id)
            try:
                part = await st.run(st.part, part_id)
                if part is not None:
                    await self._end_part(part, internal_error(f"batch part failed: {type(e).__name__}"))
            except Exception:  # the store itself is failing: the part stays open for a restart
                log.exception("%s: could not record the failure of %s", self.name, part_id)

    async def _drive_part(self, part_id: str) -> None:
        st = self.store()
        part = await st.run(st.part, part_id)
        if part is None or part.state == "done":
            return
        if self.backend is None or not await self._batchable(part):
            await self._run_sync(part)
            return
        remote = part.remote_id if part.state == "submitted" else await self._submit(part)
        if remote is None:
            return
        status = await self._wait_terminal(part, remote)
        if status is not None:
            await self._collect(part, status)

    async def _batchable(self, part: PartRow) -> bool:
        """Whether the vendor's batches carry the part's operation (one per part: the split key
        holds it); one it has no batch endpoint for runs through the synchronous calls."""
        assert self.backend is not None
        if part.state == "submitted" and part.remote_id == "sync":
            return False
        st = self.store()
        if await st.run(st.part_live, part.id):
            return False  # moved from a failed batch to a route's live endpoint
        operations = operations_of(self.backend)
        if operations is None:
            return True
        operation = await st.run(st.part_operation, part.id)
        return operation is None or operation in operations

    def _backoff(self, tries: int) -> float:
        return min(self.settings.batch_poll_interval_s * 2 ** max(tries - 1, 0), 300.0)

    async def _end_part(self, part: PartRow, error: RpcError | None, status: str | None = None,
                        detail: str | None = None, whole: bool = False, batch: bool = True) -> None:
        """Fail what is still open in the part (if ``error``), close it, maybe close the job.
        ``whole``: the remote batch failed as a whole (its status, or its submission refused):
        the error says so (``batch_failed``), and the items with a fallback route go there first.
        ``batch``: the part went to the vendor's batch API (False: its sync endpoint), as its
        failed lines' records say."""
        st = self.store()
        if error is not None and whole:
            error = RpcError(error.code, error.message, {**(error.data or {}), "batch_failed": True})
            await self._fall_back(part)
        if error is not None:
            # the lines this fails never ran, but each ends here for its caller: a record each
            ending = await st.run(st.part_items, part.id, True)
            failed = error.to_dict()
            await st.run(st.fail_open, part.job_id, failed, part.id)
            await self._announce(part, [(row.idx, None, failed) for row in ending], batch=batch)
            log.info("%s: batch job %s: part %s failed (%s): %s", self.name, part.job_id, part.id,
                     status or "-", (error.data or {}).get("detail", error.message))
        await st.run(st.finish_part, part.id, status, detail)
        await self._finish_job(part.job_id)

    async def _fall_back(self, part: PartRow) -> None:
        """Resubmit the part's unfinished items to their fallback routes (``ctx.job_fallback``);
        what it moves is written to the store first, so a restart plans it on the new route."""
        hook = self.ctx.job_fallback
        if hook is None or await self._cancelling(part.job_id):
            return
        try:
            moved = await hook(self.store(), part)
        except LeaseLost:
            raise
        except Exception:  # the items fail with the batch, as they would without a fallback
            log.exception("%s: batch part %s: its items could not fall back", self.name, part.id)
            return
        if moved:
            log.info("%s: batch job %s: %d request(s) of failed part %s resubmitted to their fallback "
                     "route", self.name, part.job_id, moved, part.id)
            self.ctx.metrics.events.labels(self.name, "batch_fell_back").inc(moved)

    async def _submit(self, part: PartRow) -> str | None:
        """Create the remote batch exactly once; after an unclear failure, look before retrying."""
        assert self.backend is not None
        st = self.store()
        last: RpcError | None = None
        tries = quota_waits = 0
        pause = False
        while tries < SUBMIT_TRIES:  # a full quota (quota_waits) waits without using up a try
            if pause:
                await self._sleep(self._backoff(tries))
            pause = True
            tries += 1
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
            if current.state != "submitting" and not await take_room(self, part):
                await self._end_part(part, cancelled("batch job cancelled"), "cancelled")
                return None
            items = [JobItem(cid, op or "", body or "{}")
                     for cid, op, body in await st.run(st.part_requests, part.id)]
            await st.run(st.mark_submitting, part.id, time.time())
            try:
                remote = await self.backend.submit(part.id, items)
            except RpcError as e:
                if over_quota(e):  # the vendor's enqueued-token quota is full: wait, not fail
                    log.info("%s: batch quota full (%s); part %s waits", self.name, e.message, part.id)
                    self.ctx.metrics.events.labels(self.name, "batch_waits_for_quota").inc()
                    quota_waits += 1
                    tries, pause = tries - 1, False
                    await self._sleep(self._backoff(quota_waits))
                    continue
                if _rejected(e):
                    await self._end_part(part, e, "rejected", whole=True)
                    return None
                log.warning("%s: batch submit failed (%s); will retry", self.name, e.message)
                last = e
                continue
            await st.run(st.mark_submitted, part.id, remote)
            return await self._submitted(part, remote)
        await self._end_part(part, last or upstream_error(self.name, "batch submission failed"),
                             "unsubmitted", whole=True)
        return None

    async def _submitted(self, part: PartRow, remote: str) -> str:
        self.ctx.metrics.events.labels(self.name, "batch_submitted").inc()
        log.info("%s: batch job %s: part %s is remote batch %s", self.name, part.job_id, part.id, remote)
        self.ctx.notify("batch_submitted", {"job_id": part.job_id, "part_id": part.id,
                                            "remote_id": remote})
        if await self._cancelling(part.job_id):
            await self._cancel_remote(remote, part.job_id)
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
                log.info("%s: batch job %s: remote batch %s is %s%s", self.name, part.job_id, remote,
                         seen, "".join(f", {k} {v}" for k, v in sorted(status.counts.items())))
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
                                 status.status, detail, whole=True)
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
            await self._announce(part, [(i, None, err) for i in sorted(missing)], batch=True)
            leftover -= missing
        if not leftover:
            await self._end_part(part, None, status.status)
        elif await self._cancelling(part.job_id):
            await self._end_part(part, cancelled("batch job cancelled"), status.status)
        elif status.terminal == "cancelled":  # by the vendor, not by the job's owner
            await self._end_part(part, cancelled("batch job cancelled"), status.status, whole=True)
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
                status.status, whole=True)

    async def _read_results(self, part: PartRow, status: RemoteStatus,
                            rows: list[tuple[int, str]]) -> set[int]:
        """Record every finished line; return items the vendor reports as not run."""
        assert self.backend is not None
        st = self.store()
        by_id = {cid: idx for idx, cid in rows}
        unfinished: set[int] = set()
        buf: list[tuple[int, str, Any, Any]] = []
        stop = cancelled("batch job cancelled").to_dict()
        done: list[tuple[int, Any, Any]] = []  # (index, result, error) of each line that ran
        async for line in self.backend.results(status):
            idx = by_id.pop(line.custom_id, None)
            if idx is None:
                continue
            if line.kind == "succeeded":
                buf.append((idx, "succeeded", line.result, None))
                done.append((idx, line.result, None))
            elif line.kind == "errored":
                failed = (line.error or upstream_error(self.name, "batch request failed")).to_dict()
                buf.append((idx, "failed", None, failed))
                done.append((idx, None, failed))
            elif line.kind == "cancelled":
                buf.append((idx, "failed", None, stop))
                done.append((idx, None, stop))
            else:
                unfinished.add(idx)
            if len(buf) >= FLUSH_EVERY:
                await st.run(st.record, part.job_id, buf)
                buf = []
        if buf:
            await st.run(st.record, part.job_id, buf)
        await self._announce(part, done, batch=True)
        return unfinished

    async def _announce(self, part: PartRow, done: list[tuple[int, Any, Any]], batch: bool) -> None:
        """Tell the listeners what a client's job (``jobs.submit``, ``/v1/batches``) used, line by
        line, for its cost: ``batch_results`` with (route, model, usage) per line that succeeded,
        and for the request log each line that ended, failed ones too (those the vendor
        cancelled, left without a result, or that ended with a part that failed, expired or
        was cancelled, never having run): ``ended``, (method, route, model, usage, error) in
        the same order. A route's own jobs (``mode: batch``) are priced
        and recorded with their calls, not here."""
        if not done:
            return
        try:
            await self._announce_lines(part, done, batch)
        except Exception:  # the results are kept; only their cost goes uncounted
            log.exception("%s: the cost of job %s's lines could not be announced", self.name, part.job_id)

    async def _announce_lines(self, part: PartRow, done: list[tuple[int, Any, Any]], batch: bool) -> None:
        st = self.store()
        job = await st.run(st.job, part.job_id)
        if job is None or job.source == "route":
            return
        items = {r.idx: r for r in await st.run(st.part_items, part.id)}
        lines, ended = [], []
        for idx, result, error in done:
            row = items.get(idx)
            if row is None:
                continue
            try:
                params = json.loads(row.params or "null")
            except ValueError:
                params = None
            model = params.get("model") if isinstance(params, dict) else None
            usage = result.get("usage") if isinstance(result, dict) else None
            model = model if isinstance(model, str) else None
            if error is None:
                lines.append((row.route or "", model, usage))
            ended.append((row.method, row.route or "", model, usage, error))
        self.ctx.notify("batch_results", {"job_id": part.job_id, "provider": self.name,
                                          "identity": job.identity, "batch": batch, "lines": lines,
                                          "ended": ended, "source": job.source, "created": job.created})

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

        done: list[tuple[int, Any, Any]] = []

        async def on_result(idx: int, outcome: Outcome) -> None:
            if outcome.ok:
                buf.append((idx, "succeeded", outcome.result, None))
                done.append((idx, outcome.result, None))
            else:
                assert outcome.error is not None
                failed = outcome.error.to_dict()
                buf.append((idx, "failed", None, failed))
                done.append((idx, None, failed))
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
                    await self._announce(part, done, batch=False)
        error = cancelled("batch job cancelled") if scope.cancelled_caught else None
        await self._end_part(part, error, "cancelled" if error else "completed", batch=False)
