"""Requests on an upstream MCP session: one live connection, one retry when it is safe.

A request waits (bounded) for the supervisor's live connection, sends on it,
and turns every failure into an ``RpcError``: a refused request (lost HTTP
session) never ran and is always sent again; one caught in flight by a lost
connection is repeated only when the caller says it is safe.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, cast

import anyio
import mcp_types as types
from mcp import Client, MCPError
from mcp.shared.dispatcher import ProgressFnT
from mcp_types.methods import parse_server_result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter, ValidationError

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError, timeout_error, upstream_error, upstream_unavailable
from multiplexer.core.logs import LogFanout

from .mcp_ask import MAX_ROUNDS, Questions, Relay
from .mcp_logs import CURRENT, LogRoute
from .mcp_transport import McpSettings

UNSUPPORTED_PROTOCOL_VERSION = -32022  # 2026-07-28: the request's revision is not served (never ran)
Progress = ProgressFnT  # the SDK's progress callback: (progress, total, message)
R = TypeVar("R")


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


class Link(Protocol):
    """What a request needs of the supervisor (``mcp_session.UpstreamSession``)."""

    name: str
    settings: McpSettings
    clock: Clock
    call_timeout_s: float
    questions: Questions

    def on_event(self, event: str) -> None: ...

    async def acquire(self, wait_s: float) -> tuple[Client, int, anyio.Event]:
        """The live client, its generation and its end event; ``RpcError`` when none comes up."""
        ...

    def lost(self, generation: int, reason: str) -> None:
        """A request saw that connection ``generation`` is gone."""
        ...

    def forget_era(self, reason: str) -> None:
        """Probe the upstream's protocol era again on the next connection."""
        ...

    async def ask_logs(self, client: Client, generation: int, level: str) -> None:
        """Have a handshake-era connection log at ``level`` or more verbosely (``logging/setLevel``)."""
        ...


