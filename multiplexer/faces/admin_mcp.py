"""`/admin/mcp/tools` (pinned MCP tools, what changed, approvals) and `/admin/audit/tools` (the
record of every MCP ``tools/call``), behind the admin key like every admin endpoint.

A tool's id is ``PROVIDER:TOOL`` (the provider's name in the config, the upstream's tool name).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from multiplexer.core.errors import Code, RpcError
from multiplexer.gateway.gateway import Gateway

log = logging.getLogger(__name__)
Routed = Callable[..., Route]  # admin_route with the gateway bound: (admin, path, endpoint, methods)
Error = Callable[..., JSONResponse]  # admin_error: (status, message, detail=None)

STATUSES = ("ok", "error", "refused", "input_required")
MAX_LIMIT = 1000


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def pinned(gateway: Gateway) -> dict[str, Any]:
    """Providers that pin their tools, by name (``providers/mcp.McpProvider`` with ``pin: true``)."""
    return {name: p for name, p in gateway.providers.items() if getattr(p, "pins", None) is not None}


def entry(provider: str, pin: Any, changes: list[tuple[Any, ...]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": f"{provider}:{pin.tool}", "provider": provider, "tool": pin.tool,
        "status": "quarantined" if pin.quarantined else "approved",
        "hash": pin.seen_hash, "approved_hash": pin.approved_hash, "updated_at": iso(pin.updated_at),
    }
    if pin.quarantined:
        out["diff"] = pin.diff()
    if changes is not None:
        out["changes"] = [{"at": iso(at), "action": action, "old_hash": old, "new_hash": new}
                          for at, action, old, new in changes]
    return out


def mount_tools(gateway: Gateway, admin: Any, route: Routed, error: Error) -> list[BaseRoute]:
    async def list_tools(request: Request) -> Response:
        status = request.query_params.get("status")
        if status not in (None, "quarantined", "approved"):
            return error(400, "status: quarantined or approved")
        out: list[dict[str, Any]] = []
        for name, provider in sorted(pinned(gateway).items()):
            pins = provider.pins
            for tool in sorted(pins.pins):
                pin = pins.pins[tool]
                if status is not None and (status == "quarantined") != pin.quarantined:
                    continue
                changes = None
                if pin.quarantined:
                    changes = await anyio.to_thread.run_sync(pins.tables.changes, name, tool)
                out.append(entry(name, pin, changes))
        return JSONResponse({"tools": out, "quarantined": sum(t["status"] == "quarantined" for t in out)})

    async def approve(request: Request) -> Response:
        tool_id = request.path_params["id"]
        name, sep, tool = tool_id.partition(":")
        provider = pinned(gateway).get(name)
        if not sep or provider is None:
            return error(404, f"no pinned MCP tool {tool_id!r} (ids are PROVIDER:TOOL; "
                              "GET /admin/mcp/tools lists them)")
        was = provider.pins.pins.get(tool)
        old = was.approved_hash if was is not None else None
        expected = await expected_hash(request)
        if was is not None and expected is not None and expected != was.seen_hash:
            return error(409, f"{tool_id} changed again since the definition you read (its hash is "
                              f"now {was.seen_hash}); read GET /admin/mcp/tools and approve that",
                         {"hash": was.seen_hash})
        pin = provider.approve_tool(tool)
        if pin is None:
            return error(404, f"MCP upstream {name!r} has no pinned tool {tool!r}")
        await provider.pins.flush()  # stored before the answer: other replicas read it from there
        await admin_audit(gateway, request, tool_id, old, pin.approved_hash)
        return JSONResponse(entry(name, pin))

    return [route(admin, "/admin/mcp/tools", list_tools, ["GET"]),
            route(admin, "/admin/mcp/tools/{id:path}/approve", approve, ["POST"])]


async def expected_hash(request: Request) -> str | None:
    """The hash the admin read (``{"hash": ...}``, optional): approved only if it is still served."""
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        raise RpcError(Code.INVALID_PARAMS, "the body: JSON, {\"hash\": \"<the hash you read>\"}") from None
    found = body.get("hash") if isinstance(body, dict) else None
    if found is not None and not isinstance(found, str):
        raise RpcError(Code.INVALID_PARAMS, "hash: a string")
    return found


async def admin_audit(gateway: Gateway, request: Request, tool_id: str, old: str | None,
                      new: str) -> None:
    """The approval in the admin audit log (``GET /admin/audit``) beside the keys' changes, where
    a key store is open; the pin's own change row is written either way."""
    store = gateway.keys.store
    if store is None or old == new:
        return
    from multiplexer.access.keystore import AuditRow

    named = request.headers.get("x-admin-actor", "").strip()
    actor = f"admin:{named[:100]}" if named else "admin"
    row = AuditRow(uuid.uuid4().hex, time.time(), actor, "mcp_tool.approve", tool_id,
                   {"old_hash": old, "new_hash": new})
    try:
        await store.run(store.record, row)
    except Exception as e:  # the approval stands; its admin audit row is what is lost
        log.warning("mcp tool approval: admin audit row not written: %s", str(e).splitlines()[0][:200])


def number(request: Request, name: str, kind: type[float] | type[int]) -> float | int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}: a number, got {raw!r}") from None


def mount_audit(gateway: Gateway, admin: Any, route: Routed, error: Error) -> list[BaseRoute]:
    async def audit(request: Request) -> Response:
        from multiplexer.faces.mcp.audit import audit_of

        found = audit_of(gateway)
        if found is None:
            return error(404, "the tool-call audit is off (audit.tools: false)")
        q = request.query_params
        status = q.get("status")
        if status is not None and status not in STATUSES:
            return error(400, f"status: one of {', '.join(STATUSES)}")
        try:
            since = number(request, "since", float)
            until = number(request, "until", float)
            cursor = number(request, "cursor", int)
            limit = number(request, "limit", int)
        except ValueError as e:
            return error(400, str(e))
        limit = 100 if limit is None else int(limit)
        if not 1 <= limit <= MAX_LIMIT:
            return error(400, f"limit: 1 to {MAX_LIMIT}")
        await found.sink.flush()  # what this gateway has queued is in the answer
        rows = await anyio.to_thread.run_sync(lambda: found.tables.audit(
            identity=q.get("key"), tool=q.get("tool"), status=status, since=since, until=until,
            before_id=None if cursor is None else int(cursor), limit=limit + 1))
        more = len(rows) > limit
        rows = rows[:limit]
        records = [{"id": r[0], "at": iso(r[1]), "ts": r[1], "key": r[2] or None, "server": r[3] or None,
                    "tool": r[4], "status": r[5], "code": r[6], "duration_ms": round(r[7], 3),
                    "args_hash": r[8], **({"arguments": json.loads(r[9])} if r[9] is not None else {})}
                   for r in rows]
        return JSONResponse({"records": records, "next_cursor": str(rows[-1][0]) if more else None})

    return [route(admin, "/admin/audit/tools", audit, ["GET"])]
