"""The HTTP face: ``/rpc``, ``/healthz``, ``/metrics`` (and ``/mcp`` when mounted)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from .auth import Authenticator
from .errors import Code, RpcError
from .gateway import Gateway
from .jsonrpc import dumps, error_response
from .service import handle_body

JSON = "application/json"


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def rpc_error(status: int, error: RpcError, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(error_response(None, error)), status, headers, media_type=JSON)


def too_large(limit: int) -> Response:
    return rpc_error(413, RpcError(Code.TOO_LARGE, "Request body too large",
                                   {"max_body_bytes": limit}))


def unauthorized(error: RpcError) -> Response:
    return rpc_error(401, error, {"WWW-Authenticate": 'Bearer realm="multiplexer"'})


async def _cancel_on_disconnect(request: Request, work: Awaitable[bytes | None]) -> bytes | None:
    """Run ``work``; if the client goes away first, cancel it (and so its calls upstream)."""
    reply: bytes | None = None

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        reply = await work
        tg.cancel_scope.cancel()
    return reply


def build_routes(gateway: Gateway, auth: Authenticator) -> list[BaseRoute]:
    server = gateway.config.server

    async def rpc(request: Request) -> Response:
        try:
            identity = auth.identify(request.headers.get("authorization"))
        except RpcError as e:
            return unauthorized(e)
        try:
            body = await read_body(request, server.max_body_bytes)
        except BodyTooLarge:
            return too_large(server.max_body_bytes)
        reply = await _cancel_on_disconnect(request, handle_body(gateway, body, identity))
        if reply is None:
            return Response(status_code=204)
        return Response(reply, media_type=JSON)

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
        Route("/rpc", rpc, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


Mount = Callable[[Gateway, Authenticator], Awaitable[tuple[list[BaseRoute], Any]]]


def create_app(gateway: Gateway, extra_routes: list[BaseRoute] | None = None,
               lifespan: Any = None) -> Starlette:
    auth = Authenticator(gateway.config.server.api_keys)
    routes = build_routes(gateway, auth) + list(extra_routes or [])
    return Starlette(routes=routes, lifespan=lifespan)
