"""One audit record per MCP ``tools/call`` (``audit.tools``), off the hot path.

The call's own task only notes what it knows (when, who, which virtual server and tool, how it
ended, how long it took, the arguments object it already holds) into the gateway's
``tool_audit`` record sink; the sink's writer, on a worker thread, hashes the arguments
(canonical JSON, sha256), keeps them only with ``audit.arguments`` (through the redaction hook,
``records/redact.py``) and inserts a batch into ``mcp_tool_audit`` (``jobs/tool_tables``). Records
older than ``audit.retention_days`` are deleted about hourly by the writer.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp_types as types
from mcp import MCPError

from multiplexer.core.errors import Code
from multiplexer.gateway.reload import on_reload
from multiplexer.jobs.tool_tables import AuditRow, ToolTables, open_tool_tables
from multiplexer.records.redact import redacted_text, storable
from multiplexer.records.sink import RecordSink
from multiplexer.records.tool_audit_settings import AuditConfig

AUDIT_KEY = "tool_audit"  # in gateway.faces
PRUNE_EVERY_S = 3600.0
# Refusals: the call never reached its tool (the caller's limits, access, a quarantined tool).
REFUSED = {Code.RATE_LIMITED, Code.UNAUTHORIZED, Code.TOOL_QUARANTINED, Code.INVALID_PARAMS,
           Code.METHOD_NOT_FOUND, Code.TOO_LARGE, Code.OVERLOADED}
ERROR_META_KEY = "multiplexer/error"

# (at, identity, server, tool, status or the result it answered, code, duration_ms, arguments): what
# the call's task notes; a result's status is read on the writer.
Noted = tuple[float, str, str, str, Any, int | None, float, Any]


def args_hash(arguments: Any) -> str:
    text = json.dumps(arguments if arguments is not None else {}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()  # a fuzzer's lone surrogate too


class ToolAudit:
    """The gateway's tool-call audit: its sink, its tables, the writer's lifetime."""

    def __init__(self, gateway: Any, settings: AuditConfig) -> None:
        store = gateway.config.store
        self.settings = settings
        self._open = lambda: open_tool_tables(store.path, store.url, store.schema_)
        self._tables: ToolTables | None = None
        self.sink: RecordSink[Noted] = RecordSink(
            "tool_audit", self._write, registry=gateway.metrics.registry, capacity=settings.queue,
            interval_s=settings.flush_interval_s)
        self._users = 0
        self._pruned = 0.0
        self.base = gateway.config.server.mcp.path.rstrip("/")

    def reconfigure(self, config: Any) -> None:
        """A config reload's ``audit:`` (``tools`` waits for a restart): read by the writer's
        next batch; the queue's size and interval at once."""
        settings: AuditConfig = config.audit
        self.settings = settings
        self.sink.capacity, self.sink.interval_s = settings.queue, settings.flush_interval_s

    @property
    def tables(self) -> ToolTables:
        if self._tables is None:
            self._tables = self._open()
        return self._tables

    def _write(self, noted: Sequence[Noted]) -> None:
        keep = self.settings.arguments
        most = self.settings.max_argument_bytes
        rows = []
        for at, identity, server, tool, status, code, duration_ms, arguments in noted:
            if not isinstance(status, str):
                status, code = outcome_of(status)
            rows.append(AuditRow(at, storable(identity), server, storable(tool), status, code, duration_ms,
                                 args_hash(arguments), redacted_text(arguments, most) if keep else None))
        tables = self.tables
        tables.add_audit(rows)
        now = time.time()
        if now - self._pruned >= PRUNE_EVERY_S:
            self._pruned = now
            tables.prune_audit(now - self.settings.retention_days * 86400)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The writer runs while any MCP face does; the first face in owns it (and leaves last)."""
        self._users += 1
        if self._users > 1:
            try:
                yield
            finally:
                self._users -= 1
            return
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.sink.run)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._users -= 1
            await self.sink.aclose()
            tables, self._tables = self._tables, None
            if tables is not None:
                tables.close()

    def server_of(self, ctx: Any) -> str:
        """The virtual server the request came through ('' for the gateway's own endpoint, stdio)."""
        scope = getattr(getattr(ctx, "request", None), "scope", None)
        if not isinstance(scope, dict):
            return ""
        path = str(scope.get("path", ""))
        head = self.base + "/"
        return path[len(head):].strip("/") if path.startswith(head) else ""

    def audited(self, call_tool: Callable[[Any, Any], Awaitable[Any]],
                identity_of: Callable[[Any], str | None]) -> Callable[[Any, Any], Awaitable[Any]]:
        """``call_tool`` with one record per call, however it ends."""
        put = self.sink.put
        clock = time.perf_counter

        async def run(ctx: Any, params: types.CallToolRequestParams) -> Any:
            began = clock()
            status: Any = "error"
            code: int | None = int(Code.INTERNAL_ERROR)
            try:
                result = status = await call_tool(ctx, params)
                code = None
                return result
            except MCPError as e:
                code = e.error.code
                status = "refused" if code in REFUSED else "error"
                raise
            except anyio.get_cancelled_exc_class():
                status, code = "error", int(Code.CANCELLED)
                raise
            finally:
                put((time.time(), identity_of(ctx) or "", self.server_of(ctx), params.name, status,
                     code, (clock() - began) * 1000, params.arguments))

        return run


def outcome_of(result: Any) -> tuple[str, int | None]:
    """(status, code) of a ``tools/call`` answer: a result, an ``isError`` one (the gateway's error
    rides in its ``_meta``), or a task handle."""
    if isinstance(result, types.CallToolResult):
        if not result.is_error:
            return "ok", None
        detail = (result.meta or {}).get(ERROR_META_KEY)
    elif isinstance(result, types.InputRequiredResult):
        return "input_required", None  # a 2026-07-28 client is asked; its answer is a call of its own
    elif isinstance(result, dict):
        if result.get("resultType") == "input_required":
            return "input_required", None
        if not result.get("isError"):
            return "ok", None
        detail = (result.get("_meta") or {}).get(ERROR_META_KEY)
    else:
        return "ok", None
    code = detail.get("code") if isinstance(detail, dict) else None
    if isinstance(code, int):
        return ("refused" if code in REFUSED else "error"), code
    return "error", None  # the tool's own error (isError from the upstream)


def audit_of(gateway: Any) -> ToolAudit | None:
    """The gateway's one tool-call audit, made on first use (None: ``audit.tools`` is off)."""
    found = gateway.faces.get(AUDIT_KEY)
    if found is None:
        settings: AuditConfig = gateway.config.audit
        if not settings.tools:
            return None
        found = gateway.faces[AUDIT_KEY] = ToolAudit(gateway, settings)
        on_reload(gateway, found.reconfigure)  # audit: read again by a config reload
    return found if isinstance(found, ToolAudit) else None
