"""The HTTP face: ``/rpc``, ``/healthz``, ``/metrics`` (and ``/mcp`` when mounted)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.jsonrpc import dumps, error_response
from multiplexer.core.tracing import http_trace
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.body import BodyTooLarge, ClientGone, read_body
from multiplexer.faces.disconnect import cancelled_on_disconnect
from multiplexer.faces.rpc import handle_body
from multiplexer.gateway.gateway import Gateway

JSON = "application/json"


def rpc_error(status: int, error: RpcError, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(error_response(None, error)), status, headers, media_type=JSON)


def too_large(limit: int) -> Response:
    return rpc_error(413, RpcError(Code.TOO_LARGE, "Request body too large",
                                   {"max_body_bytes": limit}))


def unauthorized(error: RpcError) -> Response:
    return rpc_error(401, error, {"WWW-Authenticate": 'Bearer realm="multiplexer"'})


class RpcEndpoint:
    """``POST /rpc`` as a bare ASGI app: the hot path skips request/response wrappers."""

    def __init__(self, gateway: Gateway, auth: Authenticator) -> None:
        self.gateway = gateway
        self.auth = auth
        self.limit = gateway.config.server.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        try:
            auth = headers.get(b"authorization")
            identity = self.auth.identify(auth.decode("latin-1") if auth else None)
        except RpcError as e:
            await unauthorized(e)(scope, receive, send)
            return
        try:
            body = await read_body(headers.get(b"content-length"), receive, self.limit)
        except BodyTooLarge:
            await too_large(self.limit)(scope, receive, send)
            return
        except ClientGone:
            return
        trace = http_trace(headers) if self.gateway.tracer.enabled else None
        reply = await self._run(scope, receive, body, identity, trace)
        if reply is None:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(reply)).encode()),
        ]})
        await send({"type": "http.response.body", "body": reply})

    async def _run(self, scope: Scope, receive: Receive, body: bytes, identity: str | None,
                   trace: dict[str, str] | None) -> bytes | None:
        """Run the calls; if the client goes away first, cancel them (and so their upstream work)."""
        reply: bytes | None = None
        async with cancelled_on_disconnect(scope, receive):
            reply = await handle_body(self.gateway, body, identity, trace)
        return reply


def build_routes(gateway: Gateway, auth: Authenticator) -> list[BaseRoute]:

    async def healthz(request: Request) -> Response:
        lanes = {
            lane.name: {"queued": len(lane.queue), "in_flight": lane.in_flight}
            for lane in gateway.lanes.values()
        }
        status = "shutting_down" if gateway.closing else "ok"
        return JSONResponse({"status": status, "lanes": lanes},
                            status_code=503 if gateway.closing else 200)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/rpc", RpcEndpoint(gateway, auth), methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


Mount = Callable[[Gateway, Authenticator], Awaitable[tuple[list[BaseRoute], Any]]]


def create_app(gateway: Gateway, extra_routes: list[BaseRoute] | None = None,
               lifespan: Any = None, auth: Authenticator | None = None) -> ASGIApp:
    """``/rpc``, ``/healthz``, ``/metrics`` and ``extra_routes``; ``auth`` is the one the other
    faces were given (made from the config's keys when none is)."""
    auth = auth or Authenticator(gateway.config.server.api_keys)
    routes = build_routes(gateway, auth) + list(extra_routes or [])
    limit = gateway.config.server.max_header_bytes
    return HeaderLimit(ExactPaths(Starlette(routes=routes, lifespan=lifespan), routes), limit)


class ExactPaths:
    """Requests to a fixed path served by a bare ASGI endpoint (``/rpc``, ``/v1/chat/completions``,
    ``/mcp``, ...) go straight to it; the rest (path parameters, plain functions, 404s, 405s,
    lifespan) through Starlette. Its middleware stack and router walk cost about a tenth of the
    gateway's CPU on a small call, and these endpoints need neither."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]) -> None:
        self.app = app
        self.table: dict[tuple[str, str], ASGIApp] = {}
        for route in routes:
            if (isinstance(route, Route) and "{" not in route.path and route.methods
                    and not inspect.isfunction(route.endpoint) and not inspect.ismethod(route.endpoint)):
                for method in route.methods:
                    self.table.setdefault((route.path, method), route.app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.table.get((scope["path"], scope["method"]))
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeaderLimit:
    """Refuse requests whose headers exceed the limit (HTTP 431), before any route runs."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.limit or len(scope["headers"]) > 200:
                error = RpcError(Code.TOO_LARGE, "Request headers too large",
                                 {"max_header_bytes": self.limit})
                await rpc_error(431, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
