"""Method name -> route: exact names first, then model groups, then the longest wildcard prefix."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from multiplexer.core.errors import RpcError, closest, method_not_found
from multiplexer.core.policy import RouteConfig


@dataclass(frozen=True, slots=True)
class Resolved:
    name: str  # the route's config key (``tools_*`` for wildcard routes)
    route: RouteConfig
    upstream_method: str
    group: str | None = None  # the model group the caller named (its first route here)


class Router:
    def __init__(self, routes: dict[str, RouteConfig],
                 groups: Mapping[str, list[str]] | None = None) -> None:
        self.exact = {k: v for k, v in routes.items() if not k.endswith("*")}
        # a group's name resolves to its first route; the gateway's fallbacks pick the one it tries
        self.groups = {g: Resolved(names[0], routes[names[0]], routes[names[0]].method or names[0], g)
                       for g, names in (groups or {}).items()}
        self.prefixes = sorted(
            ((k[:-1], k, v) for k, v in routes.items() if k.endswith("*")),
            key=lambda t: -len(t[0]),
        )

    def names(self) -> list[str]:
        """The names a caller may call by: routes (not wildcards) and model groups."""
        return [*self.exact, *self.groups]

    def resolve(self, method: str) -> Resolved:
        """The route ``method`` names; raises ``unknown`` when none does."""
        route = self.exact.get(method)
        if route is not None:
            return Resolved(method, route, route.method or method)
        group = self.groups.get(method)
        if group is not None:
            return group
        for prefix, name, route in self.prefixes:
            if method.startswith(prefix) and len(method) > len(prefix):
                rest = method[len(prefix):]
                return Resolved(name, route, (route.method or "") + rest)
        raise self.unknown(method)

    def unknown(self, method: str, may_use: Callable[[str], bool] | None = None) -> RpcError:
        """-32601 for a name no route serves, pointing at the closest name (of those ``may_use``
        passes: a key's access rules; of every name without them)."""
        names = self.names()
        return method_not_found(method, closest(method, names if may_use is None else filter(may_use, names)))
