"""The gateway's tools: every route as a tool, wildcard routes expanded from their provider's list."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multiplexer.core.policy import GroupConfig, RouteConfig
from multiplexer.core.provider import Provider, ToolSource, ToolSpec


async def route_tools(routes: Mapping[str, RouteConfig], providers: Mapping[str, Provider],
                      builtins: Iterable[ToolSpec],
                      groups: Mapping[str, GroupConfig] | None = None) -> list[ToolSpec]:
    """Gateway methods first, then exact routes from config and wildcard routes from their
    provider, then model groups (each one tool, described as its first route)."""
    tools: list[ToolSpec] = list(builtins)
    for name, route in routes.items():
        if name.endswith("*"):
            prefix = name[:-1]
            provider = providers[route.provider]
            listed = await provider.list_tools() if isinstance(provider, ToolSource) else []
            for spec in listed:
                tools.append(ToolSpec(prefix + spec.name, spec.description,
                                      spec.input_schema, spec.annotations, spec.meta))
        else:
            tools.append(ToolSpec(
                name,
                route.description or f"{route.operation} via {route.provider}",
                route.input_schema or {"type": "object", "additionalProperties": True},
            ))
    for name, group in (groups or {}).items():
        first = routes[group.routes[0]]
        tools.append(ToolSpec(
            name, first.description or f"{first.operation} via model group {name} "
                                       f"({', '.join(group.routes)})",
            first.input_schema or {"type": "object", "additionalProperties": True}))
    return tools
