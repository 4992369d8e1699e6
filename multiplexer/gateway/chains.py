"""Which routes a call may try, in order: fallbacks and model groups, decided from the config.

Pure functions over the routes and groups, used at load (validation: unknown routes, cycles,
mixed operations, strategies not available yet) and by ``gateway/fallbacks.py`` (the expanded
lists). A route's fallbacks are followed depth first: ``a: [b, c]`` and ``b: [d]`` try
``a, b, d, c``; each route at most once per call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from multiplexer.core.policy import GroupConfig, RouteConfig

Links = Callable[[RouteConfig], list[str]]


def plain_fallbacks(route: RouteConfig) -> list[str]:
    return route.fallbacks


def context_fallbacks(route: RouteConfig) -> list[str]:
    return route.context_window_fallbacks


def expand(first: list[str], routes: Mapping[str, RouteConfig], links: Links,
           skip: set[str]) -> list[str]:
    """``first`` with each route's own links after it, depth first, no route twice or in ``skip``."""
    out: list[str] = []
    seen = set(skip)

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        out.append(name)
        for nxt in links(routes[name]):
            visit(nxt)

    for name in first:
        visit(name)
    return out


def _cycle(routes: Mapping[str, RouteConfig], links: Links) -> list[str] | None:
    """A cycle of fallback links (as route names, closed), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in links(routes[name]):
            if nxt not in routes:
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[name] = 2
        return None

    for name in routes:
        if name not in state and (found := visit(name)) is not None:
            return found
    return None


# Kinds whose own request body is neither OpenAI's nor Anthropic's: a `/v1` body is translated
# for the first route of a chain, so every route of it must take the same body.
OWN_BODY = {"gemini"}


def problems(routes: Mapping[str, RouteConfig], groups: Mapping[str, GroupConfig],
             kinds: Mapping[str, str] | None = None) -> list[str]:
    """Every mistake in the fallbacks and groups, one line each (empty: none). ``kinds``:
    provider name -> kind, to keep kinds with bodies of their own out of mixed chains."""
    lines: list[str] = []
    kinds = kinds or {}

    def body(route: RouteConfig) -> str:
        kind = kinds.get(route.provider, "")
        return kind if kind in OWN_BODY else "common"

    def check(where: str, names: list[str], operation: str | None, first: RouteConfig | None = None) -> None:
        for name in names:
            route = routes.get(name)
            if route is None or name.endswith("*"):
                known = ", ".join(sorted(n for n in routes if not n.endswith("*")))
                lines.append(f"{where}: unknown route {name!r} (routes: {known})")
            elif operation is not None and route.operation != operation:
                lines.append(f"{where}: route {name!r} answers {route.operation!r}, not "
                             f"{operation!r} (a fallback must answer in the same API)")
            elif first is not None and body(route) != body(first):
                lines.append(f"{where}: route {name!r} (kind {kinds.get(route.provider)}) takes "
                             f"another request body than provider {first.provider!r} (kind "
                             f"{kinds.get(first.provider)}): a fallback must take the same body")
        if len(set(names)) != len(names):
            lines.append(f"{where}: a route is named twice")

    for name, route in routes.items():
        for key, links in (("fallbacks", plain_fallbacks), ("context_window_fallbacks", context_fallbacks)):
            names = links(route)
            if not names:
                continue
            if name.endswith("*"):
                lines.append(f"routes.{name}.{key}: a wildcard route cannot fall back")
                continue
            check(f"routes.{name}.{key}", names, route.operation, route)
            if name in names:
                lines.append(f"routes.{name}.{key}: a route cannot fall back to itself")
    for key, links in (("fallbacks", plain_fallbacks), ("context_window_fallbacks", context_fallbacks)):
        cycle = _cycle(routes, links)
        if cycle is not None and len(cycle) > 2:
            lines.append(f"routes: the {key} form a cycle: {' -> '.join(cycle)}")
    for gname, group in groups.items():
        where = f"groups.{gname}"
        if gname in routes:
            lines.append(f"{where}: a route has the same name (a group's name is a public model)")
        first = routes.get(group.routes[0])
        operation = first.operation if first is not None else None
        check(f"{where}.routes", group.routes, operation, first)
        check(f"{where}.fallbacks", group.fallbacks, operation, first)
        check(f"{where}.context_window_fallbacks", group.context_window_fallbacks, operation, first)
        if group.strategy == "cost":
            lines.append(f"{where}.strategy: 'cost' needs model prices, which this version does "
                         "not have yet; use least_busy, weighted or latency")
        for rname, weight in group.weights.items():
            if rname not in group.routes:
                lines.append(f"{where}.weights: {rname!r} is not one of the group's routes")
            elif weight <= 0:
                lines.append(f"{where}.weights.{rname}: a weight must be above 0")
        if group.weights and group.strategy != "weighted":
            lines.append(f"{where}.weights: only strategy weighted uses weights")
    return lines
