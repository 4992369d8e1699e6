"""The gateway as one MCP server (SDK low-level ``Server``), shared by the HTTP and stdio faces.

``tools/list`` is the gateway's routing table; ``tools/call`` goes through
``Gateway.submit`` like ``/rpc``, so routing, lanes, limits and dedup apply.
When an upstream's tool list changes, every connected client hears about it:
2026-07-28 clients on their ``subscriptions/listen`` streams, handshake-era
clients on their connection's standalone channel.
Resources and prompts are the upstreams' own, through ``mcp_resources``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, TypeVar, cast

import anyio
import mcp_types as types
from mcp import MCPError
from mcp.server import NotificationOptions, Server, ServerRequestContext
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import (
    InMemorySubscriptionBus,
    ListenHandler,
    PromptsListChanged,
    ResourcesListChanged,
    ToolsListChanged,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import Code, RpcError, closest
from multiplexer.core.jsonrpc import META_KEYS, call_from
from multiplexer.core.logs import LEVELS, LogSink
from multiplexer.core.provider import McpUpstream, ToolSpec
from multiplexer.core.version import VERSION as __version__
from multiplexer.faces.jobs import JobFace
from multiplexer.faces.mcp.asking import ClientAsker
from multiplexer.faces.mcp.audit import audit_of
from multiplexer.faces.mcp.changes import ListChanges
from multiplexer.faces.mcp.held import Holds
from multiplexer.faces.mcp.resources import UpstreamCatalog
from multiplexer.faces.mcp.sampling import Sampler
from multiplexer.faces.mcp.tasks import EXTENSION as TASKS
from multiplexer.faces.mcp.tasks import TaskFace, TaskParams, opted_in
from multiplexer.faces.mcp.tools import (
    MAX_NAME,
    ToolCatalog,
    error_result,
    mcp_error,
    protocol_error,
    to_tool,
    unknown_tool,
    wrap_result,
)
from multiplexer.faces.mcp.visibility import Visibility
from multiplexer.faces.unexpected import unexpected
from multiplexer.gateway.gateway import Gateway
from multiplexer.money.report import cost_meta

log = logging.getLogger(__name__)

IDENTITY_SCOPE_KEY = "multiplexer.identity"
R = TypeVar("R")
# ``on_call_tool`` as the SDK's constructor types it; its runner also serializes a handler's dict
# (``HandlerResult``), the form of the task handle ``call_tool`` answers with.
CallToolHandler = Callable[[ServerRequestContext[Any, Any], types.CallToolRequestParams],
                           Awaitable[types.CallToolResult | types.InputRequiredResult]]
# Gateway event -> (the 2026-07-28 bus event, the handshake-era connection's sender).
_LIST_CHANGES: dict[str, tuple[type[Any], str]] = {
    "tools_changed": (ToolsListChanged, "send_tool_list_changed"),
    "resources_changed": (ResourcesListChanged, "send_resource_list_changed"),
    "prompts_changed": (PromptsListChanged, "send_prompt_list_changed"),
}


class _GatewayServer(Server[Any]):
    """Advertises ``listChanged`` (tools, resources, prompts) to handshake-era clients on every transport."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(
                tools_changed=True, resources_changed=True, prompts_changed=True),
            experimental_capabilities, extensions,
        )

    def get_capabilities(self, *args: Any, **kwargs: Any) -> types.ServerCapabilities:
        """List changes are forwarded, resource subscriptions are not (at 2026-07-28 the SDK would
        derive ``subscribe`` from the listen handler too).
        """
        caps = super().get_capabilities(*args, **kwargs)
        resources = types.ResourcesCapability(subscribe=False, list_changed=True)
        prompts = types.PromptsCapability(list_changed=True)
        return caps.model_copy(update={"resources": resources if caps.resources else None,
                                       "prompts": prompts if caps.prompts else None})


