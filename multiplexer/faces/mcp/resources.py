"""Upstream MCP resources and prompts, served by the gateway's MCP face.

They come from the upstream MCP servers that wildcard routes expose. Prompts
take the route's prefix, like that upstream's tools; resource URIs are global
identifiers (tool results link to them), so they stay as they are: the first
upstream in route order owns a URI listed twice, and a URI no listing named (a
template's) is offered to each upstream in turn. Reads and gets go straight to
the upstream session (the face still counts them against the caller's quota):
they are metadata, not the volume path the lanes serve.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import mcp_types as types
from mcp import MCPError
from mcp.server import ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.gather import gather
from multiplexer.core.provider import McpUpstream, PromptSource, ResourceSource
from multiplexer.faces.mcp.tools import mcp_error
from multiplexer.gateway.gateway import Gateway

log = logging.getLogger(__name__)

RESOURCE_NOT_FOUND = -32002  # MCP's code before 2026-07-28, which answers -32602 instead
Listing = list[dict[str, Any]]
S = TypeVar("S", ResourceSource, PromptSource)
# The capabilities as values for isinstance: mypy takes type[P] to mean a concrete class, which a
# runtime-checkable protocol is not, yet isinstance is all the face does with it.
RESOURCES = cast(type[ResourceSource], ResourceSource)
PROMPTS = cast(type[PromptSource], PromptSource)
MAX_WARNED = 1000  # duplicate URIs remembered for warn-once; bounded whatever upstreams list


class UpstreamCatalog:
    """The MCP face's resources/* and prompts/* handlers."""

    def __init__(self, gateway: Gateway,
                 hint: Callable[[int | None], dict[str, Any]] = lambda ttl_ms: {},
                 visible: Callable[[Any], Callable[[str], bool]] | None = None) -> None:
        self.gateway = gateway
        # ctx -> which wildcard routes' prefixes this caller may see (its key, a virtual server)
        self._visible = visible
        self._hint = hint  # cache hints for listings (ttlMs, cacheScope), given the upstreams' own
        self._owners: dict[str, str] = {}  # resource URI -> provider, from the last resources/list
        self._duplicates: set[str] = set()  # URIs already warned about

    def mcp_routes(self, capability: type[S], ctx: Any = None) -> list[tuple[str, S]]:
        """(prefix, provider) of each wildcard route whose provider has ``capability``, in config
        order; with ``ctx``, only those its caller may see."""
        visible = self._visible(ctx) if self._visible is not None and ctx is not None else None
        routes: list[tuple[str, S]] = []
        for name, route in self.gateway.config.routes.items():
            provider = self.gateway.providers[route.provider]
            if name.endswith("*") and isinstance(provider, capability) and (
                    visible is None or visible(name[:-1])):
                routes.append((name[:-1], provider))
        return routes

    def mcp_providers(self, capability: type[S], ctx: Any = None) -> list[S]:
        """Each of those upstreams once, in route order: the order that settles duplicate URIs."""
        return list({p.name: p for _, p in self.mcp_routes(capability, ctx)}.values())

    async def _gather(self, method: str, capability: type[S], fetch: Callable[[S], Awaitable[Listing]],
                      ctx: Any = None) -> list[tuple[S, Listing]]:
        """Every upstream's listing, fetched at once; one that fails is left out, not fatal to the rest."""
        providers = self.mcp_providers(capability, ctx)

        async def one(provider: S) -> Listing:
            try:
                return await fetch(provider)
            except RpcError as e:
                log.warning("%s from %s failed (left out): %s %s", method, provider.name, e.message,
                            e.data or "")
                return []

        return list(zip(providers, await gather(one, providers), strict=True))

    def hint(self, method: str, gathered: list[tuple[S, Listing]]) -> dict[str, Any]:
        """The soonest any upstream in this listing said it goes stale (the face adds its own bound)."""
        ttls = [ttl for provider, _ in gathered if isinstance(provider, McpUpstream)
                if (ttl := provider.listing_ttl_ms(method)) is not None]
        return self._hint(min(ttls, default=None))

    def _claim(self, owners: dict[str, str], uri: str, provider: str) -> bool:
        """Whether the entry is new: the first upstream to list a URI owns it; others are warned of once."""
        owner = owners.get(uri)
        if owner is None:
            owners[uri] = provider
            return True
        if owner != provider and uri not in self._duplicates:
            if len(self._duplicates) < MAX_WARNED:
                self._duplicates.add(uri)
            log.warning("resource %r is listed by %s and %s; %s serves it", uri, owner, provider, owner)
        return False

    async def list_resources(self, ctx: ServerRequestContext[Any, Any],
                             params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        owners: dict[str, str] = {}
        resources: list[types.Resource] = []
        gathered = await self._gather("resources/list", RESOURCES, lambda p: p.list_resources(), ctx)
        for provider, listed in gathered:
            for item in listed:
                if self._claim(owners, item["uri"], provider.name):
                    resources.append(types.Resource.model_validate(item))
        self._owners = owners
        return types.ListResourcesResult(resources=resources, **self.hint("resources/list", gathered))

    async def list_resource_templates(self, ctx: ServerRequestContext[Any, Any],
                                      params: types.PaginatedRequestParams | None
                                      ) -> types.ListResourceTemplatesResult:
        owners: dict[str, str] = {}
        templates: list[types.ResourceTemplate] = []
        gathered = await self._gather("resources/templates/list", RESOURCES,
                                      lambda p: p.list_resource_templates(), ctx)
        for provider, listed in gathered:
            for item in listed:
                if self._claim(owners, item["uriTemplate"], provider.name):
                    templates.append(types.ResourceTemplate.model_validate(item))
        return types.ListResourceTemplatesResult(resource_templates=templates,
                                                 **self.hint("resources/templates/list", gathered))

    async def read_resource(self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
                            ) -> types.ReadResourceResult:
        """A listed URI goes to its owner; any other to each upstream in turn, until one has it.

        "Not found" is answered in the client's revision (-32002 before 2026-07-28,
        -32602 since), whatever revision the upstream that said so speaks.
        """
        uri = str(params.uri)
        owner = self._owners.get(uri)
        failure: RpcError | None = None
        for provider in self.mcp_providers(RESOURCES, ctx):
            if owner is not None and provider.name != owner:
                continue
            try:
                return types.ReadResourceResult.model_validate(await provider.read_resource(uri))
            except RpcError as e:
                if not is_not_found(e):
                    failure = failure or e
        if failure is not None:
            raise mcp_error(failure)
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        code = types.INVALID_PARAMS if modern else RESOURCE_NOT_FOUND
        raise MCPError(code, f"Unknown resource: {uri}", {"uri": uri})

    async def list_prompts(self, ctx: ServerRequestContext[Any, Any],
                           params: types.PaginatedRequestParams | None) -> types.ListPromptsResult:
        gathered = await self._gather("prompts/list", PROMPTS, lambda p: p.list_prompts(), ctx)
        listed = {provider.name: items for provider, items in gathered}
        prompts: dict[str, types.Prompt] = {}
        for prefix, provider in self.mcp_routes(PROMPTS, ctx):
            for item in listed[provider.name]:
                name = prefix + item["name"]
                prompts.setdefault(name, types.Prompt.model_validate({**item, "name": name}))
        return types.ListPromptsResult(prompts=list(prompts.values()), **self.hint("prompts/list", gathered))

    async def get_prompt(self, ctx: ServerRequestContext[Any, Any], params: types.GetPromptRequestParams
                         ) -> types.GetPromptResult:
        """The longest matching prefix picks the upstream, as the router does for tools."""
        name = params.name
        for prefix, provider in sorted(self.mcp_routes(PROMPTS, ctx), key=lambda route: -len(route[0])):
            if name.startswith(prefix) and len(name) > len(prefix):
                try:
                    return types.GetPromptResult.model_validate(
                        await provider.get_prompt(name[len(prefix):], params.arguments))
                except RpcError as e:
                    raise mcp_error(e) from None
        raise MCPError(types.INVALID_PARAMS, f"Unknown prompt: {name}", {"prompt": name})


def is_not_found(error: RpcError) -> bool:
    """An upstream's "no such resource" (or no resources at all): the next upstream may have it."""
    if error.code == Code.INVALID_PARAMS:
        return True
    upstream = bool(error.data and error.data.get("mcp_protocol_error"))
    if upstream and error.code == 0 and error.message.startswith("Unknown resource"):
        return True  # FastMCP on mcp 1.x answers a missing resource with code 0
    return upstream and error.code in (RESOURCE_NOT_FOUND, Code.METHOD_NOT_FOUND)
