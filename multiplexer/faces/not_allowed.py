"""Starlette's 405 (a path served here, asked with another method) as JSON in the shape of the face
that owns the path, with its ``Allow`` header: an SDK or a script reads an error it understands
and the method to send, never a text/plain ``Method Not Allowed``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from multiplexer.core.errors import Code, RpcError


def allowed(request: Request, exc: Exception) -> list[str]:
    """Every method the path is served for: Starlette's ``Allow`` names only the first route that
    matched the path, and ``/admin/keys`` is one route for GET and another for POST."""
    methods = set()
    for route in getattr(request.app, "routes", ()):
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] == Match.PARTIAL:
            methods |= route.methods
    if not methods:
        headers = getattr(exc, "headers", None) or {}
        methods = {m.strip() for m in headers.get("Allow", "").split(",") if m.strip()}
    return sorted(methods)


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    methods = allowed(request, exc)
    path = request.url.path
    fix = f"; send {' or '.join(m for m in methods if m != 'HEAD')}" if methods else ""
    message = f"Method Not Allowed: {request.method} {path}{fix}"
    return JSONResponse(body_for(path, message), 405, {"Allow": ", ".join(methods)} if methods else None)


def body_for(path: str, message: str) -> dict[str, Any]:
    """The error body of the face that owns ``path``: Anthropic's under ``/v1/messages``, OpenAI's
    elsewhere under ``/v1``, the admin API's under ``/admin``, a JSON-RPC error object for the rest."""
    error = RpcError(Code.INVALID_REQUEST, message)
    # imported here: a gateway serving /rpc or MCP alone never loads the /v1 faces for this
    if path.startswith("/v1/messages"):
        from multiplexer.faces.v1.anthropic import anthropic_error
        return anthropic_error(405, error, None, None)
    if path.startswith("/v1/"):
        from multiplexer.faces.v1.openai import openai_error
        return openai_error(405, error, None, "method_not_allowed")
    if path == "/admin" or path.startswith("/admin/"):
        return {"error": {"message": message, "type": "method_not_allowed", "code": 405}}
    return {"jsonrpc": "2.0", "error": error.to_dict(), "id": None}
