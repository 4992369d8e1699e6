"""``/admin/keys``, ``/admin/teams``, ``/admin/audit`` and ``/admin/openapi.json``: keys and teams
as data, over HTTP. The work is ``access.admin_ops.KeyAdmin``'s; this maps it to JSON and statuses,
and describes itself as OpenAPI from the same pydantic models that validate the bodies."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from multiplexer.access.admin import AdminKey
from multiplexer.access.admin_ops import Conflict, KeyAdmin
from multiplexer.access.api import (
    AuditOut,
    KeyCreated,
    KeyIn,
    KeyOut,
    KeyPatch,
    Listing,
    McpServerIn,
    McpServerOut,
    McpServerPatch,
    Rotated,
    RotateIn,
    TeamIn,
    TeamOut,
    TeamPatch,
)
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.core.jsonrpc import is_unicode
from multiplexer.core.version import VERSION
from multiplexer.gateway.gateway import Gateway

log = logging.getLogger(__name__)
OFF = "the key store is off (server.key_store.enabled: false)"
ACTOR_HEADER = "x-admin-actor"


def _json(model: BaseModel | list[Any], status: int = 200) -> Response:
    if isinstance(model, list):
        body: Any = {"object": "list", "data": [m.model_dump(mode="json") for m in model]}
    else:
        body = model.model_dump(mode="json")
    return JSONResponse(body, status_code=status)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _storable(value: Any, where: str = "body") -> None:
    """Raise for a value the store cannot keep, named by its place: a number too large to be
    finite (``1e999``) or a string with a lone surrogate (``"\\ud800"``, not UTF-8)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid_params(f"{where}: the number is out of range")
    if isinstance(value, str) and not is_unicode(value):
        raise invalid_params(f"{where}: the string is not Unicode text (a lone surrogate)")
    if isinstance(value, dict):
        for k, v in value.items():
            _storable(k, where)
            _storable(v, f"{where}.{k}" if where != "body" else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _storable(v, f"{where}.{i}")


async def _body(request: Request, model: type[Any]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_no_constant) if raw.strip() else {}
    except ValueError as e:
        raise invalid_params(f"the body is not JSON: {e}") from None
    _storable(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise invalid_params(f"{where}: {first['msg']}") from None


def _actor(request: Request) -> str:
    """Who, as the admin key's holder names themselves (the CLI sends the user's name)."""
    named = request.headers.get(ACTOR_HEADER, "").strip()
    return f"admin:{named[:100]}" if named else "admin"


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "100")
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise invalid_params("limit must be an integer from 1 to 1000", param="limit")
    return int(raw)


Handler = Callable[[KeyAdmin, Request], Awaitable[Response]]


def mount_keys(gateway: Gateway, admin: AdminKey, admin_route: Callable[..., BaseRoute],
               admin_error: Callable[..., Response]) -> list[BaseRoute]:
    """The routes, made with the admin face's guard (``admin_route``) and error body (``admin_error``)."""
    def with_ops(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            ops = gateway.keys.admin
            if ops is None:
                return admin_error(404, OFF)
            try:
                return await handler(ops, request)
            except Conflict as e:
                return admin_error(409, str(e))
            except RpcError as e:
                if e.code == Code.NOT_FOUND:
                    return admin_error(404, (e.data or {}).get("detail", e.message))
                raise
            except Exception as e:  # the store failed: the change may not have happened
                log.warning("admin %s %s failed: %s", request.method, request.url.path,
                            str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                return admin_error(503, "the key store is unreachable; try again")

        return run

    async def create_key(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.create_key(await _body(request, KeyIn), _actor(request)), 201)

    async def list_keys(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.list_keys(request.query_params.get("team")))

    async def show_key(ops: KeyAdmin, request: Request) -> Response:
        from multiplexer.access.admin_ops import key_out

        return _json(key_out(await ops.key(request.path_params["id"])))

    async def update_key(ops: KeyAdmin, request: Request) -> Response:
        patch = await _body(request, KeyPatch)
        return _json(await ops.update_key(request.path_params["id"], patch, _actor(request)))

    async def rotate_key(ops: KeyAdmin, request: Request) -> Response:
        body = await _body(request, RotateIn)
        return _json(await ops.rotate_key(request.path_params["id"], body, _actor(request)))

    async def revoke_key(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.revoke_key(request.path_params["id"], _actor(request)))

    async def create_team(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.create_team(await _body(request, TeamIn), _actor(request)), 201)

    async def list_teams(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.list_teams())

    async def update_team(ops: KeyAdmin, request: Request) -> Response:
        patch = await _body(request, TeamPatch)
        return _json(await ops.update_team(request.path_params["id"], patch, _actor(request)))

    async def create_server(ops: KeyAdmin, request: Request) -> Response:
        body = await _body(request, McpServerIn)
        made = await ops.create_server(body, _actor(request), set(gateway.config.mcp_servers))
        return _json(made, 201)

    async def list_servers(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.list_servers())

    async def update_server(ops: KeyAdmin, request: Request) -> Response:
        patch = await _body(request, McpServerPatch)
        return _json(await ops.update_server(request.path_params["id"], patch, _actor(request)))

    async def delete_server(ops: KeyAdmin, request: Request) -> Response:
        await ops.delete_server(request.path_params["id"], _actor(request))
        return JSONResponse({"id": request.path_params["id"], "deleted": True})

    async def audit(ops: KeyAdmin, request: Request) -> Response:
        return _json(await ops.audit(_limit(request), request.query_params.get("target")))

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document())

    def route(path: str, handler: Handler, method: str) -> BaseRoute:
        return admin_route(admin, path, with_ops(handler), [method])

    return [
        route("/admin/keys", create_key, "POST"),
        route("/admin/keys", list_keys, "GET"),
        route("/admin/keys/{id}", show_key, "GET"),
        route("/admin/keys/{id}", update_key, "PATCH"),
        route("/admin/keys/{id}/rotate", rotate_key, "POST"),
        route("/admin/keys/{id}", revoke_key, "DELETE"),
        route("/admin/teams", create_team, "POST"),
        route("/admin/teams", list_teams, "GET"),
        route("/admin/teams/{id}", update_team, "PATCH"),
        route("/admin/mcp-servers", create_server, "POST"),
        route("/admin/mcp-servers", list_servers, "GET"),
        route("/admin/mcp-servers/{id}", update_server, "PATCH"),
        route("/admin/mcp-servers/{id}", delete_server, "DELETE"),
        route("/admin/audit", audit, "GET"),
        admin_route(admin, "/admin/openapi.json", openapi, ["GET"]),
    ]


class Deleted(BaseModel):
    id: str
    deleted: bool


# (method, path, summary, request model, status, response model, listed)
OPERATIONS: list[tuple[str, str, str, type[BaseModel] | None, int, type[BaseModel], bool]] = [
    ("post", "/admin/keys", "Create a key (the only answer that shows it)", KeyIn, 201, KeyCreated, False),
    ("get", "/admin/keys", "List keys (?team=)", None, 200, KeyOut, True),
    ("get", "/admin/keys/{id}", "Show a key", None, 200, KeyOut, False),
    ("patch", "/admin/keys/{id}", "Update a key", KeyPatch, 200, KeyOut, False),
    ("post", "/admin/keys/{id}/rotate", "Rotate a key; the old one stays valid for the grace period",
     RotateIn, 200, Rotated, False),
    ("delete", "/admin/keys/{id}", "Revoke a key", None, 200, KeyOut, False),
    ("post", "/admin/teams", "Create a team", TeamIn, 201, TeamOut, False),
    ("get", "/admin/teams", "List teams", None, 200, TeamOut, True),
    ("patch", "/admin/teams/{id}", "Update a team's defaults", TeamPatch, 200, TeamOut, False),
    ("post", "/admin/mcp-servers", "Create a virtual MCP server at /mcp/{name}", McpServerIn, 201,
     McpServerOut, False),
    ("get", "/admin/mcp-servers", "List the virtual MCP servers made here", None, 200, McpServerOut, True),
    ("patch", "/admin/mcp-servers/{id}", "Change a virtual MCP server's tools, keys or teams",
     McpServerPatch, 200, McpServerOut, False),
    ("delete", "/admin/mcp-servers/{id}", "Delete a virtual MCP server", None, 200, Deleted, False),
    ("get", "/admin/audit", "Admin actions, newest first (?limit=, ?target=)", None, 200, AuditOut, True),
]


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 of the admin API, its schemas generated from the pydantic models."""
    models = {m for op in OPERATIONS for m in (op[3], op[5]) if m is not None} | {Listing}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template="#/components/schemas/{model}")
    error = {"description": "an error: {\"error\": {\"message\", \"type\", \"code\"}}"}
    paths: dict[str, Any] = {}
    for method, path, summary, body, status, out, listed in OPERATIONS:
        ref = {"$ref": f"#/components/schemas/{out.__name__}"}
        listing = {"type": "object", "properties": {"object": {"const": "list"},
                                                     "data": {"type": "array", "items": ref}}}
        schema = listing if listed else ref
        op: dict[str, Any] = {
            "summary": summary, "security": [{"masterKey": []}],
            "responses": {str(status): {"description": "ok", "content": {
                "application/json": {"schema": schema}}}, "400": error, "401": error, "404": error},
        }
        if method in ("post", "patch"):  # a name taken, or a change to a revoked key
            op["responses"]["409"] = error
        if "{id}" in path:
            op["parameters"] = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "multiplexer admin API", "version": VERSION},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"masterKey": {"type": "http", "scheme": "bearer",
                                                         "description": "server.admin_key or "
                                                         "MULTIPLEXER_MASTER_KEY"}}},
    }
