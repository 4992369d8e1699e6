"""Long calls as MCP tasks: the ``io.modelcontextprotocol/tasks`` extension (SEP-2663).

A ``tools/call`` to a route that runs as batch jobs (``mode: batch``, or
``task: true`` on a route of a provider with a batch API), from a client that
listed the extension in the request's client capabilities, is stored in a job
of the same durable store ``jobs.*`` uses, and answered with a
``CreateTaskResult`` only after that. A key's tasks made within the route's
batch window share one job (one remote batch), as blocking calls share a lane's;
the window's end or ``max_items`` seals it. The task id is ``<job id>.<index>``:
the job id is an unguessable bearer handle bound to the caller's key (another
key gets the unknown-id error), and it survives a gateway restart with the
store (a job a restart left inside its window is sealed at start). ``tasks/get``
reads the call's row back; ``tasks/cancel`` marks the call cancelled in that
row (so every replica and a restarted gateway see it, and its result is dropped
when its batch ends), and cancels the job once no call in it is left waiting. Other clients get the
blocking call; handshake-era clients cannot opt in at all.

The call that becomes a task is one request of its key, as a blocking call is: held on the
key's quota while the task is stored, and the job charges it to the key's batch calls. The job
room is reached through ``faces/jobs_port.py``, never as ``jobs.*`` calls through the gateway,
which would charge the key a second time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
import mcp_types as types
from mcp import MCPError
from mcp.server import ServerRequestContext
from mcp_types.methods import serialize_server_result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from multiplexer.core.errors import Code, RpcError, cancelled
from multiplexer.core.jobrows import JobRow
from multiplexer.core.policy import BatchPolicy
from multiplexer.core.provider import BatchCapable
from multiplexer.faces.jobs import JobFace
from multiplexer.faces.jobs_port import JobPort
from multiplexer.faces.mcp.tools import error_result, wrap_result
from multiplexer.gateway.gateway import Gateway

log = logging.getLogger(__name__)

EXTENSION = "io.modelcontextprotocol/tasks"
CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
HEADER_MISMATCH = -32020
MIN_POLL_MS = 1000
SOURCE = "task"  # the job store's source for task jobs (jobs.submit's are "client")
# Errors that end a call without the tool having answered: the task failed, it did not complete.
_FAILED = {Code.UPSTREAM_UNAVAILABLE, Code.INTERNAL_ERROR, Code.TIMEOUT}


class TaskParams(types.RequestParams):
    """``tasks/get`` and ``tasks/cancel`` params (``taskId`` on the wire)."""

    task_id: str


def opted_in(ctx: ServerRequestContext[Any, Any]) -> bool:
    """The client listed the extension in this request's capabilities (2026-07-28 requests only)."""
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    meta = (ctx.params or {}).get("_meta")
    caps = meta.get(CLIENT_CAPABILITIES) if isinstance(meta, dict) else None
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(extensions, dict) and EXTENSION in extensions


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


@dataclass
class _Pool:
    """A key's open task job: tasks made within the route's batch window share it (one remote batch)."""

    job_id: str
    size: int
    cap: int


