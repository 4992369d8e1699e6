"""The gateway's tools: every route as a tool, wildcard routes expanded from their provider's list."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import Provider, ToolSource, ToolSpec


async def route_tools(routes: Mapping[str, RouteConfig], providers: Mapping[str, Provider],
                      builtins: Iterable[ToolSpec]) -> list[ToolSpec]:
    """Gateway methods first, then exact routes from config and wildcard routes from their provider."""
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
    return tools
