"""Long calls as MCP tasks: the ``io.modelcontextprotocol/tasks`` extension (SEP-2663).

A ``tools/call`` to a route that runs as batch jobs (``mode: batch``, or
``task: true`` on a route of a provider with a batch API), from a client that
listed the extension in the request's client capabilities, is stored as a
one-call job in the same durable store ``jobs.*`` uses, and answered with a
``CreateTaskResult`` only after that. ``tasks/get`` reads the job back,
``tasks/cancel`` cancels it. The task id is the job id: an unguessable bearer
handle bound to the caller's key (another key gets the unknown-id error), and
it survives a gateway restart with the store. Other clients get the blocking
call; handshake-era clients cannot opt in at all.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import mcp_types as types
from mcp import MCPError
from mcp.server import ServerRequestContext
from mcp_types.methods import serialize_server_result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from multiplexer.core.call import Call
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.jobrows import JobRow
from multiplexer.core.provider import BatchCapable
from multiplexer.faces.jobs import JobFace
from multiplexer.faces.mcp.tools import error_result, wrap_result
from multiplexer.gateway.gateway import Gateway

EXTENSION = "io.modelcontextprotocol/tasks"
CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
HEADER_MISMATCH = -32020
MIN_POLL_MS = 1000
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


class TaskFace:
    def __init__(self, gateway: Gateway, jobs: JobFace,
                 identity_of: Callable[[ServerRequestContext[Any, Any]], str | None]) -> None:
        self.gateway = gateway
        self.jobs = jobs
        self.identity_of = identity_of

    # -- creation -----------------------------------------------------------------
    def runs_as_task(self, method: str) -> bool:
        """Whether a call of this route may become a task: it runs as a batch job."""
        try:
            route = self.gateway.resolve(method).route
        except RpcError:
            return False
        provider = self.gateway.providers[route.provider]
        return isinstance(provider, BatchCapable) and (route.mode == "batch" or route.task)

    async def create(self, method: str, arguments: Any, identity: str | None) -> dict[str, Any]:
        """Store the call as a one-call job (durably), then describe the new task."""
        calls = [{"method": method, "params": arguments}]
        submitted = await self.jobs.submit(Call("jobs.submit", {"calls": calls}, identity=identity))
        job = await self._job(submitted["job_id"], identity)
        return {"resultType": "task", **self._task(job, "working")}

    # -- tasks/get, tasks/cancel ------------------------------------------------------
    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        job = await self._owned(ctx, params.task_id)
        status, outcome = await self._status(job, ctx.protocol_version)
        return {"resultType": "complete", **self._task(job, status), **outcome}

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        """Cooperative: the remote batch is asked to stop; what already finished stays finished."""
        job = await self._owned(ctx, params.task_id)
        await self.jobs.cancel(Call("jobs.cancel", {"job_id": job.id}, identity=job.identity))
        return {}

    async def _owned(self, ctx: ServerRequestContext[Any, Any], task_id: str) -> JobRow:
        check_name_header(ctx, task_id)
        return await self._job(task_id, self.identity_of(ctx))

    async def _job(self, task_id: str, identity: str | None) -> JobRow:
        try:
            return await self.jobs.owned(task_id, identity)
        except RpcError as e:
            if e.code == Code.NOT_FOUND:  # unknown, or another key's: the same answer
                raise MCPError(types.INVALID_PARAMS, "Unknown task", {"taskId": task_id}) from None
            raise MCPError(e.code, e.message, e.data) from None

    def _task(self, job: JobRow, status: str) -> dict[str, Any]:
        retention = self.gateway.config.store.retention_s
        task: dict[str, Any] = {
            "taskId": job.id, "status": status, "createdAt": iso(job.created),
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

    async def _status(self, job: JobRow, version: str) -> tuple[str, dict[str, Any]]:
        if job.state == "cancelled":
            return "cancelled", {}
        if job.state != "done":
            return "working", {}
        st = self.jobs.store()
        rows = await st.run(st.page, job.id, 0, 1)
        _, state, result, error = rows[0]
        if state == "succeeded":
            return "completed", {"result": tool_result(wrap_result(result), version)}
        err = RpcError.from_dict(error)
        if err.code == Code.CANCELLED:
            return "cancelled", {}
        if err.code in _FAILED or (err.data or {}).get("expired"):
            return "failed", {"error": err.to_dict()}
        return "completed", {"result": tool_result(error_result(err), version)}  # the provider's own error


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
