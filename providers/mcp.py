"""Upstream MCP servers (``kind: mcp``) over stdio or Streamable HTTP.

A wildcard route (``tools_*: {provider: tools}``) exposes every upstream tool
under the route's prefix; an item's ``method`` is the upstream tool name and its
params are the tool's arguments. All calls share one long-lived session
(``mcp_session.UpstreamSession``, requests through ``mcp_request``, listings
through ``mcp_listing``); the lane bounds how many are in flight.
The upstream's resources and prompts are passed through for the MCP face (which
namespaces them), only where the upstream advertises them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Literal, cast

import anyio
import mcp_types as types
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

from multiplexer.core.asking import ASK_OPTION, Asker
from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.core.gather import gather
from multiplexer.core.logs import LogFanout
from multiplexer.core.metrics import code_label
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import Provider, ProviderContext, ToolSpec
from multiplexer.jobs.tool_tables import Pin, ToolTables, open_tool_tables

from .mcp_ask import Relay
from .mcp_limits import McpRouteSettings, ToolLimits
from .mcp_listing import Catalog
from .mcp_pins import ToolPins, canonical, changes_counter, definition, digest
from .mcp_request import Requester
from .mcp_session import UpstreamSession
from .mcp_transport import McpSettings

__all__ = ["McpProvider", "McpSettings"]

_RETRY_SAFE = "mcp_retry_safe"


def tool_spec(tool: types.Tool) -> ToolSpec:
    meta: dict[str, Any] = {}
    if tool.title:
        meta["title"] = tool.title
    if tool.output_schema is not None:
        meta["outputSchema"] = tool.output_schema
    if tool.meta:
        meta["_meta"] = dict(tool.meta)
    annotations = (tool.annotations.model_dump(by_alias=True, exclude_none=True)
                   if tool.annotations is not None else {})
    return ToolSpec(tool.name, tool.description or "", dict(tool.input_schema), annotations, meta)


def wire(item: BaseModel) -> dict[str, Any]:
    return item.model_dump(by_alias=True, mode="json", exclude_none=True)


class McpProvider(Provider):
    Settings = McpSettings
    RouteSettings = McpRouteSettings
    mcp_upstream = True  # results are CallToolResults already (the McpUpstream capability)

    def __init__(self, ctx: ProviderContext) -> None:
        super().__init__(ctx)
        self.settings: McpSettings = ctx.settings
        self.session = UpstreamSession(
            ctx.name, self.settings, call_timeout_s=ctx.config.timeout_ms / 1000, clock=ctx.clock,
            on_tools=self._tools_changed, on_event=self._session_event, on_lists=self._lists_changed,
        )
        self.requests = Requester(self.session)
        self.catalog = Catalog(ctx.name, self.settings.max_pages, self.requests, self.session.offers)
        self._stack: AsyncExitStack | None = None
        self._sent = ctx.metrics.upstream_requests.labels(ctx.name)
        self.pins = ToolPins(ctx.name, self._tables, self._pin_changed) if self.settings.pin else None
        self.tool_limits = ToolLimits(ctx.clock, self.settings.tool_limits, ctx.limiter)

    async def start(self) -> None:
        """Start the session supervisor and give the first connection a bounded chance to come up."""
        stack = AsyncExitStack()
        if self.pins is not None:  # the stored pins, before the first listing is checked
            await self.pins.load()
            stack.callback(self.pins.close)
            stack.push_async_callback(self.pins.flush)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        if self.pins is not None:
            tg.start_soon(self.pins.run)
        tg.start_soon(self.session.run)
        self._stack = stack
        with anyio.move_on_after(self.settings.connect_timeout_ms / 1000):
            await self.session.attempted.wait()

    async def aclose(self) -> None:
        """Cancelling the supervisor closes the session; the SDK reaps the child on every path."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]:
        """The ``Readiness`` capability: its session supervisor's state and last error."""
        return self.session.readiness()

    def describe(self) -> dict[str, Any]:
        """The ``Describes`` capability (the dashboard): transport, protocol era, tools, connections."""
        s = self.session
        status, error = s.readiness()
        return {"transport": self.settings.transport, "era": s.era, "status": status, "error": error,
                "tools": len(s.tools), "connects": s.connects, "failures": s.failures,
                "quarantined": self.pins.describe() if self.pins is not None else []}

    def _session_event(self, event: str) -> None:
        metrics = self.ctx.metrics
        metrics.events.labels(f"mcp:{self.name}", event).inc()
        if event == "retry":
            metrics.retries.labels(self.name).inc()

    def _tables(self) -> ToolTables:
        ctx = self.ctx
        return open_tool_tables(ctx.store_path, ctx.store_url, ctx.store_schema)

    def _pin_changed(self, action: str, tool: str, pin: Pin) -> None:
        changes_counter(self.ctx.metrics.registry).labels(self.name, action).inc()
        self.ctx.notify("tool_pin", {"provider": self.name, "tool": tool, "action": action,
                                     "hash": pin.seen_hash, "approved_hash": pin.approved_hash})
        if action in ("approved", "restored"):  # served again: clients list it again
            self.ctx.notify("tools_changed", {"provider": self.name, "tools": sorted(self.session.tools)})

    def approve_tool(self, tool: str) -> Pin | None:
        """The tool's definition served now is approved (None: not pinned here)."""
        return self.pins.approve(tool) if self.pins is not None else None

    def _tools_changed(self, tools: dict[str, types.Tool]) -> None:
        if self.pins is not None:  # in the step that installs the listing: never served unchecked
            self.pins.check(tools)
        # the definitions' digest names this change alike on every replica that hears it
        definitions = canonical([definition(t) for _, t in sorted(tools.items())])
        self.ctx.notify("tools_changed", {"provider": self.name, "tools": sorted(tools),
                                          "digest": digest(definitions)})

    def _lists_changed(self, kind: str) -> None:
        self.ctx.notify(f"{kind}_changed", {"provider": self.name})

    # -- routing hooks -----------------------------------------------------------
    def _declared_safe(self, tool: str) -> bool:
        if tool in self.settings.idempotent_tools:
            return True
        spec = self.session.tools.get(tool)
        hints = spec.annotations if spec is not None else None
        return bool(hints and (hints.read_only_hint or hints.idempotent_hint))

    def routes_changed(self, names: Iterable[str]) -> None:
        """A reload's changed routes: their ``tool_limits`` built again on their next call."""
        self.tool_limits.forget(names)

    def prepare(self, route: RouteConfig, item: Item) -> None:
        if item.params is not None and not isinstance(item.params, dict):
            raise invalid_params("MCP tool arguments must be an object")
        item.group = (item.operation,)
        pins = self.pins
        if pins is not None and pins.held and (refusal := pins.refusal(item.method)) is not None:
            raise refusal  # every way in: its item is prepared here at admission
        # Decided here, over anything a client put in _meta: only config and annotations count.
        item.options[_RETRY_SAFE] = bool(route.dedup) or self._declared_safe(item.method)
        raw = item.options.get("tool_limits")
        if (raw or self.tool_limits.own_timeouts) and item.deadline is not None:
            timeout = self.tool_limits.timeout_s(item.route, raw, item.method)
            if timeout is not None:
                item.deadline = min(item.deadline, self.ctx.clock.now() + timeout)

    def dedup_safe(self, item: Item) -> bool:
        """Share identical concurrent calls only for tools declared read-only or idempotent."""
        return self._declared_safe(item.method)

    def asks_mid_call(self) -> bool:
        """Whether this upstream's questions come as requests pushed mid-call (a handshake-era
        connection), which a 2026-07-28 client can answer only through a held call."""
        return self.session.era not in MODERN_PROTOCOL_VERSIONS

    def tools_ttl_ms(self) -> int | None:
        return self.session.tool_list.ttl_left_ms()

    def listing_ttl_ms(self, method: str) -> int | None:
        return self.catalog.ttl_ms.get(method)

    async def list_tools(self) -> list[ToolSpec]:
        await self.session.ensure_fresh()
        held = self.pins.held if self.pins is not None else ()
        return [tool_spec(t) for name, t in self.session.tools.items() if name not in held]

    def quarantined(self, tool: str) -> bool:
        return self.pins is not None and tool in self.pins.held

    # -- calls --------------------------------------------------------------------
    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        return await gather(self._one, items)

    async def _one(self, item: Item) -> Outcome:
        progress = item.options.get("progress")
        log = item.options.get("log")
        timeout = None if item.deadline is None else item.deadline - self.ctx.clock.now()
        asker = cast("Asker | None", item.options.get(ASK_OPTION))  # set by a face, never the wire
        raw = item.options.get("tool_limits")
        taken = None
        if raw or self.tool_limits.own:
            taken, refused = await self.tool_limits.take(item.route, raw, item.method)
            if refused is not None:
                return Outcome.fail(refused)
        self._sent.inc()
        try:
            result = await self.requests.call(
                item.method, item.params, timeout_s=timeout,
                progress=progress if callable(progress) else None,
                retry_safe=bool(item.options.get(_RETRY_SAFE)),
                log=log if isinstance(log, LogFanout) and self.settings.forward_logs else None,
                relay=Relay(self.name, asker, item),
                resume=asker.resume if asker is not None else None,
            )
        except RpcError as e:
            self.ctx.metrics.upstream_errors.labels(self.name, code_label(e.code)).inc()
            return Outcome.fail(e)
        finally:
            if taken:
                self.tool_limits.finish(taken)
        return Outcome(result=None if item.notification else result)

    # -- resources and prompts ---------------------------------------------------
    async def list_resources(self) -> list[dict[str, Any]]:
        return [wire(r) for r in await self.catalog.list_resources()]

    async def list_resource_templates(self) -> list[dict[str, Any]]:
        return [wire(t) for t in await self.catalog.list_resource_templates()]

    async def read_resource(self, uri: str) -> dict[str, Any]:
        if not self.session.offers("resources"):
            raise RpcError(Code.INVALID_PARAMS, f"Unknown resource: {uri}",
                           {"uri": uri, "provider": self.name})
        return await self._counted(self.requests.read_resource(uri))

    async def list_prompts(self) -> list[dict[str, Any]]:
        return [wire(p) for p in await self.catalog.list_prompts()]

    async def get_prompt(self, name: str, arguments: dict[str, str] | None) -> dict[str, Any]:
        if not self.session.offers("prompts"):
            raise RpcError(Code.INVALID_PARAMS, f"Unknown prompt: {name}",
                           {"prompt": name, "provider": self.name})
        return await self._counted(self.requests.get_prompt(name, arguments))

    async def _counted(self, request: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        self._sent.inc()
        try:
            return await request
        except RpcError as e:
            self.ctx.metrics.upstream_errors.labels(self.name, code_label(e.code)).inc()
            raise
