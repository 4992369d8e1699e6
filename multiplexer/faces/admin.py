"""`/admin/...`: the operator's API, every endpoint behind the admin key.

Rooms add their endpoints with ``admin_route``; ``admin_routes`` mounts what the gateway has. Each
request is one of the admin key's through the gateway's quota decision, as every other request is
one of its key's. An admin answer and its errors are JSON in one shape,
``{"error": {"message", "type", "code"}}``."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from multiplexer.access.admin import AdminKey
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.version import VERSION
from multiplexer.faces.spend import spend_endpoint
from multiplexer.gateway.gateway import Gateway

Endpoint = Callable[[Request], Awaitable[Response]]
STATUS: dict[int, int] = {Code.NOT_FOUND: 404, Code.UNAUTHORIZED: 401, Code.INVALID_PARAMS: 400,
                          Code.RATE_LIMITED: 429}
TYPES = {404: "not_found", 401: "unauthorized", 400: "invalid_request", 403: "forbidden",
         409: "conflict", 429: "rate_limited", 503: "unavailable"}


def admin_error(status: int, message: str, detail: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"message": message, "type": TYPES.get(status, "error"), "code": status}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse({"error": body}, status_code=status)


def refusal(error: RpcError) -> JSONResponse:
    status = STATUS.get(error.code, 400)
    data = error.data if isinstance(error.data, dict) else {}
    detail = data.get("detail")
    if status == 429:  # a key's quota: which limit, as the other faces say it
        detail = f"{error.message}: {data.get('limit')}"
    response = admin_error(status, detail or error.message)
    if status == 401:
        response.headers["www-authenticate"] = "Bearer"
    if status == 429:
        response.headers["retry-after"] = str(max(1, math.ceil(data.get("retry_after") or 1)))
    return response


class QuotaRefused(Exception):
    """A read refused by its key's quota (``Quotas.held``), answered as ``refusal`` shapes it."""

    def __init__(self, error: RpcError) -> None:
        super().__init__(error.message)
        self.error = error


def guarded(admin: AdminKey, endpoint: Endpoint, gateway: Gateway | None = None) -> Endpoint:
    """``endpoint`` answered only for the admin key, as one request of it through the gateway's
    quota decision (the admin key has no quota, so it is counted, never refused); a JSON-RPC
    error raised inside it (bad input) becomes the admin API's 400."""

    async def run(request: Request) -> Response:
        try:
            admin.check(request.headers.get("authorization"))
        except RpcError as e:
            return refusal(e)
        try:
            if gateway is None:
                return await endpoint(request)
            async with gateway.quotas.held(None, QuotaRefused):
                return await endpoint(request)
        except QuotaRefused as e:
            return refusal(e.error)
        except RpcError as e:
            return refusal(e)

    return run


def admin_route(admin: AdminKey, path: str, endpoint: Endpoint, methods: list[str],
                gateway: Gateway | None = None) -> Route:
    """An admin endpoint; with ``gateway``, each request is one of the admin key's in its quota
    decision (``guarded``)."""
    assert path.startswith("/admin/"), path
    return Route(path, guarded(admin, endpoint, gateway), methods=methods)


# Each room that serves admin endpoints: (gateway, admin key) -> its routes.
Mounts = list[Callable[[Gateway, AdminKey], list[BaseRoute]]]


def _status(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    async def whoami(request: Request) -> Response:
        return JSONResponse({"admin": True, "version": VERSION})

    return [admin_route(admin, "/admin/whoami", whoami, ["GET"], gateway)]


def _keys(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    from multiplexer.faces.admin_keys import mount_keys

    return mount_keys(gateway, admin, functools.partial(admin_route, gateway=gateway), admin_error)


def _spend(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    return [admin_route(admin, "/admin/spend", spend_endpoint(gateway), ["GET"], gateway)]


def _reload(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    from multiplexer.faces.admin_reload import mount_reload

    return mount_reload(gateway, admin, functools.partial(admin_route, gateway=gateway), admin_error)


def _mcp_tools(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    from multiplexer.faces.admin_mcp import mount_audit, mount_tools

    route = functools.partial(admin_route, gateway=gateway)
    return mount_tools(gateway, admin, route, admin_error) + mount_audit(gateway, admin, route, admin_error)


def _cache(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    from multiplexer.faces.admin_cache import mount_cache

    return mount_cache(gateway, admin, functools.partial(admin_route, gateway=gateway), admin_error)


MOUNTS: Mounts = [_status, _keys, _spend, _mcp_tools, _reload, _cache]


def admin_routes(gateway: Gateway, admin: AdminKey) -> list[BaseRoute]:
    return [route for mount in MOUNTS for route in mount(gateway, admin)]