class McpFace:
    def __init__(self, gateway: Gateway, visibility: Visibility | None = None) -> None:
        self.gateway = gateway
        # what each caller may see and call: its key's rules (and a virtual server's tools)
        self.visibility = visibility or Visibility(gateway.keys)
        self.catalog = ToolCatalog()
        self.bus = InMemorySubscriptionBus()
        self.listen = ListenHandler(self.bus)
        self._legacy: dict[int, Any] = {}  # handshake-era connections, by id
        self._sessions: dict[str, Any] = {}  # the same, by HTTP session id
        self._open: Counter[str | None] = Counter()  # open HTTP sessions per identity
        self._counted: set[int] = set()  # connections counted in ``_open``
        self._log_levels: dict[int, str] = {}  # handshake-era connections' logging/setLevel, by id
        self._changed: set[str] = set()  # list-change events waiting for the broadcaster
        self.changes = ListChanges()  # each list change once, heard here or from another replica
        self._upstream_kinds: dict[type, bool] = {}  # provider class -> is an McpUpstream
        self._wake: anyio.Event | None = None  # made in ``running``, inside the event loop
        self.upstream = UpstreamCatalog(gateway, self.cache_hint, self.may_use_prefix)
        # 2026-07-28 clients' calls held open for their answers to an upstream's questions
        self.holds = Holds(gateway.config.server.mcp.ask_timeout_s)
        self.audit = audit_of(gateway)  # one record per tools/call (audit.tools), off the hot path
        on_call_tool = cast(CallToolHandler, self.call_tool if self.audit is None
                            else self.audit.audited(self.call_tool, identity_of))
        self.server = _GatewayServer(
            "multiplexer", version=__version__,
            instructions="Every route of this gateway is a tool; calls are batched, limited and shared.",
            get_tool_input_schema=self.catalog.header_schema,
            on_list_tools=self.list_tools,
            on_call_tool=on_call_tool,
            on_list_resources=self._metered(self.upstream.list_resources),
            on_list_resource_templates=self._metered(self.upstream.list_resource_templates),
            on_read_resource=self._metered(self.upstream.read_resource),
            on_list_prompts=self._metered(self.upstream.list_prompts),
            on_get_prompt=self._metered(self.upstream.get_prompt),
            on_subscriptions_listen=self.listen,
        )
        # Handshake-era clients set their log level (advertised as the ``logging`` capability);
        # SEP-2577 deprecates it at 2026-07-28, so the constructor keyword warns on every start.
        self.server.add_request_handler("logging/setLevel", types.SetLevelRequestParams, self.set_log_level)
        if not gateway.tracer.enabled:
            # The SDK's one default middleware opens an OpenTelemetry span per message, a no-op
            # unless an exporter is installed, which only the gateway's traces do; idle, it cost
            # about 4% of the gateway's CPU on a small call. The SDK's opt-out: drop it.
            self.server.middleware.clear()
        self.server.middleware.append(self._track_connection)
        jobs = gateway.faces.get("jobs")
        self.tasks = TaskFace(gateway, jobs, identity_of) if isinstance(jobs, JobFace) else None
        if self.tasks is not None:  # batch jobs exist: long calls may become tasks
            self.server.extensions[TASKS] = {}
            self.server.add_request_handler("tasks/get", TaskParams, self._metered(self.tasks.get))
            self.server.add_request_handler("tasks/cancel", TaskParams, self._metered(self.tasks.cancel))

    # -- lifetime --------------------------------------------------------------
    @asynccontextmanager
    async def running(self) -> AsyncIterator[McpFace]:
        """Forward the upstreams' list changes to connected clients while the face is up."""
        self._wake = anyio.Event()
        self.gateway.listeners.append(self._on_event)
        try:
            async with self._audit_running(), anyio.create_task_group() as tg:
                tg.start_soon(self._broadcast)
                self.holds.spawn = tg.start_soon
                if self.tasks is not None:
                    self.tasks.spawn = tg.start_soon
                    tg.start_soon(self.tasks.seal_orphans)
                try:
                    yield self
                finally:
                    self.listen.close()
                    tg.cancel_scope.cancel()
        finally:
            self.gateway.listeners.remove(self._on_event)

    def _audit_running(self) -> AbstractAsyncContextManager[Any]:
        return self.audit.running() if self.audit is not None else nullcontext()

    def _on_event(self, event: str, data: dict[str, Any]) -> None:
        if event in _LIST_CHANGES and self.changes.heard_here(event, data):
            self._list_changed(event)

    def changed_elsewhere(self, event: str, change: str) -> None:
        """A list change another replica heard (``changes.py``), for this replica's listeners."""
        if event in _LIST_CHANGES and self.changes.heard_there(change):
            self._list_changed(event)

    def _list_changed(self, event: str) -> None:
        self._changed.add(event)  # a change already waiting covers this one
        if self._wake is not None:
            self._wake.set()

    async def _broadcast(self) -> None:
        while True:
            assert self._wake is not None
            await self._wake.wait()
            self._wake = anyio.Event()
            changed, self._changed = self._changed, set()
            for event in sorted(changed):
                bus_event, send = _LIST_CHANGES[event]
                await self.bus.publish(bus_event())
                for connection in list(self._legacy.values()):
                    with anyio.move_on_after(1.0):
                        await getattr(connection, send)()

    def sessions_of(self, identity: str | None) -> int:
        """HTTP sessions this identity holds open (the HTTP face caps them per key)."""
        return self._open[identity]

    def _count_session(self, ctx: ServerRequestContext[Any, Any]) -> None:
        connection = connection_of(ctx)
        if connection is None or not connection.session_id or id(connection) in self._counted:
            return
        key, identity = id(connection), identity_of(ctx)
        self._counted.add(key)
        self._open[identity] += 1
        gauge = self.gateway.metrics.mcp_sessions
        gauge.inc()

        def closed() -> None:
            self._counted.discard(key)
            self._open[identity] -= 1
            if self._open[identity] <= 0:
                del self._open[identity]
            gauge.dec()

        connection.exit_stack.callback(closed)

    async def _track_connection(self, ctx: ServerRequestContext[Any, Any],
                                call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        """Remember handshake-era connections so list changes can reach them later; and, being
        around every request already, turn a handler's unexpected exception into an MCP internal
        error, logged and counted once (the SDK would send a handshake-era client its text)."""
        try:
            return await self._tracked(ctx, call_next)
        except (MCPError, ValidationError):
            raise  # the SDK's own: a protocol error, invalid params
        except RpcError as e:
            raise mcp_error(e) from None
        except Exception as e:
            raise mcp_error(unexpected(self.gateway, f"MCP {ctx.method}", e)) from None

    async def _tracked(self, ctx: ServerRequestContext[Any, Any],
                       call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        if ctx.method == "initialize":
            self._count_session(ctx)
        elif ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            connection = connection_of(ctx)
            key = id(connection)
            if connection is not None and key not in self._legacy:
                self._legacy[key] = connection
                connection.exit_stack.callback(self._legacy.pop, key, None)
                if connection.session_id:
                    self._sessions[connection.session_id] = connection
                    connection.exit_stack.callback(self._sessions.pop, connection.session_id, None)
        return await call_next(ctx)

    def session_version(self, session_id: str | None) -> str | None:
        """The revision a handshake-era HTTP session negotiated (None if unknown)."""
        connection = self._sessions.get(session_id) if session_id else None
        return connection.protocol_version if connection is not None else None

    # -- handlers ----------------------------------------------------------------
    def _metered(self, handler: Callable[[Any, Any], Awaitable[R]]) -> Callable[[Any, Any], Awaitable[R]]:
        """Resources and prompts skip the lanes, but not the caller's quota (rpm, concurrency)."""
        quotas = self.gateway.quotas

        async def run(ctx: ServerRequestContext[Any, Any], params: Any) -> R:
            async with quotas.held(identity_of(ctx), mcp_error):
                return await handler(ctx, params)

        return run

    async def specs(self) -> list[ToolSpec]:
        """The gateway's tools; exact routes to an MCP upstream take that tool's schema."""
        config = self.gateway.config
        upstream: dict[str, dict[str, ToolSpec]] = {}
        specs: list[ToolSpec] = []
        for spec in await self.gateway.list_tools():
            route = config.routes.get(spec.name)
            provider = self.gateway.providers[route.provider] if route is not None else None
            if route is not None and route.input_schema is None and isinstance(provider, McpUpstream):
                if route.provider not in upstream:
                    listed = await provider.list_tools()
                    upstream[route.provider] = {t.name: t for t in listed}
                found = upstream[route.provider].get(route.method or spec.name)
                if found is not None:
                    spec = ToolSpec(spec.name, route.description or found.description,
                                    found.input_schema, found.annotations, found.meta)
                elif held(provider, route.method or spec.name):
                    continue  # a pinned tool whose definition changed: hidden until approved
            specs.append(spec)
        return specs

    def may_use(self, ctx: ServerRequestContext[Any, Any]) -> Callable[[str], bool]:
        return self.visibility.tools(identity_of(ctx), ctx)

    def may_use_prefix(self, ctx: ServerRequestContext[Any, Any]) -> Callable[[str], bool]:
        return self.visibility.prefixes(identity_of(ctx), ctx)

    async def list_tools(self, ctx: ServerRequestContext[Any, Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        allowed = self.may_use(ctx)
        tools = self.catalog.build([s for s in await self.specs() if allowed(s.name)])
        return types.ListToolsResult(tools=tools, **self.cache_hint(self._tools_ttl_ms()))

    def cache_hint(self, ttl_ms: int | None = None) -> dict[str, Any]:
        """``ttlMs``/``cacheScope`` for a listing (2026-07-28 clients; the SDK drops them for older ones).

        The lists are the same for every caller, but behind API keys they are not for strangers.
        """
        limit = self.gateway.config.server.mcp.list_ttl_ms
        server = self.gateway.config.server  # behind keys (per-key listings), never for strangers
        scope = "private" if server.api_keys or server.oauth or self.gateway.keys.enabled else "public"
        return {"ttl_ms": limit if ttl_ms is None else min(ttl_ms, limit), "cache_scope": scope}

    def _tools_ttl_ms(self) -> int | None:
        """The soonest an upstream said its tool list goes stale; otherwise the gateway's own policy:
        it refetches on an upstream's list-changed notice and passes the notice on."""
        ttls = [ttl for p in self.gateway.providers.values() if isinstance(p, McpUpstream)
                if (ttl := p.tools_ttl_ms()) is not None]
        return min(ttls, default=None)

    async def call_tool(self, ctx: ServerRequestContext[Any, Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult | dict[str, Any]:
        """A call through the gateway; a ``CreateTaskResult`` instead where the client takes tasks."""
        if len(params.name) == MAX_NAME and params.name not in self.catalog.aliases:
            self.catalog.build(await self.specs())  # a client calling a short alias it never listed
        method = self.catalog.resolve(params.name)
        if not self.may_use(ctx)(method):  # as if it did not exist
            raise await self._unknown_tool(ctx, params.name)
        raw_meta = (ctx.params or {}).get("_meta")
        meta = {k: v for k, v in raw_meta.items() if k in META_KEYS} if isinstance(raw_meta, dict) else {}
        try:
            call = call_from(method, params.arguments, meta, identity_of(ctx))
        except RpcError as e:
            return error_result(e)
        call.face = "mcp"
        if self.tasks is not None and opted_in(ctx) and self.tasks.runs_as_task(method):
            try:
                return await self.tasks.create(method, params.arguments, call.identity)
            except RpcError as e:
                return self._result(params.name, Outcome.fail(e))
        if isinstance(raw_meta, dict) and raw_meta.get("progressToken") is not None:
            call.progress = ctx.session.report_progress
        upstream = self._is_mcp_route(method)
        if upstream:
            call.log = self._log_sink(ctx, raw_meta)
            self._may_be_asked(ctx, params, call)
            if isinstance(call.ask, ClientAsker) and call.ask.passthrough:
                got = await self._held(call, call.ask)
                if isinstance(got, types.InputRequiredResult):
                    return got  # type: ignore[return-value]
                outcome = got
            else:
                outcome = await self.gateway.submit(call)
        else:
            outcome = await self.gateway.submit(call)
        if outcome.error is not None and outcome.error.code == Code.METHOD_NOT_FOUND:
            raise await self._unknown_tool(ctx, params.name)
        result = self._result(params.name, outcome, upstream)
        if call.want_cost and outcome.ok and isinstance(result, types.CallToolResult):
            result.meta = {**(result.meta or {}), **cost_meta(outcome)}
        return result

    async def _unknown_tool(self, ctx: ServerRequestContext[Any, Any], name: str) -> MCPError:
        """A tool this caller cannot call, pointing at the closest one it can (as ``tools/list``
        would show it: its key's rules and this server's tool set)."""
        allowed = self.may_use(ctx)
        return unknown_tool(name, closest(name, [s.name for s in await self.specs() if allowed(s.name)]))

    async def _held(self, call: Call, asker: ClientAsker) -> Outcome | types.InputRequiredResult:
        """A 2026-07-28 client's call to an upstream that asks mid-call (``held.py``): run held
        for its answers, or resumed by its retry; else as any call."""
        resume = asker.resume or {}
        try:
            held = self.holds.resuming(resume.get("requestState"), call.identity)
        except MCPError as refusal:  # not held here: perhaps on another replica
            if self.holds.elsewhere is None:
                raise
            return await self.holds.elsewhere(resume["requestState"], call.identity,
                                              resume.get("inputResponses") or {}, refusal)
        if held is not None:
            held.answer(resume.get("inputResponses") or {})
        elif self._asks_mid_call(call.method):
            held = self.holds.start(call.identity, lambda: self.gateway.submit(call))
        if held is None:
            return await self.gateway.submit(call)
        asker.held = held
        try:
            got = await held.next()
        except anyio.get_cancelled_exc_class():
            held.scope.cancel()  # the client cancelled its request, or went: the call ends upstream
            raise
        if isinstance(got, Outcome):
            held.collected.set()
        return got

    def _asks_mid_call(self, method: str) -> bool:
        provider = self.gateway.providers[self.gateway.resolve(method).route.provider]
        asks = getattr(provider, "asks_mid_call", None)
        return callable(asks) and bool(asks())

    def _may_be_asked(self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams,
                      call: Call) -> None:
        """The call's way back to this client for its upstream's questions (``asking.py``); its
        deadline pauses while the client is asked (``providers/mcp_ask.Relay``)."""
        settings = self.gateway.config.server.mcp
        resume = None
        if params.input_responses is not None or params.request_state is not None:
            resume = params.model_dump(by_alias=True, mode="json", exclude_none=True,
                                       include={"input_responses", "request_state"})
        sampler = (Sampler(self.gateway, settings.sampling, call.identity)
                   if settings.sampling is not None else None)
        call.ask = ClientAsker(ctx, settings.ask_timeout_s, sampler, resume, connection_of(ctx))

    # -- upstream log messages ------------------------------------------------------
    async def set_log_level(self, ctx: ServerRequestContext[Any, Any],
                            params: types.SetLevelRequestParams) -> types.EmptyResult:
        """Handshake eras: the connection's level for the upstream log messages of its calls."""
        connection = connection_of(ctx)
        if connection is not None:
            key = id(connection)
            if key not in self._log_levels:
                connection.exit_stack.callback(self._log_levels.pop, key, None)
            self._log_levels[key] = params.level
        return types.EmptyResult()

    def _log_sink(self, ctx: ServerRequestContext[Any, Any], meta: Any) -> LogSink | None:
        """Where this call's upstream log messages go, and from which level: a 2026-07-28 request
        names it (``_meta`` logLevel; none named, none sent); a handshake-era connection sets it
        with ``logging/setLevel`` (until then every level, as those eras send without one)."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            level = meta.get(types.LOG_LEVEL_META_KEY) if isinstance(meta, dict) else None
        else:
            level = self._log_levels.get(id(connection_of(ctx)), LEVELS[0])
        if level not in LEVELS:
            return None
        session, request_id = ctx.session, ctx.request_id

        async def send(level: Any, data: Any, logger: str | None) -> None:
            params = types.LoggingMessageNotificationParams(level=level, data=data, logger=logger)
            # related to the call: on its own response stream, never another request's
            await session.send_notification(types.LoggingMessageNotification(params=params),
                                            related_request_id=request_id)

        return LogSink(level, send)

    def _result(self, tool: str, outcome: Outcome,
                upstream: bool = False) -> types.CallToolResult | dict[str, Any]:
        error = outcome.error
        if error is not None:
            raised = protocol_error(error, tool)
            if raised is not None:
                raise raised
            return error_result(error)
        if outcome.result_json is not None:
            text = outcome.result_json.decode()
            return wrap_result(json.loads(text), text)
        result = outcome.result
        if upstream and isinstance(result, dict) and result.get("resultType") == "input_required":
            # an upstream's question for a 2026-07-28 client to answer (``asking.py``)
            return types.InputRequiredResult.model_validate(result)  # type: ignore[return-value]
        if upstream and isinstance(result, dict) and "content" in result:
            # The upstream's result, era-free (the provider's dump of the SDK's model): the SDK's
            # per-revision check writes it in this client's revision, so it is not parsed again here.
            return {**result, "resultType": "complete"}
        return wrap_result(result)

    def _is_mcp_route(self, method: str) -> bool:
        """Whether the route's provider is an MCP upstream (the check by class: a protocol
        ``isinstance`` walks its members on every call)."""
        try:
            route = self.gateway.resolve(method).route
        except RpcError:
            return False
        provider = self.gateway.providers[route.provider]
        known = self._upstream_kinds.get(type(provider))
        if known is None:
            known = self._upstream_kinds[type(provider)] = isinstance(provider, McpUpstream)
        return known


def held(provider: Any, tool: str) -> bool:
    """Whether an upstream that pins its tools holds this one back (``providers/mcp_pins``)."""
    quarantined = getattr(provider, "quarantined", None)
    return callable(quarantined) and bool(quarantined(tool))


def connection_of(ctx: ServerRequestContext[Any, Any]) -> Any:
    """The request's SDK ``Connection``, or None.

    mcp 2.3 hands lowlevel handlers no public path to it (``ServerRequestContext``
    has none; ``Context.connection`` is not what ``ServerRunner`` builds), yet it is
    the only handle on a connection's standalone channel (list changes for
    handshake-era clients) and its teardown (``exit_stack``). The one read of the
    private attribute lives here, so an SDK change breaks one place.
    """
    return getattr(ctx.session, "_connection", None)


def identity_of(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The authenticated identity the HTTP face put on the request scope (None on stdio)."""
    request = ctx.request
    scope = getattr(request, "scope", None)
    return scope.get(IDENTITY_SCOPE_KEY) if isinstance(scope, dict) else None


__all__ = ["IDENTITY_SCOPE_KEY", "McpFace", "identity_of", "to_tool"]
