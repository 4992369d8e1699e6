"""One long-lived MCP client session per upstream, kept alive across crashes.

Every call shares the one session (the SDK client allocates the upstream
request ids, so two upstreams never collide and a cancel names the right id).
A supervisor task owns the session: it connects, keeps the tool list fresh,
notices the moment the transport ends, and reconnects with backoff. Requests
(tool calls, resource reads, prompt gets, list pages) wait for a live session;
one caught in flight by a fault is retried only when it is safe to repeat.
Resources and prompts are listed on demand, not cached: nothing in the gateway
routes by them, so a stale copy would buy nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import mcp_types as types
from mcp import Client, MCPError
from mcp.client.subscriptions import (
    ListenNotSupportedError,
    PromptsListChanged,
    ResourcesListChanged,
    SubscriptionLost,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter, ValidationError

from multiplexer.core.errors import RpcError, timeout_error, upstream_error, upstream_unavailable
from multiplexer.core.version import VERSION as __version__

from .mcp_transport import McpSettings, open_transport, watched

log = logging.getLogger(__name__)

Progress = Callable[[float, float | None, str | None], Awaitable[None]]
# The SDK checks the result against the negotiated revision; we keep its wire form as is.
_RAW_RESULT: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])
_STABLE_AFTER_S = 5.0  # a connection that lived this long resets the restart backoff
R = TypeVar("R")
Page = TypeVar("Page", bound=types.PaginatedResult)


def describe(exc: BaseException) -> str:
    """The first leaf of an exception group, as one short line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]


def is_session_lost(error: MCPError) -> bool:
    """An HTTP upstream no longer knows our session (404): it refused the call without running it."""
    return error.code == types.INVALID_REQUEST and "session" in error.message.lower()


def is_closed(error: MCPError) -> bool:
    """What the SDK reports when the transport ended under a request (-32000 alone is too common)."""
    return error.code == types.CONNECTION_CLOSED and error.message == "Connection closed"


def protocol_error(provider: str, error: MCPError) -> RpcError:
    """An upstream JSON-RPC error, passed on with its own code; marked so /mcp re-raises it as one."""
    data: dict[str, Any] = {"provider": provider, "mcp_protocol_error": True}
    if error.data is not None:
        data["upstream_data"] = error.data
    return RpcError(error.code, error.message, data)


