"""Batch jobs for clients: ``jobs.submit``, ``jobs.status``, ``jobs.results``, ``jobs.cancel``,
``jobs.list``, ``jobs.delete``.

Registered as gateway methods, so they work on ``/rpc`` and as MCP tools alike,
and only when some provider has a job manager (OpenAI, Anthropic). A job may
mix routes of several such providers; each provider runs its own share. A job
belongs to the identity that submitted it: others get "not found". A job kept
open with ``more: true`` closes with a last ``jobs.submit`` (calls optional) or,
forgotten, after ``store.open_job_idle_s`` without calls. Ended jobs go, with their
results, ``store.retention_s`` after they ended, or at once on ``jobs.delete``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from multiplexer.core.call import Call, Item
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.core.jobrows import JobRow, NewItem, custom_id
from multiplexer.core.jobs import BatchJobs, JobStore, end_if_done, new_job_id
from multiplexer.core.jsonrpc import is_unicode
from multiplexer.core.provider import BatchCapable, ToolSpec
from multiplexer.gateway.admission import job_item
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.reload import on_reload

log = logging.getLogger(__name__)
MAX_CALLS_PER_SUBMIT = 100_000
MAX_PAGE = 10_000

_JOB_ID = {"type": "string", "description": "The id jobs.submit returned"}
SPECS = {
    "jobs.submit": ToolSpec("jobs.submit", "Submit calls as one batch job (cheaper, slower): a job id.", {
        "type": "object",
        "properties": {
            "calls": {"type": "array", "description": "Required for a new job", "items": {
                "type": "object", "properties": {"method": {"type": "string"}, "params": {}},
                "required": ["method"]}},
            "job_id": {"type": "string", "description": "Append to this open job (calls may be empty)"},
            "more": {"type": "boolean", "description": "More calls follow: keep the job open"},
        }}),
    "jobs.status": ToolSpec("jobs.status", "State and counts of a batch job.", {
        "type": "object", "properties": {"job_id": _JOB_ID}, "required": ["job_id"]}),
    "jobs.results": ToolSpec("jobs.results", "A page of a batch job's results, in input order.", {
        "type": "object",
        "properties": {"job_id": _JOB_ID, "cursor": {"type": "integer", "minimum": 0},
                       "limit": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}},
        "required": ["job_id"]}),
    "jobs.cancel": ToolSpec("jobs.cancel", "Cancel a batch job; finished results stay available.", {
        "type": "object", "properties": {"job_id": _JOB_ID}, "required": ["job_id"]}),
    "jobs.delete": ToolSpec("jobs.delete", "Delete an ended batch job and its results.", {
        "type": "object", "properties": {"job_id": _JOB_ID}, "required": ["job_id"]}),
    "jobs.list": ToolSpec("jobs.list", "Your most recent batch jobs.", {
        "type": "object", "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 1000}}}),
}


def batch_managers(gateway: Gateway) -> dict[str, BatchJobs]:
    return {name: p.jobs for name, p in gateway.providers.items() if isinstance(p, BatchCapable)}


def attach_jobs(gateway: Gateway) -> JobFace | None:
    """Serve ``jobs.*`` on a running gateway where some provider has a batch API (the composer
    calls this: the gateway knows no face)."""
    managers = batch_managers(gateway)
    if not managers:
        return None
    face = gateway.faces["jobs"] = JobFace(gateway, managers)
    # a config reload: new jobs go to the providers now serving (a provider started anew by it
    # has a manager of its own, over the same store); jobs.* itself needs one at start
    on_reload(gateway, lambda _: setattr(face, "managers", batch_managers(gateway) or face.managers))
    handlers: dict[str, Callable[[Call], Awaitable[Any]]] = {
        "jobs.submit": face.submit, "jobs.status": face.status, "jobs.results": face.results,
        "jobs.cancel": face.cancel, "jobs.list": face.list, "jobs.delete": face.delete,
    }
    for name, handler in handlers.items():
        gateway.register_method(SPECS[name], handler)
    idle = gateway.config.store.open_job_idle_s
    if idle is not None:
        gateway.start_background(face.close_idle_forever, idle)
    retention = gateway.config.store.retention_s
    if retention is not None:
        gateway.start_background(face.purge_forever, retention)
    return face


def _params(call: Call) -> dict[str, Any]:
    if call.params is None:
        return {}
    if not isinstance(call.params, dict):
        raise invalid_params("params must be an object")
    return call.params


def _int(params: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise invalid_params(f"'{key}' must be an integer from {lo} to {hi}")
    return value


def not_found(job_id: Any) -> RpcError:
    return RpcError(Code.NOT_FOUND, f"Job not found: {str(job_id)[:200]!r}; jobs.list lists yours",
                    {"job_id": job_id})


class JobFace:
    def __init__(self, gateway: Gateway, managers: dict[str, BatchJobs]) -> None:
        self.gateway = gateway
        self.managers = managers
        self._lock = anyio.Lock()

    def store(self) -> JobStore:
        return next(iter(self.managers.values())).store()

    async def _job(self, call: Call) -> JobRow:
        job_id = _params(call).get("job_id")
        if not isinstance(job_id, str):
            raise invalid_params("'job_id' must be a string")
        return await self.owned(job_id, call.identity)

    async def owned(self, job_id: str, identity: str | None) -> JobRow:
        """The job, if ``identity`` owns it; another's is as unknown as one that never was."""
        if not is_unicode(job_id):
            raise not_found(job_id)  # no job id holds a lone surrogate
        st = self.store()
        job = await st.run(st.job, job_id)
        if job is None or job.identity != identity:
            raise not_found(job_id)
        return job

    async def _open_job(self, call: Call) -> JobRow:
        """The caller's job named by ``job_id``, if it still takes calls."""
        job = await self._job(call)
        if job.state != "open":
            raise invalid_params(f"job {job.id} is {job.state}; only open jobs take more calls")
        return job

    def _item(self, spec: Any, identity: str | None,
              operation: str | None = None) -> tuple[BatchJobs, Item]:
        """One call of a job as an item, built by admission (``admission.job_item``) on a route
        whose provider has a batch API; ``operation`` (set by a face, as a ``/v1/batches`` file's
        endpoint asks) replaces the route's."""
        if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
            raise invalid_params("each call must be an object with a string 'method'")
        method, params = spec["method"], spec.get("params")
        if method in self.gateway.methods:
            raise invalid_params(f"{method} cannot run inside a batch job")
        item = job_item(self.gateway, Call(method, params, identity=identity, operation=operation,
                                           face="jobs"), self.managers)
        return self.managers[self.gateway.config.routes[item.route].provider], item

    async def submit(self, call: Call) -> dict[str, Any]:
        """``jobs.submit``; the MCP task face stores its jobs through here too (``job_source: task``)."""
        source = call.job_source or "client"
        params = _params(call)
        appending = params.get("job_id") is not None
        calls = params.get("calls", [] if appending else None)
        if not isinstance(calls, list) or not (calls or appending):
            raise invalid_params("'calls' must be a non-empty array of {method, params}")
        if len(calls) > MAX_CALLS_PER_SUBMIT:
            raise invalid_params(f"at most {MAX_CALLS_PER_SUBMIT} calls per jobs.submit; "
                                 "send the rest with job_id and more")
        more = params.get("more")
        if more is None:
            more = False
        elif not isinstance(more, bool):  # "false" is truthy: it would keep the job open
            raise invalid_params("'more' must be a boolean")
        if appending:  # a refused append stores nothing, so it charges nothing either
            await self._open_job(call)
        quotas = self.gateway.quotas
        grant = await quotas.charge(call.identity, len(calls))  # -32003 before anything is stored
        stored: list[str] = []  # the job id, once the calls are in the store
        try:
            return await self._store_calls(call, calls, more, appending, source, stored)
        except BaseException:
            if not stored:  # refused before anything was stored: the calls will never run
                quotas.refund(grant)
            raise

    async def _store_calls(self, call: Call, calls: list[Any], more: bool, appending: bool,
                           source: str, stored: list[str]) -> dict[str, Any]:
        st = self.store()
        # each line admitted as a call would be (access, route, item), before anything is stored
        built: list[tuple[BatchJobs, Item] | RpcError] = []
        for spec in calls:
            try:
                built.append(self._item(spec, call.identity, call.operation))
            except RpcError as e:
                built.append(e)
        async with self._lock:
            if appending:
                job = await self._open_job(call)
                job_id = job.id
            else:
                job_id = new_job_id()
            await self._hold_budget(job_id, call.identity, built)  # refused whole: nothing stored
            if not appending:
                await st.run(st.create_job, job_id, call.identity, source, "open")
                created = await st.run(st.job, job_id)
                assert created is not None  # made just now, under the lock
                job = created
            rows = []  # numbered from 0: the store places them after the job's total, atomically
            for idx, (spec, line) in enumerate(zip(calls, built, strict=True)):
                if not isinstance(line, RpcError):
                    rows.append(line[0].new_item(job.id, idx, line[1]))
                    continue
                method = spec.get("method") if isinstance(spec, dict) else None
                if not (isinstance(method, str) and is_unicode(method)):
                    method = None
                rows.append(NewItem(idx=idx, provider=None, route=None, operation=None,
                                    method=method,
                                    params=None, options={}, tokens=0,
                                    custom_id=custom_id(job.id, idx), state="failed",
                                    error=line.to_dict()))
            if await st.run(st.append_items, job.id, rows) is None:  # sealed by another replica
                raise invalid_params(f"job {job.id} is no longer open; only open jobs take more calls")
            stored.append(job.id)
            log.info("batch job %s: %d call(s) %s by key %s%s", job.id, len(calls),
                     "added" if appending else f"submitted ({source})", call.identity or "-",
                     "; more to come" if more else "")
            if not more:
                await self._close(job.id)
        current = await st.run(st.job, job.id)
        assert current is not None
        return {"job_id": job.id, "accepted": len(calls), "total": current.total,
                "state": current.state}

    async def _hold_budget(self, job_id: str, identity: str | None,
                           built: list[tuple[BatchJobs, Item] | RpcError]) -> None:
        """The job's lines reserved against the caller's budgets, all of them at once (each line's
        most at the batch price), or the submit refused whole naming the shortfall."""
        money = self.gateway.money
        if money is None or not money.budgets.applies(identity):
            return
        routes = self.gateway.config.routes
        lines = [money.budgets.most_of(item.route, routes[item.route], item, True)
                 for line in built if not isinstance(line, RpcError) for item in (line[1],)]
        await money.hold_job(job_id, identity, lines)

    async def _close(self, job_id: str) -> bool:
        """Seal an open job and hand it to the managers; False if it was no longer open."""
        st = self.store()
        if not await st.run(st.set_job_state, job_id, "running", ("open",)):
            return False
        for manager in self.managers.values():
            await manager.plan(job_id)
        await self._end_if_done(job_id)
        return True

    async def _end_if_done(self, job_id: str) -> None:
        """Close the job if all its items ended. A part's driver may be closing it at the same
        moment; whichever closes it wakes every manager's waiters and tells the listeners, so
        the end is never silent when the face wins that race."""
        final = await end_if_done(self.store(), job_id, self.gateway.metrics)
        if final is not None:
            for manager in self.managers.values():
                manager.ended(job_id)
            self.gateway.notify("batch_job_ended", {"job_id": job_id, "state": final})

    async def close_idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """Close the jobs left open ``idle_s`` without calls (as of wall time ``now``)."""
        st = self.store()
        closed = []
        async with self._lock:
            now = self.gateway.clock.wall() if now is None else now
            for job_id in await st.run(st.idle_open_jobs, now - idle_s):
                if await self._close(job_id):
                    closed.append(job_id)
                    log.warning("batch job %s was left open %.0f s without calls: closed and run",
                                job_id, idle_s)
                    self.gateway.notify("batch_job_closed_idle", {"job_id": job_id})
        return closed

    async def close_idle_forever(self, idle_s: float) -> None:
        await self._every(min(60.0, idle_s / 4), self.close_idle, idle_s)

    async def _every(self, interval: float, fn: Callable[[float], Awaitable[Any]], arg: float) -> None:
        """``fn(arg)`` now and then every ``interval`` seconds of the gateway's clock."""
        clock = self.gateway.clock
        while True:
            await fn(arg)
            await clock.sleep_until(clock.now() + interval)

    async def purge(self, retention_s: float, now: float | None = None) -> list[str]:
        """Delete the jobs that ended more than ``retention_s`` ago (as of wall time ``now``)."""
        st = self.store()
        gone: list[str] = []
        now = self.gateway.clock.wall() if now is None else now
        while batch := await st.run(st.purge, now - retention_s):
            gone += batch
        for job_id in gone:
            for manager in self.managers.values():
                manager.forget(job_id)
        return gone

    async def purge_forever(self, retention_s: float) -> None:
        await self._every(min(3600.0, retention_s / 4), self.purge, retention_s)

    async def delete(self, call: Call) -> dict[str, Any]:
        job = await self._job(call)
        if job.state not in ("done", "cancelled"):
            raise invalid_params(f"job {job.id} is {job.state}; cancel it and delete it once it ended",
                                 job_id=job.id, state=job.state)
        st = self.store()
        deleted = await st.run(st.delete_job, job.id)
        for manager in self.managers.values():
            manager.forget(job.id)
        return {"job_id": job.id, "deleted": deleted}

    async def status(self, call: Call) -> dict[str, Any]:
        job = await self._job(call)
        st = self.store()
        counts = await st.run(st.counts, job.id)
        parts = await st.run(st.job_parts, job.id)
        finished = counts["succeeded"] + counts["failed"]
        return {
            "job_id": job.id, "state": job.state, "source": job.source, "total": job.total,
            "counts": {"queued": counts["queued"], "running": counts["submitted"],
                       "succeeded": counts["succeeded"], "failed": counts["failed"],
                       "finished": finished},
            "done": job.state in ("done", "cancelled"),
            "created_at": job.created, "updated_at": job.updated,
            "batches": [{"provider": p.provider, "remote_id": p.remote_id, "attempt": p.attempt,
                         "state": p.state, "remote_status": p.remote_status} for p in parts],
        }

    async def results(self, call: Call) -> dict[str, Any]:
        job = await self._job(call)
        params = _params(call)
        cursor = _int(params, "cursor", 0, 0, 1 << 62)
        limit = _int(params, "limit", 1000, 1, MAX_PAGE)
        st = self.store()
        rows = await st.run(st.page, job.id, cursor, limit)
        out = []
        for idx, state, result, error, route in rows:
            if state == "succeeded":
                out.append({"index": idx, "status": "succeeded", "result": result, "route": route})
            elif state == "failed":
                out.append({"index": idx, "status": "failed", "error": error, "route": route})
            else:
                out.append({"index": idx, "status": "pending"})
        last = rows[-1][0] if rows else cursor - 1
        more = len(rows) == limit and last + 1 < job.total
        return {"job_id": job.id, "state": job.state, "results": out,
                "next_cursor": last + 1 if more else None}

    async def cancel(self, call: Call) -> dict[str, Any]:
        job = await self._job(call)
        st = self.store()
        if await st.run(st.set_job_state, job.id, "cancelling", ("open", "running")):
            for manager in self.managers.values():
                await manager.cancel(job.id)
            await self._end_if_done(job.id)
        return await self.status(call)

    async def list(self, call: Call) -> dict[str, Any]:
        limit = _int(_params(call), "limit", 20, 1, 1000)
        st = self.store()
        jobs = await st.run(st.list_jobs, call.identity, limit)
        return {"jobs": [{"job_id": j.id, "state": j.state, "source": j.source, "total": j.total,
                          "created_at": j.created} for j in jobs]}
