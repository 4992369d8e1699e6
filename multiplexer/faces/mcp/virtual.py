"""Virtual MCP servers (``mcp_servers`` in config): ``/mcp/NAME`` is an MCP server of its own that
lists and calls just the tools its globs name, for just the keys and teams it names. One gateway
so serves a different tool set to each client; a caller's own key rules still apply inside."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from multiplexer.access.rules import glob_matches, prefix_matches
from multiplexer.access.settings import VirtualServer
from multiplexer.core.errors import Code, RpcError
from multiplexer.faces.http import rpc_error
from multiplexer.faces.mcp.server import McpFace
from multiplexer.faces.mcp.visibility import Visibility
from multiplexer.gateway.gateway import Gateway

VIRTUAL_SCOPE_KEY = "multiplexer.virtual_server"
Admits = Callable[[str | None, Any], bool]  # (identity, the request's scope) -> may connect


def tools_of(server: VirtualServer) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """(tool name -> exposed, wildcard route prefix -> any of its tools exposed)."""
    globs = tuple(server.tools)
    return functools.partial(glob_matches, globs), functools.partial(prefix_matches, globs)


def admits(gateway: Gateway, server: VirtualServer) -> Callable[[str | None], bool] | None:
    """Who may connect: a listed key (its name, or a stored key's id) or a key of a listed team."""
    if not server.keys and not server.teams:
        return None
    keys, teams = frozenset(server.keys), frozenset(server.teams)

    def check(identity: str | None) -> bool:
        if identity is None:
            return False
        if identity in keys:
            return True
        key = gateway.keys.entry(identity)
        return key is not None and key.team in teams

    return check


def virtual_faces(gateway: Gateway) -> list[tuple[str, McpFace, Admits | None]]:
    out: list[tuple[str, McpFace, Admits | None]] = []
    for name, server in gateway.config.mcp_servers.items():
        tool, prefix = tools_of(server)
        check = admits(gateway, server)
        out.append((name, McpFace(gateway, Visibility(gateway.keys, tool, prefix)),
                    None if check is None else _by_identity(check)))
    return out


def _by_identity(check: Callable[[str | None], bool]) -> Admits:
    return lambda identity, scope: check(identity)


def stored_face(gateway: Gateway) -> tuple[McpFace, Admits]:
    """One MCP server for every virtual server made through the admin API (``/mcp/{name}``): the
    request's server, put on its scope by ``StoredServers``, says which tools and callers."""

    def serving(scope: Any) -> VirtualServer | None:
        found = scope.get(VIRTUAL_SCOPE_KEY) if isinstance(scope, dict) else None
        return found if isinstance(found, VirtualServer) else None

    def only(ctx: Any) -> tuple[Callable[[str], bool], Callable[[str], bool]] | None:
        server = serving(getattr(ctx.request, "scope", None))
        return tools_of(server) if server is not None else None

    def check(identity: str | None, scope: Any) -> bool:
        server = serving(scope)
        if server is None:
            return False
        allowed = admits(gateway, server)
        return allowed is None or allowed(identity)

    return McpFace(gateway, Visibility(gateway.keys, per_request=only)), check


class StoredServers:
    """``/mcp/{name}``: the stored virtual server of that name (404 when there is none) onto the
    request's scope, then the shared endpoint."""

    def __init__(self, gateway: Gateway, endpoint: Any) -> None:
        self.gateway = gateway
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope.get("path_params", {}).get("name", "")
        server = self.gateway.keys.servers.get(name)
        if server is None:
            error = RpcError(Code.NOT_FOUND, "Not Found", {"detail": f"no MCP server {name!r}"})
            await rpc_error(404, error)(scope, receive, send)
            return
        await self.endpoint({**scope, VIRTUAL_SCOPE_KEY: server}, receive, send)