class UpstreamSession:
    def __init__(self, name: str, settings: McpSettings, *, call_timeout_s: float,
                 on_tools: Callable[[dict[str, types.Tool]], None],
                 on_event: Callable[[str], None] = lambda event: None,
                 on_lists: Callable[[str], None] = lambda kind: None) -> None:
        self.name = name
        self._on_event = on_event
        self.settings = settings
        self.call_timeout_s = call_timeout_s
        self._on_tools = on_tools
        self._on_lists = on_lists  # "resources" / "prompts": the upstream's list changed
        self.tools: dict[str, types.Tool] = {}
        self.tools_expire_at: float | None = None
        self.generation = 0
        self.connects = 0
        self.failures = 0  # connection attempts that failed since the session was last up
        self.last_error: str | None = None
        self.protocol_version: str | None = None
        self.capabilities: types.ServerCapabilities | None = None  # of the last connection
        self.attempted = anyio.Event()  # the first connection attempt has finished, either way
        self._client: Client | None = None
        self._attempt_end = anyio.Event()  # replaced after each connection attempt ends
        self._kick = anyio.Event()  # a waiting call asks for a reconnect now, not after the backoff
        self._ended = anyio.Event()
        self._dirty = anyio.Event()
        self._list_lock = anyio.Lock()
        self._list_seq = 0

    @property
    def connected(self) -> bool:
        return self._client is not None

    # -- the supervisor ---------------------------------------------------------
    async def run(self) -> None:
        """Connect, serve until the connection ends, back off, reconnect; until cancelled."""
        initial = self.settings.restart_backoff_ms / 1000
        backoff = initial
        while True:
            began = time.monotonic()
            try:
                await self._serve_connection()
            except Exception as e:
                self.last_error = describe(e)
                self.failures += 1
                self._on_event("disconnected")
                log.warning("mcp upstream %s: %s; reconnecting in %.2fs", self.name, self.last_error,
                            backoff)
            finally:
                self._drop()
                self._ended.set()  # however it ended, calls waiting on this connection learn now
                self._attempt_ended()
            if time.monotonic() - began >= _STABLE_AFTER_S:
                backoff = initial
            await self._pause(initial, backoff)
            backoff = min(max(backoff * 2, 0.05), self.settings.max_backoff_ms / 1000)

    async def _pause(self, floor: float, backoff: float) -> None:
        """Back off before reconnecting; a waiting call cuts it short, but never below ``floor``."""
        with anyio.move_on_after(backoff):
            await anyio.sleep(floor)
            await self._kick.wait()
        self._kick = anyio.Event()

    def _attempt_ended(self) -> None:
        self.attempted.set()
        ended, self._attempt_end = self._attempt_end, anyio.Event()
        ended.set()

    async def _serve_connection(self) -> None:
        ended = self._ended = anyio.Event()
        client = Client(
            watched(open_transport(self.settings, self.call_timeout_s), self._end_hook(ended)),
            mode=self.settings.protocol,
            cache=None,
            read_timeout_seconds=self.settings.connect_timeout_ms / 1000,
            message_handler=self._on_message,
            client_info=types.Implementation(name="multiplexer", version=__version__),
        )
        async with client:
            self.protocol_version = client.protocol_version
            self.capabilities = client.server_capabilities
            await self._refresh(client)
            self.generation += 1
            self.connects += 1
            self.failures = 0
            self.last_error = None
            self._client = client
            self._attempt_ended()
            self._on_event("connected")
            log.info("mcp upstream %s connected (%s, %d tools)", self.name, self.protocol_version,
                     len(self.tools))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._refresher, client)
                if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                    tg.start_soon(self._listen, client)
                await ended.wait()
                tg.cancel_scope.cancel()
        raise ConnectionError(self.last_error or "the upstream closed the connection")

    def _end_hook(self, ended: anyio.Event) -> Callable[[], None]:
        """Called by the transport watcher: readiness flips off before any caller sees the fault."""

        def on_end() -> None:
            if self._ended is ended:
                self._drop()
            ended.set()

        return on_end

    def _drop(self) -> None:
        self._client = None

    def _lost(self, generation: int, reason: str) -> None:
        if generation == self.generation and not self._ended.is_set():
            self.last_error = reason
            self._drop()
            self._ended.set()

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._dirty.set()
        elif isinstance(message, types.ResourceListChangedNotification):
            self._on_lists("resources")
        elif isinstance(message, types.PromptListChangedNotification):
            self._on_lists("prompts")
        elif isinstance(message, Exception):
            log.debug("mcp upstream %s transport error: %r", self.name, message)

    async def _refresher(self, client: Client) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            try:
                await self._refresh(client)
            except Exception as e:
                log.warning("mcp upstream %s: tool list refresh failed: %s", self.name, e)

    async def _listen(self, client: Client) -> None:
        """2026-07-28 upstreams announce list changes on a subscription stream, not in-band."""
        try:
            async with client.listen(
                tools_list_changed=True, resources_list_changed=self.offers("resources"),
                prompts_list_changed=self.offers("prompts"),
            ) as subscription:
                async for event in subscription:
                    if isinstance(event, ResourcesListChanged):
                        self._on_lists("resources")
                    elif isinstance(event, PromptsListChanged):
                        self._on_lists("prompts")
                    else:
                        self._dirty.set()
        except (ListenNotSupportedError, SubscriptionLost, MCPError, TimeoutError) as e:
            log.debug("mcp upstream %s: no list-changed subscription: %s", self.name, e)

    # -- tool list -----------------------------------------------------------------
    async def _refresh(self, client: Client) -> None:
        """Fetch every page (up to the cap); concurrent refreshes share one upstream listing."""
        seq = self._list_seq
        async with self._list_lock:
            if self._list_seq != seq:
                return
            tools, ttl_ms = await self._fetch(client)
            self._list_seq += 1
        self.tools_expire_at = time.monotonic() + ttl_ms / 1000 if ttl_ms else None
        before = {n: t.model_dump(exclude_none=True) for n, t in self.tools.items()}
        self.tools = tools
        if before != {n: t.model_dump(exclude_none=True) for n, t in tools.items()}:
            self._on_tools(tools)

    async def _fetch(self, client: Client) -> tuple[dict[str, types.Tool], int | None]:
        pages, ttl_ms = await self._pages("tools/list", lambda cursor: client.list_tools(cursor=cursor))
        tools: dict[str, types.Tool] = {}
        for page in pages:
            for tool in page.tools:
                tools.setdefault(tool.name, tool)
        return tools, ttl_ms

    async def _pages(self, method: str, fetch: Callable[[str | None], Awaitable[Page]]
                     ) -> tuple[list[Page], int | None]:
        """Every page of a listing, up to the cap, with the smallest ``ttlMs`` seen.

        Cursors are opaque: a repeated one means a broken upstream, not more data.
        """
        pages: list[Page] = []
        ttl_ms: int | None = None
        cursor: str | None = None
        seen: set[str] = set()
        for _ in range(self.settings.max_pages):
            try:
                page = await fetch(cursor)
            except (MCPError, RpcError) as e:
                if e.code == types.METHOD_NOT_FOUND and cursor is None:
                    return [], None  # an upstream without this kind of item is not a broken one
                raise
            pages.append(page)
            if page.ttl_ms is not None:
                ttl_ms = page.ttl_ms if ttl_ms is None else min(ttl_ms, page.ttl_ms)
            cursor = page.next_cursor
            if cursor is None:
                return pages, ttl_ms
            if cursor in seen:
                log.warning("mcp upstream %s: %s cursor cycle; stopping", self.name, method)
                return pages, ttl_ms
            seen.add(cursor)
        log.warning("mcp upstream %s: %s stopped at the page cap (%d pages)", self.name, method,
                    self.settings.max_pages)
        return pages, ttl_ms

    async def ensure_fresh(self) -> None:
        """Refetch a listing whose ``ttlMs`` ran out (the upstream's cache hint)."""
        client, expires = self._client, self.tools_expire_at
        if client is not None and expires is not None and time.monotonic() >= expires:
            try:
                await self._refresh(client)
            except Exception as e:
                log.warning("mcp upstream %s: tool list refresh failed: %s", self.name, e)

    # -- calls -----------------------------------------------------------------
    async def _acquire(self, wait_s: float) -> tuple[Client, int, anyio.Event]:
        """The live session. While down, wait for one fresh connection attempt, then give up."""
        kicked = False
        with anyio.move_on_after(max(wait_s, 0.0)):
            while True:
                client = self._client
                if client is not None:
                    return client, self.generation, self._ended
                if self.failures:
                    if kicked:
                        break
                    kicked = True
                    self._kick.set()
                await self._attempt_end.wait()
        raise upstream_unavailable(self.name, f"not connected ({self.last_error or 'connecting'})")

    @staticmethod
    async def _ended_under(error: MCPError, ended: anyio.Event) -> bool:
        """Whether the call failed because its connection ended (the watcher may lag a write error)."""
        if not is_closed(error):
            return False
        with anyio.move_on_after(1.0):
            await ended.wait()
        return ended.is_set()

    async def request(self, request: types.Request[Any, Any], result_type: type[R] | TypeAdapter[R], *,
                      timeout_s: float | None = None, progress: Progress | None = None,
                      retry_safe: bool = True) -> R:
        """One request on the live session, as an ``RpcError`` on failure.

        A refused request (lost HTTP session) never ran and is always sent again;
        one caught in flight by a lost connection is repeated only if ``retry_safe``.
        """
        timeout = self.call_timeout_s if timeout_s is None else min(timeout_s, self.call_timeout_s)
        deadline = time.monotonic() + timeout
        attempts = 2
        for attempt in range(attempts):
            remaining = deadline - time.monotonic()
            wait = min(remaining, self.settings.connect_timeout_ms / 1000)
            client, generation, ended = await self._acquire(wait)
            try:
                return await client.session.send_request(
                    request, result_type,
                    request_read_timeout_seconds=max(deadline - time.monotonic(), 0.001),
                    progress_callback=progress,
                )
            except ValidationError as e:
                raise upstream_error(self.name, f"invalid {request.method} result: {describe(e)}") from None
            except MCPError as e:
                refused = self.settings.transport == "http" and is_session_lost(e)
                if refused or await self._ended_under(e, ended):
                    self._lost(generation, f"connection lost: {e.message}")
                    if attempt + 1 < attempts and (retry_safe or refused):
                        self._on_event("retry")
                        continue
                    why = "retried once" if retry_safe else "not retried: the tool is not declared idempotent"
                    raise upstream_unavailable(
                        self.name, f"the upstream connection was lost while the call was in flight ({why})"
                    ) from None
                if e.code == types.REQUEST_TIMEOUT:
                    raise timeout_error("upstream") from None
                raise protocol_error(self.name, e) from None
        raise AssertionError("unreachable")

    async def call(self, tool: str, arguments: dict[str, Any] | None, *, timeout_s: float | None,
                   progress: Progress | None, retry_safe: bool) -> dict[str, Any]:
        """The upstream's ``CallToolResult`` as a wire dict, or an ``RpcError``."""
        request = types.CallToolRequest(params=types.CallToolRequestParams(name=tool, arguments=arguments))
        return wire_result(await self.request(request, _RAW_RESULT, timeout_s=timeout_s, progress=progress,
                                              retry_safe=retry_safe))

    # -- resources and prompts -------------------------------------------------------
    def offers(self, capability: Literal["resources", "prompts"]) -> bool:
        """Whether the upstream advertised it; unknown until the first connection, so ask then."""
        caps = self.capabilities
        return caps is None or getattr(caps, capability) is not None

    async def _listing(self, request: type[types.PaginatedRequest[Any]], result: type[Page]) -> list[Page]:
        async def page(cursor: str | None) -> Page:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
            return await self.request(request(params=params), result)

        return (await self._pages(request().method, page))[0]

    async def list_resources(self) -> list[types.Resource]:
        if not self.offers("resources"):
            return []
        pages = await self._listing(types.ListResourcesRequest, types.ListResourcesResult)
        return [r for page in pages for r in page.resources]

    async def list_resource_templates(self) -> list[types.ResourceTemplate]:
        if not self.offers("resources"):
            return []
        pages = await self._listing(types.ListResourceTemplatesRequest, types.ListResourceTemplatesResult)
        return [t for page in pages for t in page.resource_templates]

    async def list_prompts(self) -> list[types.Prompt]:
        if not self.offers("prompts"):
            return []
        pages = await self._listing(types.ListPromptsRequest, types.ListPromptsResult)
        return [p for page in pages for p in page.prompts]

    async def read_resource(self, uri: str) -> dict[str, Any]:
        """The upstream's ``ReadResourceResult`` as a wire dict (a read is safe to repeat)."""
        request = types.ReadResourceRequest(params=types.ReadResourceRequestParams(uri=uri))
        return wire_result(await self.request(request, _RAW_RESULT))

    async def get_prompt(self, name: str, arguments: dict[str, str] | None) -> dict[str, Any]:
        """The upstream's ``GetPromptResult`` as a wire dict (rendering a prompt is safe to repeat)."""
        request = types.GetPromptRequest(params=types.GetPromptRequestParams(name=name, arguments=arguments))
        return wire_result(await self.request(request, _RAW_RESULT))


def wire_result(dumped: dict[str, Any]) -> dict[str, Any]:
    """A result as the upstream sent it, less its per-response identity stamp (not ours to pass on)."""
    meta = dumped.get("_meta")
    if isinstance(meta, dict) and types.SERVER_INFO_META_KEY in meta:
        meta = {k: v for k, v in meta.items() if k != types.SERVER_INFO_META_KEY}
        if meta:
            dumped["_meta"] = meta
        else:
            del dumped["_meta"]
    return dumped
