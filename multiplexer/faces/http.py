"""The HTTP face: ``/rpc``, ``/healthz``, ``/readyz``, ``/metrics`` (and ``/mcp`` when mounted)."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from multiplexer.access.admin import AdminKey
from multiplexer.core.errors import Code, RpcError, body_too_large
from multiplexer.core.json_codec import dumps
from multiplexer.core.jsonrpc import error_response
from multiplexer.core.tracing import http_trace
from multiplexer.faces.access import Access, AccessLog, Note, note_of
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.body import BodyTooLarge, ClientGone, headers_over, read_body
from multiplexer.faces.disconnect import cancelled_on_disconnect
from multiplexer.faces.not_allowed import method_not_allowed
from multiplexer.faces.probe_access import ProbeAccess, ScrapeRefused
from multiplexer.faces.ready import for_anyone, readiness
from multiplexer.faces.reply import JSON_HEADERS, DirectEndpoint, Headers, Reply
from multiplexer.faces.rpc import handle_body
from multiplexer.faces.unexpected import unexpected
from multiplexer.gateway.gateway import Gateway


def rpc_error(status: int, error: RpcError, headers: Headers | None = None) -> Reply:
    return Reply(status, dumps(error_response(None, error)), [*JSON_HEADERS, *(headers or [])])


def too_large(limit: int, content_length: bytes | str | None) -> Reply:
    return rpc_error(413, body_too_large(limit, content_length))


def unauthorized(error: RpcError) -> Reply:
    return rpc_error(401, error, [(b"www-authenticate", b'Bearer realm="multiplexer"')])


def rate_limited(error: RpcError) -> Reply:
    data = error.data if isinstance(error.data, dict) else {}
    wait = max(1, math.ceil(data.get("retry_after") or 1))
    return rpc_error(429, error, [(b"retry-after", str(wait).encode())])


NO_CONTENT = Reply(204)


class RpcEndpoint:
    """``POST /rpc``: called directly by the gateway's own server (``direct``: the body is
    whole, the reply one write) and as a bare ASGI app under any other."""

    def __init__(self, gateway: Gateway, auth: Authenticator) -> None:
        self.gateway = gateway
        self.auth = auth
        self.limit = gateway.config.server.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        note = note_of(scope)
        try:
            identity = self._identify(headers, note)
        except RpcError as e:
            await unauthorized(e)(scope, receive, send)
            return
        try:
            body = await read_body(headers.get(b"content-length"), receive, self.limit)
        except BodyTooLarge:
            await too_large(self.limit, headers.get(b"content-length"))(scope, receive, send)
            return
        except ClientGone:
            return
        reply = NO_CONTENT  # if the client goes away first, its calls are cancelled
        async with cancelled_on_disconnect(scope, receive):
            reply = await self._answer(headers, body, identity, note)
        await reply(scope, receive, send)

    async def direct(self, scope: Scope, body: bytes) -> Reply:
        """The reply to a whole body; the server cancels this if the client goes away."""
        headers = dict(scope["headers"])
        note = note_of(scope)
        try:
            identity = self._identify(headers, note)
        except RpcError as e:
            return unauthorized(e)
        return await self._answer(headers, body, identity, note)

    def _identify(self, headers: dict[bytes, bytes], note: Note | None) -> str | None:
        auth = headers.get(b"authorization")
        try:
            identity = self.auth.identify(auth.decode("latin-1") if auth else None)
        except RpcError as e:
            if note is not None:
                note.code = e.code
            raise
        if note is not None:
            note.key = identity
        return identity

    async def _answer(self, headers: dict[bytes, bytes], body: bytes, identity: str | None,
                      note: Note | None) -> Reply:
        trace = http_trace(headers) if self.gateway.tracer.enabled else None
        try:
            reply = await handle_body(self.gateway, body, identity, trace, note)
        except Exception as e:  # a bug: a JSON-RPC error object, never a bare 500
            return rpc_error(500, unexpected(self.gateway, "POST /rpc", e))
        return NO_CONTENT if reply is None else Reply(200, reply, JSON_HEADERS)


def as_response(reply: Reply) -> Response:
    """A ``Reply`` where a Starlette endpoint must return a ``Response``."""
    return Response(reply.body, reply.status, {k.decode(): v.decode() for k, v in reply.headers})


def build_routes(gateway: Gateway, auth: Authenticator, probes: ProbeAccess) -> list[BaseRoute]:

    async def healthz(request: Request) -> Response:
        lanes = {
            lane.name: {"queued": len(lane.queue), "in_flight": lane.in_flight}
            for lane in gateway.lanes.values()
        }
        status = "shutting_down" if gateway.closing else "ok"
        body: dict[str, object] = {"status": status, "lanes": lanes}
        siblings = gateway.faces.get("workers")
        if siblings is not None:  # serve --workers N: which worker answered
            body["worker"] = {"index": siblings.slot.index, "pid": os.getpid()}
        return JSONResponse(body, status_code=503 if gateway.closing else 200)

    async def readyz(request: Request) -> Response:
        siblings = gateway.faces.get("workers")  # serve --workers N: every worker's readiness
        status, body = await (siblings.readiness() if siblings else readiness(gateway))
        if not probes.readiness_details(request.headers.get("authorization")):
            body = for_anyone(body)
        return JSONResponse(body, status_code=status)

    async def exposition() -> bytes:
        siblings = gateway.faces.get("workers")  # serve --workers N: every worker's, summed
        if siblings is not None:
            return await siblings.metrics()  # type: ignore[no-any-return]
        await gateway.metrics.refresh()
        return gateway.metrics.render()

    async def metrics(request: Request) -> Response:
        try:
            who = probes.check_metrics(request.headers.get("authorization"))
        except RpcError as e:
            return as_response(unauthorized(e))
        if who is None:
            text = await exposition()
        else:
            try:
                async with gateway.quotas.held(who, ScrapeRefused):
                    text = await exposition()
            except ScrapeRefused as e:
                return as_response(rate_limited(e.error))
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/rpc", RpcEndpoint(gateway, auth), methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


Mount = Callable[[Gateway, Authenticator], Awaitable[tuple[list[BaseRoute], Any]]]


def create_app(gateway: Gateway, extra_routes: list[BaseRoute] | None = None,
               lifespan: Any = None, auth: Authenticator | None = None, *,
               admin: AdminKey | None = None, public: bool = False) -> ASGIApp:
    """``/rpc``, ``/healthz``, ``/readyz``, ``/metrics`` and ``extra_routes``; ``auth`` is the one
    the other faces were given (made from the config's keys when none is), ``admin`` the admin
    key's; ``public``: bound to a non-loopback address (``/metrics`` then asks for a key)."""
    server = gateway.config.server
    auth = auth or Authenticator(server.api_keys)
    probes = ProbeAccess(auth, admin or AdminKey(server.admin_key),
                         metrics_public=server.metrics_public, public=public)
    routes = build_routes(gateway, auth, probes) + list(extra_routes or [])
    starlette = Starlette(routes=routes, lifespan=lifespan,
                          exception_handlers={405: method_not_allowed})  # JSON in the face's shape
    app = HeaderLimit(ExactPaths(starlette, routes), server.max_header_bytes)
    return Access(app, AccessLog(server, gateway.metrics, routes))


class ExactPaths:
    """Requests to a fixed path served by a bare ASGI endpoint (``/rpc``, ``/v1/chat/completions``,
    ``/mcp``, ...) go straight to it; the rest (path parameters, plain functions, 404s, 405s,
    lifespan) through Starlette. Its middleware stack and router walk cost about a tenth of the
    gateway's CPU on a small call, and these endpoints need neither. ``direct``: the endpoints
    that the gateway's own server may call without ASGI (those with a ``direct`` method)."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]) -> None:
        self.app = app
        self.table: dict[tuple[str, str], ASGIApp] = {}
        self.direct: dict[tuple[str, str], DirectEndpoint] = {}
        for route in routes:
            if (isinstance(route, Route) and "{" not in route.path and route.methods
                    and not inspect.isfunction(route.endpoint) and not inspect.ismethod(route.endpoint)):
                for method in route.methods:
                    self.table.setdefault((route.path, method), route.app)
                    if isinstance(route.endpoint, DirectEndpoint):
                        self.direct.setdefault((method, route.path), route.endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.table.get((scope["path"], scope["method"]))
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeaderLimit:
    """Refuse requests whose headers exceed the limit (HTTP 431), before any route runs.

    Right inside ``Access``: ``direct`` and ``max_header_bytes`` tell the gateway's own server
    which endpoints it may call directly, and where it must leave a request to this check."""

    def __init__(self, app: ExactPaths, limit: int) -> None:
        self.app = app
        self.max_header_bytes = limit
        self.direct = app.direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and headers_over(scope["headers"], self.max_header_bytes):
            error = RpcError(Code.TOO_LARGE, f"Request headers too large: over the limit of "
                             f"{self.max_header_bytes:,} bytes or 200 lines (server.max_header_bytes)",
                             {"max_header_bytes": self.max_header_bytes})
            await rpc_error(431, error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
