"""`/ui`: the dashboard's page, its JSON (`/ui/api/state`) and its stream (`/ui/api/stream`).

The page's files ship in the package (``static/``) and hold no data, so they are served without a
key; the JSON and the stream answer only the admin key (every panel) or a caller's key (its own
view: its jobs, its spend), each read one request of that key through the gateway's quota
decision (a stream is charged once, when it opens, and holds a concurrency slot of the key until
it ends; the admin key has no quota). Errors are the admin API's shape (429 when the key's quota
refuses). Without an admin key and without caller keys nothing is served but the files (the API
answers 404 saying how to turn it on). The page is sent with a Content-Security-Policy that lets it
run only its own files.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from multiplexer.access.admin import AdminKey
from multiplexer.core.errors import RpcError
from multiplexer.faces.access import note_of
from multiplexer.faces.admin import QuotaRefused, admin_error, refusal
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.ui.snapshot import Ticks, Who, encode, snapshot
from multiplexer.gateway.gateway import Gateway

INTERVAL_S = 0.5  # the streams' tick: two updates a second
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8",
         ".png": "image/png"}
NO_STORE = {"cache-control": "no-store"}
# the page runs only its own files: no inline script, nothing from elsewhere, never in a frame
PAGE_HEADERS = {"cache-control": "no-cache", "x-content-type-options": "nosniff",
                "content-security-policy": "default-src 'self'; script-src 'self'; frame-ancestors 'none'"}


def static_files() -> dict[str, tuple[bytes, str]]:
    """The page's files, read once: name -> (bytes, content type)."""
    out = {}
    for entry in resources.files("multiplexer.faces.ui").joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in TYPES:
            out[entry.name] = (entry.read_bytes(), TYPES[suffix])
    return out


class Held(StreamingResponse):
    """A stream that gives its key's request back (``release``) however it ends, once sent."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class Viewer:
    """Who asks: the admin (``None``) or a caller key's identity; raises the refusal otherwise."""

    def __init__(self, admin: AdminKey, auth: Authenticator) -> None:
        self.admin = admin
        self.auth = auth

    def __call__(self, request: Request) -> Who:
        authorization = request.headers.get("authorization")
        if self.admin.is_admin(authorization):
            return None
        if self.auth.enabled:
            identity = self.auth.identify(authorization)
            note = note_of(request.scope)
            if note is not None:
                note.key = identity
            return identity
        self.admin.check(authorization)  # 404 when no admin key is set, else 401
        raise AssertionError("unreachable: check refused")


def ui_routes(gateway: Gateway, admin: AdminKey, auth: Authenticator) -> list[BaseRoute]:
    files = static_files()
    viewer = Viewer(admin, auth)
    ticks = gateway.faces["ui"] = Ticks(gateway, INTERVAL_S)

    async def root(request: Request) -> Response:
        return RedirectResponse("/ui", status_code=307)

    async def page(request: Request) -> Response:
        body, kind = files["index.html"]
        return Response(body, media_type=kind, headers=PAGE_HEADERS)

    async def static(request: Request) -> Response:
        found = files.get(request.path_params["name"])
        if found is None:
            return admin_error(404, "no such file")
        return Response(found[0], media_type=found[1], headers={"cache-control": "no-cache"})

    async def state(request: Request) -> Response:
        try:
            who = viewer(request)
            async with gateway.quotas.held(who, QuotaRefused):
                snap = await snapshot(gateway, who is None, who)
        except QuotaRefused as e:
            return refusal(e.error)
        except RpcError as e:
            return refusal(e)
        return Response(encode(snap), media_type="application/json", headers=NO_STORE)

    async def stream(request: Request) -> Response:
        try:
            who = viewer(request)
            grant = await gateway.quotas.admit(who)  # charged once, its slot held while it is open
        except RpcError as e:
            return refusal(e)

        async def events() -> AsyncIterator[bytes]:
            async for body in ticks.stream(who):
                yield b"event: state\ndata: " + body + b"\n\n"

        return Held(events(), lambda: gateway.quotas.release(grant), media_type="text/event-stream",
                    headers={**NO_STORE, "x-accel-buffering": "no"})

    return [
        Route("/", root, methods=["GET"]),
        Route("/ui", page, methods=["GET"]),
        Route("/ui/static/{name}", static, methods=["GET"]),
        Route("/ui/api/state", state, methods=["GET"]),
        Route("/ui/api/stream", stream, methods=["GET"]),
    ]


def close_streams(gateway: Gateway) -> None:
    """End every open stream (the server is stopping), so none holds the shutdown's grace period."""
    ticks = gateway.faces.get("ui")
    if isinstance(ticks, Ticks):
        ticks.close()