class TaskFace:
    def __init__(self, gateway: Gateway, jobs: JobFace,
                 identity_of: Callable[[ServerRequestContext[Any, Any]], str | None]) -> None:
        self.gateway = gateway
        self.jobs = JobPort(jobs)
        self.identity_of = identity_of
        self._pools: dict[str | None, _Pool] = {}
        self._lock = anyio.Lock()
        self.spawn: Callable[..., Any] = gateway.start_background  # the MCP face's task group, once running

    # -- creation -----------------------------------------------------------------
    def runs_as_task(self, method: str) -> bool:
        """Whether a call of this route may become a task: it runs as a batch job."""
        try:
            route = self.gateway.resolve(method).route
        except RpcError:
            return False
        provider = self.gateway.providers[route.provider]
        return isinstance(provider, BatchCapable) and (route.mode == "batch" or route.task)

    def _policy(self, method: str) -> BatchPolicy:
        route = self.gateway.resolve(method).route
        return route.batch or self.gateway.config.providers[route.provider].batch

    async def create(self, method: str, arguments: Any, identity: str | None) -> dict[str, Any]:
        """Store the call (durably) in the key's open task job, then describe the new task.

        Tasks of one key made within the route's batch window (``max_wait_ms``, up to
        ``max_items``) share a job, hence a remote batch, as blocking calls share a lane's.
        """
        policy = self._policy(method)
        calls = [{"method": method, "params": arguments}]
        more = policy.max_items > 1 and policy.max_wait_ms > 0
        # one request of the key, like any call (a refusal is the call's error); the job adds
        # the call's batch charge
        async with self.gateway.quotas.held(identity, as_is), self._lock:
            pool = self._pools.get(identity)
            submitted = await self.jobs.submit(identity, calls, source=SOURCE, more=more,
                                               job_id=None if pool is None else pool.job_id)
            if pool is None and more:
                pool = self._pools[identity] = _Pool(submitted.job_id, 0, policy.max_items)
                self.spawn(self._seal_after, identity, pool, policy.max_wait_ms / 1000)
            if pool is not None:
                pool.size += 1
                if pool.size >= pool.cap:
                    await self._seal(identity, pool)
        job = await self._job(submitted.job_id, identity)
        return {"resultType": "task", **self._task(job, submitted.total - 1, "working")}

    async def _seal_after(self, identity: str | None, pool: _Pool, window_s: float) -> None:
        clock = self.gateway.clock
        await clock.sleep_until(clock.now() + window_s)
        async with self._lock:
            await self._seal(identity, pool)

    async def _seal(self, identity: str | None, pool: _Pool) -> None:
        """Close the pool's job (the managers plan it into remote batches); under the lock."""
        if self._pools.get(identity) is pool:
            del self._pools[identity]
            try:
                await self.jobs.submit(identity, [], source=SOURCE, job_id=pool.job_id)
            except RpcError as e:  # it ended meanwhile (cancelled, deleted): nothing left to run
                log.info("task job %s was not sealed: %s %s", pool.job_id, e.message, e.data or "")

    async def seal_orphans(self) -> None:
        """Task jobs a previous run left open (it stopped inside a window) run now, not after
        ``store.open_job_idle_s``."""
        st = self.jobs.store()
        for job_id in await st.run(st.idle_open_jobs, time.time()):
            job = await st.run(st.job, job_id)
            if job is not None and job.source == SOURCE:
                await self.jobs.submit(job.identity, [], source=SOURCE, job_id=job_id)

    # -- tasks/get, tasks/cancel ------------------------------------------------------
    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        job, idx = await self._owned(ctx, params.task_id)
        status, outcome = await self._status(job, idx, ctx.protocol_version)
        return {"resultType": "complete", **self._task(job, idx, status), **outcome}

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        """Cooperative and durable: the task's call is marked cancelled in the job store unless it
        already ended, so every replica, and the gateway after a restart, reports it cancelled, and
        its result is dropped when the remote batch brings it (other tasks of the job keep theirs).
        Once no call of the job is left waiting, the job is cancelled upstream too."""
        job, idx = await self._owned(ctx, params.task_id)
        st = self.jobs.store()
        stop = cancelled("task cancelled").to_dict()
        async with self._lock:  # no task joins the job between the count and the cancel
            await st.run(st.record, job.id, [(idx, "failed", None, stop)])
            counts = await st.run(st.counts, job.id)
            idle = counts["queued"] + counts["submitted"] == 0
            if idle and (pool := self._pools.get(job.identity)) is not None and pool.job_id == job.id:
                del self._pools[job.identity]  # its window does not seal it: it is cancelled
        if idle:  # a remote batch that serves no one
            await self.jobs.cancel(job.id, job.identity)
        return {}

    async def _owned(self, ctx: ServerRequestContext[Any, Any], tid: str) -> tuple[JobRow, int]:
        check_name_header(ctx, tid)
        job_id, _, idx = tid.rpartition(".")
        if not idx.isdigit() or not job_id:
            raise unknown_task(tid)
        job = await self._job(job_id, self.identity_of(ctx))
        if int(idx) >= job.total:
            raise unknown_task(tid)
        return job, int(idx)

    async def _job(self, job_id: str, identity: str | None) -> JobRow:
        try:
            return await self.jobs.owned(job_id, identity)
        except RpcError as e:
            if e.code == Code.NOT_FOUND:  # unknown, or another key's: the same answer
                raise unknown_task(job_id) from None
            raise MCPError(e.code, e.message, e.data) from None

    def _task(self, job: JobRow, idx: int, status: str) -> dict[str, Any]:
        retention = self.gateway.config.store.retention_s
        task: dict[str, Any] = {
            "taskId": task_id(job.id, idx), "status": status, "createdAt": iso(job.created),
            "lastUpdatedAt": iso(job.updated),
            "ttlMs": None if retention is None else int(retention * 1000),
        }
        if status == "working":
            task["pollIntervalMs"] = self._poll_ms()
        return task

    def _poll_ms(self) -> int:
        """As often as the gateway itself polls the batch APIs: sooner cannot show anything new."""
        intervals = [getattr(getattr(p, "settings", None), "batch_poll_interval_s", None)
                     for p in self.gateway.providers.values() if isinstance(p, BatchCapable)]
        seconds = min((s for s in intervals if isinstance(s, int | float)), default=10.0)
        return max(MIN_POLL_MS, int(seconds * 1000))

    async def _status(self, job: JobRow, idx: int, version: str) -> tuple[str, dict[str, Any]]:
        st = self.jobs.store()
        _, state, result, error, _ = (await st.run(st.page, job.id, idx, 1))[0]
        if state == "succeeded":
            return "completed", {"result": tool_result(wrap_result(result), version)}
        if state != "failed":
            return ("cancelled" if job.state == "cancelled" else "working"), {}
        err = RpcError.from_dict(error)
        if err.code == Code.CANCELLED:
            return "cancelled", {}
        if err.code in _FAILED or (err.data or {}).get("expired"):
            return "failed", {"error": err.to_dict()}
        return "completed", {"result": tool_result(error_result(err), version)}  # the provider's own error


def as_is(error: RpcError) -> RpcError:
    """A quota's refusal of a call that would become a task: the call's own error."""
    return error


def task_id(job_id: str, idx: int) -> str:
    """A task is one call of a task job: the job id is the unguessable part, bound to the key."""
    return f"{job_id}.{idx}"


def unknown_task(tid: str) -> MCPError:
    return MCPError(types.INVALID_PARAMS, "Unknown task", {"taskId": tid})


def tool_result(result: types.CallToolResult, version: str) -> dict[str, Any]:
    """The ``CallToolResult`` the call would have returned, in the client's revision."""
    dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    return serialize_server_result("tools/call", version, dumped)


def check_name_header(ctx: ServerRequestContext[Any, Any], task_id: str) -> None:
    """Over HTTP a request about a task names it in ``Mcp-Name`` (load balancers route by it)."""
    headers = getattr(ctx.request, "headers", None)
    if headers is not None and headers.get("mcp-name") != task_id:
        raise MCPError(HEADER_MISMATCH, "Mcp-Name header does not match the request's taskId",
                       {"taskId": task_id})
