"""The job manager: durable batch jobs driven to a terminal state, across restarts.

A job is split into parts (vendor size limits, one model per OpenAI file); each
part has one driver task in the manager's task group (started by the
provider's ``start``, cancelled by its ``aclose``, which then hands their
claims back): submit, poll, collect, and for an expired batch resubmit what did
not run, once. Every state change is written to the store first, so a
restarted gateway picks each part up where it stopped and submits nothing twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, cancelled, internal_error
from multiplexer.core.jobrows import NewItem, custom_id
from multiplexer.core.jobs import LIVE, count_jobs, end_if_done, new_job_id
from multiplexer.core.provider import ProviderContext
from multiplexer.jobs.store import LIVE_SPLIT, JobStore, LeaseLost
from multiplexer.jobs.stores import acquire, release, sqlite_shared

from .backend import (
    BatchApiSettings,
    BatchBackend,
    Planned,
    plan_parts,
    quotas_of,
)
from .parts import PartDriver
from .sync_fallback import SyncFallback

log = logging.getLogger(__name__)

LINE_OVERHEAD = 160  # custom_id, method, url and JSON punctuation around the body


def to_outcome(state: str, result: Any, error: Any) -> Outcome:
    if state == "succeeded":
        return Outcome(result=result)
    if state == "failed":
        return Outcome.fail(RpcError.from_dict(error))
    return Outcome.fail(internal_error(f"batch item ended in state {state!r}"))


class JobManager(PartDriver):
    def __init__(self, ctx: ProviderContext, settings: BatchApiSettings,
                 backend: BatchBackend | None, sync: SyncFallback) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.settings = settings
        self.backend = backend if settings.batch_on else None
        self.sync = sync
        self._store: JobStore | None = None
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._done: dict[str, anyio.Event] = {}
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._admit = anyio.Lock()
        self._driving: set[str] = set()
        self._stopped: set[str] = set()
        self._cancel_sent: dict[str, str] = {}  # remote batch id -> job id, until the job ends

    # -- lifecycle -------------------------------------------------------------
    def store(self) -> JobStore:
        """Opened on first use, or at start when the file exists (jobs may be pending)."""
        if self._store is None:
            store = self._store = acquire(self.ctx.store_path, self.ctx.store_url, self.ctx.store_lease_s,
                                          self.ctx.store_schema)
            metrics = self.ctx.metrics  # its gauges, read before each scrape (once per store)
            metrics.refreshers[store] = lambda: count_jobs(store, metrics)
        return self._store

    async def start(self) -> None:
        if self.ctx.store_url is not None:
            self.store()  # a store.url that cannot be used stops start-up here, nothing yet to undo
        stack = AsyncExitStack()
        await stack.__aenter__()
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        if self.ctx.store_url is not None or self.ctx.store_path.exists():
            await self.resume()
        if (self.ctx.store_url is not None or sqlite_shared()) and self.store().shared:
            self._tg.start_soon(self._adopt_forever)  # replicas, or the workers of one gateway

    async def aclose(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()
        if self._store is not None:
            await self._hand_back(self._store)
            self.ctx.metrics.refreshers.pop(self._store, None)
            release(self._store)
            self._store = None

    async def _hand_back(self, st: JobStore) -> None:
        """A clean stop, every driver ended: clear this replica's claims on the parts it was
        driving, so a restart or another replica resumes them now rather than after the lease.
        A crash skips this; its claims lapse with the lease."""
        parts, self._stopped = sorted(self._stopped), set()
        if not parts:
            return
        with anyio.CancelScope(shield=True):  # a cancelled shutdown still hands them back
            try:
                released = await st.run(st.release_claims, parts)
            except Exception:  # the database is away: the claims lapse with the lease
                log.exception("%s: could not hand back %d batch part(s)", self.name, len(parts))
                return
        if released:
            log.info("%s: handed back %d batch part(s) for another gateway", self.name, len(released))
            self.ctx.metrics.events.labels(self.name, "batch_handed_back").inc(len(released))

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
        if item.options.get(LIVE):  # moved from a failed batch to a live route: parts of its own
            split = LIVE_SPLIT
        elif self.backend is not None and isinstance(item.params, dict):
            split = json.dumps(self.backend.split_key(item.operation, item.params), default=str)
        return NewItem(idx=idx, provider=self.name, route=item.route, operation=item.operation,
                       method=item.method, params=item.params, options=item.options,
                       tokens=int(item.options.get("tokens", item.tokens)),
                       custom_id=custom_id(job_id, idx), split=split)

    async def run_items(self, items: Sequence[Item]) -> list[Outcome]:
        """A lane's batch from a ``mode: batch`` route: one job; outcomes when it ends."""
        st = self.store()
        job_id = new_job_id()
        identities = {i.identity for i in items}
        identity = identities.pop() if len(identities) == 1 else None
        await st.run(st.create_job, job_id, identity, "route", "open")
        await st.run(st.add_items, job_id, (self.new_item(job_id, i, it) for i, it in enumerate(items)))
        log.info("%s: batch job %s: %d call(s) of route %s", self.name, job_id, len(items),
                 items[0].route if items else "-")
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
        max_tokens = None
        if self.backend is None:
            limit, max_bytes = self.settings.batch_max_requests, 1 << 62
        else:
            limit, max_bytes = self.backend.max_requests, self.backend.max_bytes
            max_tokens = quotas_of(self.backend)[1]
        tokens = await st.run(st.unplanned_tokens, job_id, self.name) if max_tokens else {}
        planned = [Planned(idx, split, (size or 0) + LINE_OVERHEAD, tokens.get(idx, 0))
                   for idx, split, size in rows]
        await self._create_parts(job_id, 0, plan_parts(planned, limit, max_bytes, max_tokens))

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
            if part.state == "submitting" and part.id in self._scopes:
                continue  # let it learn the remote id: it then cancels upstream (_submitted)
            if part.id in self._scopes:
                self._scopes[part.id].cancel()
            elif part.state == "pending":
                await st.run(st.fail_open, job_id, err, part.id)
                with contextlib.suppress(LeaseLost):  # its replica ends it: it sees the cancel
                    await st.run(st.finish_part, part.id, "cancelled", None)
            elif part.state == "submitted" and part.remote_id and self.backend is not None:
                await self._cancel_remote(part.remote_id, job_id)
        await self._finish_job(job_id)

    async def _cancel_remote(self, remote_id: str, job_id: str) -> None:
        assert self.backend is not None
        if remote_id in self._cancel_sent:  # cancel() and a just-finished submit may both ask
            return
        self._cancel_sent[remote_id] = job_id
        try:
            await self.backend.cancel(remote_id)
        except RpcError as e:  # already ended, most often: polling will tell
            log.info("%s: cancel of %s refused: %s", self.name, remote_id, e.message)

    async def _finish_job(self, job_id: str) -> None:
        final = await end_if_done(self.store(), job_id, self.ctx.metrics)
        if final is not None:
            self.ended(job_id)
            self.ctx.notify("batch_job_ended", {"job_id": job_id, "state": final})

    def ended(self, job_id: str) -> None:
        event = self._done.get(job_id)
        self.forget(job_id)
        if event is not None:
            event.set()

    async def _adopt_forever(self) -> None:
        """Several replicas: renew the parts this one drives, stop those it lost, and take
        over the parts whose replica died (their lease ran out)."""
        st = self.store()
        lease_s = getattr(st, "lease_s", 30.0)
        while True:
            await anyio.sleep(lease_s / 3)
            try:
                for part_id in await st.run(st.renew_claims):
                    scope = self._scopes.get(part_id)
                    if scope is not None:
                        scope.cancel()
                for part_id in await st.run(st.unclaimed_parts, self.name):
                    self._spawn(part_id)
            except Exception:  # the database is away: drive what we hold, try again later
                log.exception("%s: could not renew or adopt batch parts", self.name)

    def forget(self, job_id: str) -> None:
        """Drop the job's entries in memory: on its end, and on delete (it may never end)."""
        self._done.pop(job_id, None)
        for remote in [r for r, j in self._cancel_sent.items() if j == job_id]:
            del self._cancel_sent[remote]

    async def _cancelling(self, job_id: str) -> bool:
        st = self.store()
        job = await st.run(st.job, job_id)
        return job is not None and job.state in ("cancelling", "cancelled")

    # -- driving parts (see PartDriver) -----------------------------------------
    def _spawn(self, part_id: str) -> None:
        if part_id in self._driving:
            return
        assert self._tg is not None, "JobManager used before start()"
        self._driving.add(part_id)
        self._tg.start_soon(self._drive, part_id)
