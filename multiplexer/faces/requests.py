"""The request log's endpoints: ``GET /admin/requests`` and ``GET /admin/requests/{id}`` for the
admin key (every caller's calls), and ``GET /ui/api/requests`` and ``/ui/api/requests/{id}`` for
the dashboard (the admin key: every call; a caller's key: its own calls only, whatever it asks),
whose page is ``/ui/requests`` (its files hold no data and are served without a key).

A listing takes ``key``, ``team``, ``route``, ``model`` (the model that served it), ``status``
(``ok``, ``error`` or an error code), ``request_id``, ``batch_id`` (a batch's or a job's lines),
``since`` and ``until`` (epoch seconds or ISO 8601 times; ``since`` included, ``until`` not),
``error`` (text in the error message), ``limit`` (1-500, default 50) and ``cursor`` (a page's
``next_cursor``); newest first. A page whose filters no one index holds stops after reading a few
thousand rows and says how far back it searched (``searched_to``); its cursor goes on. One record
adds ``path``: the call's admission, lane, batch, attempts, cost and timeline. Each request is one
of its key's through the gateway's quota decision; errors are the admin API's shape."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from multiplexer.access.admin import AdminKey
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.faces.admin import QuotaRefused, admin_error, admin_route, refusal
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.ui.face import NO_STORE, PAGE_HEADERS, Viewer, static_files
from multiplexer.gateway.gateway import Gateway
from multiplexer.records.request_store import FILTERS, Query
from multiplexer.records.requests import RequestLog, parse_cursor

log = logging.getLogger(__name__)
MAX_LIMIT = 500
PARAMS = {*FILTERS, "request_id", "batch_id", "since", "until", "error", "limit", "cursor"}


def _when(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
        raise invalid_params(f"{name} must be a finite time")
    try:
        at = datetime.fromisoformat(raw)
    except ValueError:
        raise invalid_params(f"{name} must be epoch seconds or an ISO 8601 time "
                             f"(2026-12-01T10:00:00Z), not {raw[:64]!r}") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.timestamp()


def query_of(params: Any, own: str | None) -> Query:
    """A listing's query from its parameters; ``own``: a caller's identity (only its calls)."""
    unknown = sorted(set(params.keys()) - PARAMS)
    if unknown:
        raise invalid_params(f"unknown parameter {unknown[0][:64]!r}; "
                             f"these filter: {', '.join(sorted(PARAMS))}")
    q = Query()
    for name in ("key", "team", "route", "model", "request_id", "batch_id", "error"):
        value = params.get(name)
        if value not in (None, ""):
            if len(value) > 200:
                raise invalid_params(f"{name} is longer than 200 characters")
            setattr(q, name, value)
    status = params.get("status")
    if status not in (None, ""):
        if status in ("ok", "error"):
            q.status = status
        else:
            try:
                q.code = int(status)
            except ValueError:
                raise invalid_params(f"status is ok, error or an error code, not {status[:64]!r}") from None
    for name in ("since", "until"):
        raw = params.get(name)
        if raw not in (None, ""):
            setattr(q, name, _when(name, raw))
    raw = params.get("limit")
    if raw not in (None, ""):
        try:
            q.limit = int(raw)
        except ValueError:
            q.limit = 0
        if not 1 <= q.limit <= MAX_LIMIT:
            raise invalid_params(f"limit is a whole number from 1 to {MAX_LIMIT}")
    raw = params.get("cursor")
    if raw not in (None, ""):
        try:
            q.cursor = parse_cursor(raw)
        except ValueError:
            raise invalid_params("cursor is a page's next_cursor, as it was given") from None
    if own is not None:
        q.key = own
    return q


def _log(gateway: Gateway) -> RequestLog:
    if gateway.requests is None:
        raise RpcError(Code.NOT_FOUND, "Not found", {"detail": "the request log is off (log.enabled: false)"})
    return gateway.requests


def _row_id(request: Request) -> int:
    raw = request.path_params["request_id"]
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 < value < 2**63:
        raise RpcError(Code.NOT_FOUND, "Not found", {"detail": "no such request record"})
    return value


async def listing(gateway: Gateway, request: Request, own: str | None) -> Response:
    q = query_of(request.query_params, own)
    try:
        found = await _log(gateway).page(q)
    except RpcError:
        raise
    except Exception:
        return _unreadable()
    return JSONResponse(found, headers=NO_STORE)


def _unreadable() -> Response:
    log.exception("the request log could not be read")
    return admin_error(503, "the request log's store could not be read; the gateway's log says why")


async def one(gateway: Gateway, request: Request, own: str | None) -> Response:
    try:
        row = await _log(gateway).get(_row_id(request))
    except RpcError:
        raise
    except Exception:
        return _unreadable()
    if row is None or (own is not None and row.get("key") != own):
        raise RpcError(Code.NOT_FOUND, "Not found", {"detail": "no such request record"})
    return JSONResponse(row, headers=NO_STORE)


def request_routes(gateway: Gateway, admin: AdminKey, auth: Authenticator, *, ui: bool) -> list[BaseRoute]:
    """The admin endpoints, and with the dashboard (``ui``) its key-scoped JSON."""

    async def admin_list(request: Request) -> Response:
        return await listing(gateway, request, None)

    async def admin_one(request: Request) -> Response:
        return await one(gateway, request, None)

    routes: list[BaseRoute] = [
        admin_route(admin, "/admin/requests", admin_list, ["GET"], gateway),
        admin_route(admin, "/admin/requests/{request_id}", admin_one, ["GET"], gateway)]
    if not ui:
        return routes
    viewer = Viewer(admin, auth)
    page_body, page_type = static_files()["requests.html"]

    async def page(request: Request) -> Response:
        return Response(page_body, media_type=page_type, headers=PAGE_HEADERS)

    def scoped(answer: Any) -> Any:
        async def run(request: Request) -> Response:
            try:
                who = viewer(request)
                async with gateway.quotas.held(who, QuotaRefused):
                    return await answer(gateway, request, who)
            except QuotaRefused as e:
                return refusal(e.error)
            except RpcError as e:
                return refusal(e)
        return run

    routes += [Route("/ui/requests", page, methods=["GET"]),  # the page: no data, no key
               Route("/ui/api/requests", scoped(listing), methods=["GET"]),
               Route("/ui/api/requests/{request_id}", scoped(one), methods=["GET"])]
    return routes
