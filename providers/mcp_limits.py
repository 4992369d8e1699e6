"""Per-tool limits of an MCP upstream (``tool_limits``: globs under a provider or a route).

Each glob's rpm and concurrency are charged through the provider's one limiter
(``Limiter.named``: ``core/limiter.NamedLimits``, the same token buckets as the provider's own
limits, shared as they are: each worker of ``serve --workers N`` its part, every replica and
worker together with ``state.url``): a call over its tool's share is refused at once with -32003
(``limit``: ``tool_rpm`` or ``tool_concurrency``), never queued. A tool's ``timeout_ms``
shortens its calls' deadline. A route's globs are its own share; a provider's are shared by every
route to it; a call is charged under both where both match (the first matching glob of each).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, Field

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError, rate_limited
from multiplexer.core.limiter import Limiter, NamedLimit, NamedLimits


class ToolLimit(BaseModel):
    """One tool glob's limits."""

    model_config = ConfigDict(extra="forbid")

    rpm: float | None = Field(default=None, gt=0, description="calls per minute of each matching tool; "
                                                             "the excess is refused (-32003, tool_rpm)")
    concurrency: int = Field(default=0, ge=0, description="calls of each matching tool in flight at "
                                                          "once (0: no cap); the excess is refused")
    timeout_ms: float | None = Field(default=None, gt=0, description="a call of a matching tool ends "
                                                                     "with -32001 after this long")


class McpRouteSettings(BaseModel):
    """A route's own keys for a ``kind: mcp`` provider."""

    model_config = ConfigDict(extra="forbid")

    tool_limits: dict[str, ToolLimit] = Field(
        default_factory=dict, description="per-tool limits on this route, by glob over the upstream's "
                                          "tool names (the route's own share; see docs/mcp.md)")


def named(clock: Clock, limits: Mapping[str, ToolLimit], limiter: Limiter | None = None,
          scope: str = "") -> NamedLimits:
    rules = [(glob, limit.rpm, limit.concurrency) for glob, limit in limits.items()
             if limit.rpm or limit.concurrency]
    if limiter is None:
        return NamedLimits(clock, rules, _matches)
    return limiter.named(scope, rules, _matches)


def _matches(glob: str, name: str) -> bool:
    return fnmatchcase(name, glob)


Taken = list[tuple[NamedLimits, NamedLimit]]


class ToolLimits:
    """A provider's ``tool_limits`` and each route's, built once per route on its first call, on
    the provider's limiter (``scope``: ``provider`` or ``route:<name>``)."""

    def __init__(self, clock: Clock, own: Mapping[str, ToolLimit], limiter: Limiter | None = None) -> None:
        self.clock = clock
        self.limiter = limiter
        self.own = named(clock, own, limiter, "provider")
        self.own_timeouts = {g: lim.timeout_ms for g, lim in own.items() if lim.timeout_ms}
        self._routes: dict[str, tuple[NamedLimits, dict[str, float]]] = {}
        self.any_routes = False

    def route(self, name: str, raw: object) -> tuple[NamedLimits, dict[str, float]]:
        found = self._routes.get(name)
        if found is None:
            settings = McpRouteSettings.model_validate({"tool_limits": raw or {}})
            limits = settings.tool_limits
            found = self._routes[name] = (named(self.clock, limits, self.limiter, f"route:{name}"),
                                          {g: lim.timeout_ms for g, lim in limits.items() if lim.timeout_ms})
            self.any_routes = self.any_routes or bool(limits)
        return found

    def forget(self, routes: Iterable[str]) -> None:
        """These routes' limits built again from their keys on their next call (a reload)."""
        for name in routes:
            self._routes.pop(name, None)

    def timeout_s(self, route: str, raw: object, tool: str) -> float | None:
        """The shortest ``timeout_ms`` of the globs that match ``tool`` (route's and provider's)."""
        timeouts = [*self.route(route, raw)[1].items(), *self.own_timeouts.items()] if raw else \
            list(self.own_timeouts.items())
        found = [ms for glob, ms in timeouts if fnmatchcase(tool, glob)]
        return min(found) / 1000 if found else None

    async def take(self, route: str, raw: object, tool: str) -> tuple[Taken, RpcError | None]:
        """Charge a call of ``tool``: the limits to ``finish``, or none and the refusal."""
        taken: Taken = []
        sets = [self.route(route, raw)[0], self.own] if raw else [self.own]
        for limits in sets:
            if not limits:
                continue
            limit, spent, wait = await limits.acquire(tool)
            if spent is not None:
                self.finish(taken)
                rule = limits.rule_of(tool)
                return [], rate_limited(f"tool_{spent}", wait if spent == "rpm" else 1.0, tool=tool,
                                        rule=rule[0] if rule is not None else None)
            if limit is not None:
                taken.append((limits, limit))
        return taken, None

    @staticmethod
    def finish(taken: Taken) -> None:
        for limits, limit in taken:
            limits.finish(limit)
