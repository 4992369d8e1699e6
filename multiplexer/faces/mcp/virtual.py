"""Virtual MCP servers (``mcp_servers`` in config): ``/mcp/NAME`` is an MCP server of its own that
lists and calls just the tools its globs name, for just the keys and teams it names. One gateway
so serves a different tool set to each client; a caller's own key rules still apply inside."""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase

from multiplexer.access.settings import VirtualServer
from multiplexer.faces.mcp.server import McpFace
from multiplexer.gateway.gateway import Gateway


def tools_of(server: VirtualServer) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """(tool name -> exposed, wildcard route prefix -> any of its tools exposed)."""
    globs = tuple(server.tools)

    def tool(name: str) -> bool:
        return any(fnmatchcase(name, g) for g in globs)

    def prefix(prefix: str) -> bool:
        return any(g.startswith(prefix) or fnmatchcase(prefix, g) for g in globs)

    return tool, prefix


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


def virtual_faces(gateway: Gateway) -> list[tuple[str, McpFace, Callable[[str | None], bool] | None]]:
    out = []
    for name, server in gateway.config.mcp_servers.items():
        tool, prefix = tools_of(server)
        out.append((name, McpFace(gateway, only=tool, only_prefix=prefix), admits(gateway, server)))
    return out
