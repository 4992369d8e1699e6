"""One long-lived MCP client session per upstream, kept alive across crashes.

Every call shares the one session (the SDK client allocates the upstream
request ids, so two upstreams never collide and a cancel names the right id).
This supervisor owns it: it connects, keeps the tool list fresh
(``mcp_listing``), notices the moment the transport ends, and reconnects with
backoff. Requests (``mcp_request``) wait for the live connection it publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

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

from multiplexer.core.clock import Clock
from multiplexer.core.errors import upstream_unavailable
from multiplexer.core.logs import rank
from multiplexer.core.version import VERSION as __version__

from .mcp_ask import Questions
from .mcp_listing import ToolList
from .mcp_logs import LogRouter
from .mcp_request import describe
from .mcp_transport import McpSettings, StderrRelay, open_transport, watched

log = logging.getLogger(__name__)

_STABLE_AFTER_S = 5.0  # a connection that lived this long resets the restart backoff


class UpstreamSession:
    def __init__(self, name: str, settings: McpSettings, *, call_timeout_s: float, clock: Clock,
                 on_tools: Callable[[dict[str, types.Tool]], None],
                 on_event: Callable[[str], None] = lambda event: None,
                 on_lists: Callable[[str], None] = lambda kind: None) -> None:
        self.name = name
        self.on_event = on_event
        self.settings = settings
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        self._on_lists = on_lists  # "resources" / "prompts": the upstream's list changed
        self.tool_list = ToolList(name, settings.max_pages, clock, on_tools)
        # what the upstream asks mid-call, to the call's client
        self.questions = Questions(name, by_stream=settings.transport == "http")
        self.generation = 0
        self.connects = 0
        self.failures = 0  # connection attempts that failed since the session was last up
        self.last_error: str | None = None
        self.protocol_version: str | None = None
        self.era: str | None = None  # the revision last negotiated: the next connection's guess
        self._discovered: types.DiscoverResult | None = None  # its server/discover answer, if modern
        self.probes = 0  # connections opened by probing the era (not from the cached one)
        self.capabilities: types.ServerCapabilities | None = None  # of the last connection
        self.attempted = anyio.Event()  # the first connection attempt has finished, either way
        self._log_level: tuple[int, str] | None = None  # (generation, level) a handshake connection logs at
        self._log_lock = anyio.Lock()
        self._client: Client | None = None
        self.stderr = StderrRelay(name)  # a stdio child's stderr lines, logged under this name
        self._attempt_end = anyio.Event()  # replaced after each connection attempt ends
        self._kick = anyio.Event()  # a waiting call asks for a reconnect now, not after the backoff
        self._ended = anyio.Event()
        self._dirty = anyio.Event()

    @property
    def connected(self) -> bool:
        return self._client is not None

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]:
        """Connected: up. Not connected since an attempt failed or the connection ended (while it
        backs off and reconnects): failing, with the last error. Otherwise (the first attempt
        under way): starting."""
        if self._client is not None:
            return "up", None
        said = f" (its stderr: {self.stderr.last})" if self.stderr.last else ""
        if self.failures:
            return "failing", (self.last_error or "not connected") + said
        return "starting", self.last_error

    @property
    def tools(self) -> dict[str, types.Tool]:
        return self.tool_list.tools

    # -- the supervisor ---------------------------------------------------------
    async def run(self) -> None:
        """Connect, serve until the connection ends, back off, reconnect; until cancelled."""
        initial = self.settings.restart_backoff_ms / 1000
        backoff = initial
        while True:
            began = self.clock.now()
            try:
                await self._serve_connection()
            except Exception as e:
                self.last_error = describe(e)
                self.failures += 1
                self.on_event("disconnected")
                log.warning("mcp upstream %s: %s; reconnecting in %.2fs", self.name, self.last_error,
                            backoff)
            finally:
                self._drop()
                self._ended.set()  # however it ended, calls waiting on this connection learn now
                self._attempt_ended()
            if self.clock.now() - began >= _STABLE_AFTER_S:
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

    # -- the era --------------------------------------------------------------------
    def _mode(self) -> tuple[str, types.DiscoverResult | None]:
        """How to open the next connection: the cached era where it still holds, else a probe.

        A stdio upstream is a new process on every connection (it may be a different
        build), so it is probed each time; an HTTP upstream keeps its era until a
        handshake or a request says otherwise (``forget_era``).
        """
        if self.settings.protocol != "auto" or self.era is None or self.settings.transport == "stdio":
            return self.settings.protocol, None
        if self.era in MODERN_PROTOCOL_VERSIONS:
            return self.era, self._discovered
        return "legacy", None

    def forget_era(self, reason: str) -> None:
        """Probe again on the next connection."""
        if self.era is not None:
            log.info("mcp upstream %s: probing its protocol era again (%s)", self.name, reason)
        self.era, self._discovered = None, None

    async def _serve_connection(self) -> None:
        ended = self._ended = anyio.Event()
        mode, prior = self._mode()
        router = LogRouter(self.on_event) if self.settings.forward_logs else None
        client = Client(
            watched(open_transport(self.settings, self.call_timeout_s, self.stderr),
                    self._end_hook(ended), router),
            mode=mode,
            prior_discover=prior,
            cache=None,
            read_timeout_seconds=self.settings.connect_timeout_ms / 1000,
            message_handler=self._on_message,
            # declared to the upstream (elicitation form and URL, sampling, roots): its questions
            # are relayed to the client whose call asks them (``mcp_ask``)
            sampling_callback=self.questions.sampling,
            # with tools too: relayed only to a client that declared them (else -32021 names it)
            sampling_capabilities=types.SamplingCapability(tools=types.SamplingToolsCapability()),
            elicitation_callback=self.questions.elicitation,
            list_roots_callback=self.questions.roots,
            client_info=types.Implementation(name="multiplexer", version=__version__),
        )
        if mode == "auto":
            self.probes += 1
        established = False  # a pinned era that fails before this was a wrong guess
        try:
            async with client:
                self.era = self.protocol_version = client.protocol_version
                if router is not None:
                    router.modern = client.protocol_version in MODERN_PROTOCOL_VERSIONS
                self._discovered = client.session.discover_result
                self.capabilities = client.server_capabilities
                await self.tool_list.refresh(client)
                self.generation += 1
                self.connects += 1
                self.failures = 0
                self.last_error = self.stderr.last = None
                self._client = client
                established = True
                self._attempt_ended()
                self.on_event("connected")
                log.info("mcp upstream %s connected (%s, %d tools)", self.name, self.protocol_version,
                         len(self.tools))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._refresher, client)
                    if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                        tg.start_soon(self._listen, client)
                    await ended.wait()
                    tg.cancel_scope.cancel()
        except BaseException:
            if not established and mode != self.settings.protocol:
                self.forget_era(f"the {mode} handshake or first listing failed")
            raise
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

    def lost(self, generation: int, reason: str) -> None:
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
                await self.tool_list.refresh(client)
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
    async def ensure_fresh(self) -> None:
        """Refetch a listing whose ``ttlMs`` ran out (the upstream's cache hint)."""
        client = self._client
        if client is not None and self.tool_list.expired():
            try:
                await self.tool_list.refresh(client)
            except Exception as e:
                log.warning("mcp upstream %s: tool list refresh failed: %s", self.name, e)

    # -- for requests -------------------------------------------------------------
    async def acquire(self, wait_s: float) -> tuple[Client, int, anyio.Event]:
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

    async def ask_logs(self, client: Client, generation: int, level: str) -> None:
        """A handshake-era upstream logs at one level per connection: make it at least as verbose
        as ``level`` (the gateway filters per caller). Only where it offers ``logging/setLevel``;
        one that does not sends what it sends. Asked once per connection and level, not per call."""
        caps = client.server_capabilities
        if caps is None or caps.logging is None:
            return
        async with self._log_lock:  # two calls asking at once must not leave the less verbose level
            held = self._log_level
            if held is not None and held[0] == generation and rank(held[1]) <= rank(level):
                return
            request = types.SetLevelRequest(params=types.SetLevelRequestParams(level=level))  # type: ignore[arg-type]
            wait_s = self.settings.connect_timeout_ms / 1000
            try:
                await client.session.send_request(request, types.EmptyResult,
                                                  request_read_timeout_seconds=wait_s)
            except MCPError as e:
                log.info("mcp upstream %s: logging/setLevel %s refused: %s", self.name, level, e.message)
            self._log_level = (generation, level)

    def offers(self, capability: Literal["resources", "prompts"]) -> bool:
        """Whether the upstream advertised it; unknown until the first connection, so ask then."""
        caps = self.capabilities
        return caps is None or getattr(caps, capability) is not None