class Requester:
    """Sends requests on the supervisor's live connection, with deadlines from the gateway's clock."""

    def __init__(self, session: Link) -> None:
        self.session = session

    @staticmethod
    async def _ended_under(error: MCPError, ended: anyio.Event) -> bool:
        """Whether the call failed because its connection ended (the watcher may lag a write error;
        a bound on real I/O, so real time, not the gateway's clock)."""
        if not is_closed(error):
            return False
        with anyio.move_on_after(1.0):
            await ended.wait()
        return ended.is_set()

    async def request(self, request: types.Request[Any, Any], result_type: type[R] | TypeAdapter[R], *,
                      timeout_s: float | None = None, progress: Progress | None = None,
                      retry_safe: bool = True) -> R:
        """One request on the live session, as an ``RpcError`` on failure."""
        return (await self._send(request, result_type, timeout_s=timeout_s, progress=progress,
                                 retry_safe=retry_safe))[0]

    async def _asking_for_logs(self, request: types.Request[Any, Any], log: LogFanout | None, client: Client,
                               generation: int) -> tuple[types.Request[Any, Any], LogRoute | None]:
        """The request as sent when callers want its log messages, and the route they take back.

        A 2026-07-28 upstream takes the level on the request (``_meta`` logLevel); a
        handshake-era one per connection (``logging/setLevel``), filtered per caller here.
        """
        level = log.level if log is not None else None
        if log is None or level is None:
            return request, None
        if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
            params = request.params
            assert isinstance(params, types.RequestParams)
            meta = {**(params.meta or {}), types.LOG_LEVEL_META_KEY: level}
            request = request.model_copy(update={"params": params.model_copy(update={"meta": meta})})
        else:
            await self.session.ask_logs(client, generation, level)
        return request, LogRoute(log)

    async def _on_wire(self, client: Client, request: types.Request[Any, Any],
                       result_type: type[R] | TypeAdapter[R], deadline: float, progress: Progress | None,
                       route: LogRoute | None, relay: Relay | None = None) -> R:
        clock = self.session.clock

        # The SDK bounds its result type by BaseModel, yet validates through any TypeAdapter
        # (``typed`` reads the raw dict, to check it against the upstream's revision).
        any_result = cast("type[Any] | TypeAdapter[Any]", result_type)
        # A call whose client may be asked: its deadline is the relay's, which pauses while it
        # asks; the SDK's own bound is only a backstop past the most asking may add.
        extra = relay.allowance if relay is not None else 0.0

        async def send() -> R:
            return await client.session.send_request(
                request, any_result,
                request_read_timeout_seconds=max(deadline - clock.now(), 0.001) + extra,
                progress_callback=progress)

        async def logged() -> R:
            if route is None:
                return await send()
            token = CURRENT.set(route)  # the transport tells this request's log messages by it
            try:
                return await route.around(send)
            finally:
                CURRENT.reset(token)

        questions = self.session.questions
        if relay is None or (relay.asker is None and questions.by_stream):
            return await logged()  # no question of it is relayed: nothing to pause or to find
        if relay.asker is None:  # stdio: a question while it is the one call in flight is its (refused)
            with questions.carrying(relay):
                return await logged()
        with relay.deadline(deadline - clock.now()), questions.carrying(relay):
            return await logged()
        raise timeout_error("upstream")  # the relay's deadline passed (it raises its own first)

    async def _send(self, request: types.Request[Any, Any], result_type: type[R] | TypeAdapter[R], *,
                    timeout_s: float | None, progress: Progress | None, retry_safe: bool,
                    log: LogFanout | None = None, relay: Relay | None = None) -> tuple[R, str]:
        """The result, and the protocol revision of the connection that answered it."""
        session = self.session
        name, clock = session.name, session.clock
        timeout = session.call_timeout_s if timeout_s is None else min(timeout_s, session.call_timeout_s)
        deadline = clock.now() + timeout
        attempts = 2
        for attempt in range(attempts):
            wait = min(deadline - clock.now(), session.settings.connect_timeout_ms / 1000)
            client, generation, ended = await session.acquire(wait)
            try:
                sent, route = await self._asking_for_logs(request, log, client, generation)
                result = await self._on_wire(client, sent, result_type, deadline, progress, route, relay)
                return result, client.protocol_version
            except ValidationError as e:
                raise upstream_error(name, f"invalid {request.method} result: {describe(e)}") from None
            except MCPError as e:
                refused = session.settings.transport == "http" and is_session_lost(e)
                if e.code == UNSUPPORTED_PROTOCOL_VERSION:  # it changed under us (restarted as another build)
                    session.forget_era(f"it refused {e.message!r}")
                    refused = True
                if refused or await self._ended_under(e, ended):
                    session.lost(generation, f"connection lost: {e.message}")
                    if attempt + 1 < attempts and (retry_safe or refused):
                        session.on_event("retry")
                        continue
                    why = "retried once" if retry_safe else "not retried: the tool is not declared idempotent"
                    raise upstream_unavailable(
                        name, f"the upstream connection was lost while the call was in flight ({why})"
                    ) from None
                if e.code == types.REQUEST_TIMEOUT and e.message.endswith("timed out"):  # the SDK's own
                    raise timeout_error("upstream") from None
                raise protocol_error(name, e) from None
        raise AssertionError("unreachable")

    async def typed(self, request: types.Request[Any, Any], *, timeout_s: float | None = None,
                    progress: Progress | None = None, retry_safe: bool = True,
                    log: LogFanout | None = None, relay: Relay | None = None) -> dict[str, Any]:
        """A ``tools/call``, ``resources/read`` or ``prompts/get`` result, era-free, as a wire dict.

        The reply is checked against the revision the upstream spoke and parsed into the
        SDK's era-free model (``parse_server_result``), so the MCP face can hand the SDK a
        typed result that it writes in the client's revision, whichever that is.
        """
        clock = self.session.clock
        ends = None if timeout_s is None else clock.now() + timeout_s
        for _ in range(MAX_ROUNDS + 1):
            left = None if ends is None else ends - clock.now()
            raw, version = await self._send(request, _RAW_RESULT, timeout_s=left, progress=progress,
                                            retry_safe=retry_safe, log=log, relay=relay)
            try:
                parsed = parse_server_result(request.method, version, raw)
            except (ValidationError, KeyError, ValueError) as e:
                why = f"invalid {request.method} result for {version}: {describe(e)}"
                raise upstream_error(self.session.name, why) from None
            if not isinstance(parsed, types.InputRequiredResult):
                return wire_result(parsed.model_dump(by_alias=True, mode="json", exclude_none=True,
                                                     exclude={"result_type"}))
            spent = relay.spent if relay is not None else 0.0
            resumed = await self._answered(request, parsed, relay)
            if resumed is None:  # a 2026-07-28 client answers it and retries
                return wire_result(parsed.model_dump(by_alias=True, mode="json", exclude_none=True))
            if ends is not None and relay is not None:
                ends += relay.spent - spent  # the asking paused the call's deadline
            request = resumed
        raise upstream_error(self.session.name, f"the upstream asked for input more than {MAX_ROUNDS} "
                             f"times during {request.method} (input_required)")

    async def _answered(self, request: types.Request[Any, Any], result: types.InputRequiredResult,
                        relay: Relay | None) -> types.Request[Any, Any] | None:
        """The request sent again with its caller's answers; None: the result goes to the client."""
        if not isinstance(request, types.CallToolRequest):
            raise upstream_error(self.session.name, f"the upstream asked for client input during "
                                 f"{request.method} (input_required), which the gateway relays only "
                                 "during tools/call")
        if relay is None:
            relay = Relay(self.session.name, None)
        params = await relay.resume(request.params, result)
        return None if params is None else request.model_copy(update={"params": params})

    async def call(self, tool: str, arguments: dict[str, Any] | None, *, timeout_s: float | None,
                   progress: Progress | None, retry_safe: bool,
                   log: LogFanout | None = None, relay: Relay | None = None,
                   resume: dict[str, Any] | None = None) -> dict[str, Any]:
        """The upstream's ``CallToolResult`` as an era-free wire dict, or an ``RpcError``; its log
        messages go to ``log`` (``mcp_logs``), its questions to its caller (``relay``). ``resume``:
        a 2026-07-28 client's answers (``inputResponses``, ``requestState``) to the
        ``input_required`` result it was handed, sent on with the call."""
        params = types.CallToolRequestParams.model_validate(
            {"name": tool, "arguments": arguments, **(resume or {})})
        request = types.CallToolRequest(params=params)
        return await self.typed(request, timeout_s=timeout_s, progress=progress, retry_safe=retry_safe,
                                log=log, relay=relay)

    async def read_resource(self, uri: str) -> dict[str, Any]:
        """The upstream's ``ReadResourceResult`` (a read is safe to repeat)."""
        return await self.typed(types.ReadResourceRequest(params=types.ReadResourceRequestParams(uri=uri)))

    async def get_prompt(self, name: str, arguments: dict[str, str] | None) -> dict[str, Any]:
        """The upstream's ``GetPromptResult`` (rendering a prompt is safe to repeat)."""
        params = types.GetPromptRequestParams(name=name, arguments=arguments)
        return await self.typed(types.GetPromptRequest(params=params))


# The raw reply; ``typed`` checks it against the revision the upstream spoke.
_RAW_RESULT: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


def wire_result(dumped: dict[str, Any]) -> dict[str, Any]:
    """A result less the upstream's per-response identity stamp (not ours to pass on)."""
    meta = dumped.get("_meta")
    if isinstance(meta, dict) and types.SERVER_INFO_META_KEY in meta:
        meta = {k: v for k, v in meta.items() if k != types.SERVER_INFO_META_KEY}
        if meta:
            dumped["_meta"] = meta
        else:
            del dumped["_meta"]
    return dumped
