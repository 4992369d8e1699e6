"""Method name -> route: exact names first, then the longest wildcard prefix."""

from __future__ import annotations

from dataclasses import dataclass

from multiplexer.core.errors import method_not_found
from multiplexer.core.policy import RouteConfig


@dataclass(frozen=True, slots=True)
class Resolved:
    name: str  # the route's config key (``tools_*`` for wildcard routes)
    route: RouteConfig
    upstream_method: str


class Router:
    def __init__(self, routes: dict[str, RouteConfig]) -> None:
        self.exact = {k: v for k, v in routes.items() if not k.endswith("*")}
        self.prefixes = sorted(
            ((k[:-1], k, v) for k, v in routes.items() if k.endswith("*")),
            key=lambda t: -len(t[0]),
        )

    def resolve(self, method: str) -> Resolved:
        route = self.exact.get(method)
        if route is not None:
            return Resolved(method, route, route.method or method)
        for prefix, name, route in self.prefixes:
            if method.startswith(prefix) and len(method) > len(prefix):
                rest = method[len(prefix):]
                return Resolved(name, route, (route.method or "") + rest)
        raise method_not_found(method)
