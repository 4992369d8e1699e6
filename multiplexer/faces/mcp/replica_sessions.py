"""Handshake-era MCP sessions on any replica (``state.url``): the session lives in the shared state,
each replica keeps only a copy it can rebuild.

Without shared state the SDK's ``StreamableHTTPSessionManager`` serves ``/mcp`` as it is: a session
lives on the replica that opened it. With it, ``ReplicaSessionManager`` (a subclass of the SDK's,
and the one place that knows its private parts) adds:

- **the record**: as a session's ``initialize`` (and each ``logging/setLevel``) is answered, and
  before the answer leaves, its revision, the client's ``initialize`` params (capabilities, client
  info), who opened it, its path and its log level are written to the shared state, expiring
  ``server.mcp.session_idle_s`` after the last request any replica served for it;
- **rebuilding**: a replica that holds no copy of a requested ``Mcp-Session-Id`` reads the record
  and serves the session as if it had opened it (the same credential only, as the SDK checks);
- **messages between replicas**, on one pub/sub channel per mount: a server-to-client message
  without a request of its own (list changes, a request on the standalone stream) that this
  replica cannot deliver goes to the replica that holds the client's GET stream; a client's answer
  to a server-to-client request (and a ``notifications/cancelled`` or ``progress``) that lands on a
  replica not waiting for it goes to the one that is (server-to-client request ids are unique per
  replica, so two replicas' requests never share one); a ``DELETE`` ends every replica's copy;
- **no replica owns a session**: one that stops or dies takes nothing of anyone's with it; a copy
  that idles out, or a replica shutting down, drops only its copy;
- **one count of open sessions**: ``server.mcp.max_sessions`` and ``max_sessions_per_key`` are
  checked against every replica's sessions as one opens (503 ``Too many open sessions``, or 429
  ``mcp_sessions`` for the key, as on one replica); a session leaves the count when its client
  ends it (``DELETE``), when it idles out everywhere, or when its opening request fails;
- **list changes for every replica's listeners**: a list change this replica hears goes on the
  channel, and one another replica heard reaches this one's listeners (``changes.py``: once each).

Redis unreachable: a replica serves the sessions it holds and counts ``mcp_sessions`` in
``multiplexer_state_degraded_total``; a session it does not hold answers 404 as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Protocol

import anyio
import mcp_types as types
from anyio.abc import TaskGroup, TaskStatus
from mcp import MCPError
from mcp.server import ServerRequestContext
from mcp.server.auth.middleware.bearer_auth import (
    AuthenticatedUser,
    AuthorizationContext,
    authorization_context,
)
from mcp.server.connection import Connection
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER, StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager, _send_and_report_status
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher, cancelled_request_id_from_params
from mcp.shared.message import ServerMessageMetadata, SessionMessage
from mcp.shared.transport_context import TransportContext
from mcp_types import (
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    jsonrpc_message_adapter,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Outcome
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.state import StateUnavailable
from multiplexer.faces.http import rpc_error
from multiplexer.faces.mcp.server import McpFace, connection_of

log = logging.getLogger(__name__)

_LIST_CHANGED = frozenset({"notifications/tools/list_changed", "notifications/resources/list_changed",
                           "notifications/prompts/list_changed"})
DUPLICATE_WINDOW_S = 1.0  # one list change heard by several replicas reaches a client once
ACK_S = 2.0  # how long a retry waits for the replica holding its call to say so


class SessionStore(Protocol):
    """The shared state's side (``backends/redis_mcp_sessions.py``)."""

    replica_id: str

    async def save(self, mount: str, session_id: str, fields: dict[str, str], ttl_s: float) -> None: ...
    async def load(self, mount: str, session_id: str, ttl_s: float) -> dict[str, str] | None: ...
    async def touch(self, mount: str, session_id: str, ttl_s: float) -> bool: ...
    async def set_field(self, mount: str, session_id: str, field: str, value: str,
                        ttl_s: float) -> bool: ...
    async def delete(self, mount: str, session_id: str, owner: str = "") -> None: ...
    async def open(self, mount: str, session_id: str, owner: str, ttl_s: float, most: int | None,
                   per_owner: int | None) -> tuple[bool, str, int]: ...
    async def publish(self, mount: str, message: dict[str, Any]) -> None: ...
    async def listen(self, mount: str, deliver: Callable[[dict[str, Any]], Awaitable[None]], *,
                     task_status: TaskStatus[None] = ...) -> None: ...


def session_manager(face: McpFace, mount: str, **settings: Any) -> StreamableHTTPSessionManager:
    """The SDK's session manager for one MCP mount; shared across replicas where the gateway has
    shared state that keeps sessions (``state.url``)."""
    state = face.gateway.state
    sessions = getattr(state, "mcp_sessions", None)
    manager = (StreamableHTTPSessionManager(app=face.server, **settings) if sessions is None
               else ReplicaSessionManager(face, mount, sessions(), **settings))
    face.gateway.faces[f"{mount}:sessions"] = manager  # for those who look (tests, the dashboard)
    return manager


def _owner(scope: Scope) -> AuthorizationContext | None:
    """Who a request comes as, the way the SDK binds a session to the credential that opened it."""
    user = scope.get("user")
    return authorization_context(user) if isinstance(user, AuthenticatedUser) else None


def _related(item: SessionMessage) -> bool:
    metadata = item.metadata
    return isinstance(metadata, ServerMessageMetadata) and metadata.related_request_id is not None


def _wire(message: JSONRPCMessage) -> str:
    return message.model_dump_json(by_alias=True, exclude_unset=True)


@dataclass
class _Copy:
    """This replica's copy of a session: what delivers to it and what waits on it."""

    transport: StreamableHTTPServerTransport
    write: Any  # the transport's own write stream (past the forwarding wrapper)
    dispatcher: _Dispatcher
    connection: Connection
    streams: int = 0  # the client's GET streams open here
    shared: bool = True  # False: opened while the shared state was unreachable, kept here only
    touched: float = field(default_factory=time.monotonic)
    heard: dict[str, float] = field(default_factory=dict)  # list change -> when last sent

    def duplicate(self, method: str) -> bool:
        """A list change sent to this client within the window (by this replica or another)."""
        if method not in _LIST_CHANGED:
            return False
        now = time.monotonic()
        last = self.heard.get(method)
        self.heard[method] = now
        return last is not None and now - last < DUPLICATE_WINDOW_S


class _Dispatcher(JSONRPCDispatcher[TransportContext]):
    """The SDK's dispatcher, knowing which inbound messages belong to another replica.

    Its server-to-client request ids start at a random base of its own, so the requests of two
    replicas on one session never share an id (the client answers each on whichever replica).
    """

    def __init__(self, *args: Any, manager: ReplicaSessionManager, session_id: str,
                 id_base: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._manager = manager
        self._session_id = session_id
        self._id_base = id_base
        self._handlers: tuple[Any, Any] | None = None

    def _allocate_id(self) -> int:
        self._next_id += 1
        return self._id_base + self._next_id

    async def run(self, on_request: Any, on_notify: Any, on_notify_intercept: Any = None, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._handlers = (on_request, on_notify)
        await super().run(on_request, on_notify, on_notify_intercept, task_status=task_status)

    async def _dispatch(self, item: SessionMessage | Exception, on_request: Any, on_notify: Any,
                        sender_ctx: Any) -> None:
        if isinstance(item, SessionMessage) and not self.waits_for(item.message):
            await self._manager.forward(self._session_id, "in", item.message)
            return
        await super()._dispatch(item, on_request, on_notify, sender_ctx)

    def waits_for(self, message: JSONRPCMessage) -> bool:
        """Whether an inbound message is this copy's (a request always is: it was sent here)."""
        if isinstance(message, JSONRPCResponse | JSONRPCError):
            return message.id is None or coerce_request_id(message.id) in self._pending
        if isinstance(message, JSONRPCNotification):
            params = message.params
            if message.method == "notifications/cancelled":
                rid = cancelled_request_id_from_params(params)
                return rid is None or coerce_request_id(rid) in self._in_flight
            if message.method == "notifications/progress" and isinstance(params, dict):
                token = params.get("progressToken")
                return not isinstance(token, str | int) or coerce_request_id(token) in self._pending
        return True

    async def take(self, message: JSONRPCMessage) -> None:
        """Another replica's inbound message: handled here if this copy waits for it."""
        if self._handlers is None or not self.waits_for(message):
            return
        on_request, on_notify = self._handlers
        await super()._dispatch(SessionMessage(message), on_request, on_notify, None)


class _Outbound:
    """The transport's write stream; a message for the standalone stream goes to the replica that
    holds the client's GET stream when this one does not."""

    def __init__(self, real: Any, manager: ReplicaSessionManager, session_id: str) -> None:
        self.real = real
        self.manager = manager
        self.session_id = session_id

    async def send(self, item: SessionMessage, /) -> None:
        message = item.message
        if isinstance(message, JSONRPCRequest | JSONRPCNotification) and not _related(item):
            copy = self.manager.copies.get(self.session_id)
            if copy is None or copy.streams == 0:
                await self.manager.forward(self.session_id, "out", message)
                return
            if isinstance(message, JSONRPCNotification) and copy.duplicate(message.method):
                return
        await self.real.send(item)

    async def aclose(self) -> None:
        await self.real.aclose()

    async def __aenter__(self) -> _Outbound:
        await self.real.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        return await self.real.__aexit__(exc_type, exc, tb)  # type: ignore[no-any-return]


class _ConnectionCtx:
    """Enough of a request context for ``McpFace.set_log_level`` to find a rebuilt connection."""

    def __init__(self, connection: Connection) -> None:
        self.session = type("_Session", (), {"_connection": connection})()


class ReplicaSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager, with sessions kept in the shared state (see the module doc)."""

    def __init__(self, face: McpFace, mount: str, store: SessionStore, **settings: Any) -> None:
        super().__init__(app=face.server, **settings)
        self.face = face
        self.mount = mount
        self.store = store
        idle = settings.get("session_idle_timeout")
        self.ttl_s = float(idle or face.gateway.config.server.mcp.session_idle_s)
        self.touch_every_s = min(self.ttl_s / 10, 30.0)
        self.copies: dict[str, _Copy] = {}
        self._starting: dict[str, anyio.Event] = {}  # sessions being rebuilt here: set once served
        self.rebuilt = 0  # sessions this replica served without having opened them
        self.forwarded = 0  # messages it handed to another replica
        self.id_base = secrets.randbelow(1 << 20) << 32  # under 2**53: exact in any JSON reader
        self._degraded = face.gateway.metrics.state_degraded_count
        self._tg: TaskGroup | None = None
        self._resumes: dict[str, tuple[anyio.Event, anyio.Event, dict[str, Any]]] = {}  # ack, done, reply
        face.server.middleware.append(self._record)
        face.holds.elsewhere = self._resume_elsewhere
        self._changes_send, self._changes_recv = anyio.create_memory_object_stream[tuple[str, str]](64)
        face.changes.share = self._share_change

    # -- lifetime ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        async with super().run(), anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(partial(self.store.listen, self.mount, self._heard))
            tg.start_soon(self._keep_streamed)
            tg.start_soon(self._publish_changes)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def _keep_streamed(self) -> None:
        """A session whose client only listens on its GET stream here is not idle."""
        while True:
            await anyio.sleep(self.touch_every_s)
            for session_id, copy in list(self.copies.items()):
                if copy.streams and time.monotonic() - copy.touched >= self.touch_every_s:
                    await self._touch(session_id, copy)

    # -- requests ---------------------------------------------------------------------------
    async def _handle_stateful_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_id = Headers(scope=scope).get(MCP_SESSION_ID_HEADER)
        if session_id is None:
            await super()._handle_stateful_request(scope, receive, send)
            return
        starting = self._starting.get(session_id)
        if starting is not None:  # another request of this session is rebuilding it here
            await starting.wait()
        copy = self.copies.get(session_id)
        if session_id not in self._server_instances:
            copy = await self._rebuild(session_id, scope)
        elif (copy is not None and time.monotonic() - copy.touched >= self.touch_every_s
              and not await self._touch(session_id, copy)):
            copy = None  # ended elsewhere, or expired: 404 as the SDK answers
        method = scope.get("method")
        if method == "GET" and copy is not None:
            copy.streams += 1
            try:
                await super()._handle_stateful_request(scope, receive, send)
            finally:
                copy.streams -= 1
            return
        await super()._handle_stateful_request(scope, receive, send)
        if method == "DELETE" and copy is not None and copy.transport.is_terminated:
            await self._ended(session_id)

    async def revision(self, session_id: str) -> str | None:
        """The revision a session negotiated, wherever it was opened (None if unknown)."""
        copy = self.copies.get(session_id)
        if copy is not None:
            return copy.connection.protocol_version
        try:
            record = await self.store.load(self.mount, session_id, self.ttl_s)
        except StateUnavailable:
            self._degraded("mcp_sessions")
            return None
        return record.get("v") if record is not None else None

    async def _touch(self, session_id: str, copy: _Copy) -> bool:
        """The session's idle time starts again everywhere; False (and this copy dropped) if the
        shared state no longer has it."""
        copy.touched = time.monotonic()
        if not copy.shared:
            return True  # no record to keep: the session lives here, idling out as the SDK's do
        try:
            alive = await self.store.touch(self.mount, session_id, self.ttl_s)
        except StateUnavailable:
            self._degraded("mcp_sessions")
            return True
        if not alive:
            await self._discard_session(session_id, copy.transport)
        return alive

    async def _ended(self, session_id: str) -> None:
        """The client ended its session here: every replica's copy ends too."""
        try:
            await self.store.delete(self.mount, session_id)
            await self.store.publish(self.mount, {"k": "end", "s": session_id})
        except StateUnavailable:
            self._degraded("mcp_sessions")

    async def _rebuild(self, session_id: str, scope: Scope) -> _Copy | None:
        """This replica's copy of a session another one opened, from its record; None where there
        is no record, it was opened with another credential or on another path (then the SDK
        answers 404, as for a session that does not exist), or this replica is full."""
        try:
            record = await self.store.load(self.mount, session_id, self.ttl_s)
        except StateUnavailable:
            self._degraded("mcp_sessions")
            return None
        if record is None:
            return None
        owner = _owner(scope)
        if json.loads(record.get("owner") or "null") != owner or record.get("path") != scope.get("path"):
            log.warning("not rebuilding MCP session %s: another credential or path", session_id[:64])
            return None
        async with self._session_creation_lock:
            starting = self._starting.get(session_id)
            if starting is None:
                if session_id in self._server_instances:
                    return self.copies.get(session_id)
                if self.max_sessions is not None and len(self._server_instances) >= self.max_sessions:
                    return None
                transport = StreamableHTTPServerTransport(
                    mcp_session_id=session_id, is_json_response_enabled=self.json_response,
                    event_store=self.event_store, security_settings=self.security_settings,
                    retry_interval=self.retry_interval, idle_timeout=self.session_idle_timeout)
                if owner is not None:
                    self._session_owners[session_id] = owner
                self._server_instances[session_id] = transport
                ready = self._starting[session_id] = anyio.Event()
        if starting is not None:  # a request of the same session got here first: its copy
            await starting.wait()
            return self.copies.get(session_id)
        assert self._task_group is not None
        self.rebuilt += 1
        try:
            await self._task_group.start(partial(self._serve, transport, record))
        except Exception:
            log.exception("MCP session %s could not be rebuilt from its record", session_id[:64])
            await self._discard_session(session_id, transport)
            return None
        finally:
            del self._starting[session_id]
            ready.set()
        return self.copies.get(session_id)

    async def _serve_opening_request(self, http_transport: StreamableHTTPServerTransport, scope: Scope,
                                     receive: Receive, send: Send) -> None:
        """The SDK's, with this module's session task: a request without a session id opens one,
        kept only if it is answered."""
        session_id = http_transport.mcp_session_id
        assert session_id is not None and self._task_group is not None
        established = counted = False
        owner = json.dumps(_owner(scope))
        try:
            refusal, counted = await self._count_open(session_id, owner)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            await self._task_group.start(partial(self._serve, http_transport, None))
            status = await _send_and_report_status(http_transport.handle_request, scope, receive, send)
            established = status is not None and status < 400
        finally:
            if not established:
                await self._discard_session(session_id, http_transport)
                if counted:
                    with anyio.CancelScope(shield=True):
                        await self._uncount(session_id, owner)

    async def _count_open(self, session_id: str, owner: str) -> tuple[Any, bool]:
        """The opening session counted for every replica under ``max_sessions`` and
        ``max_sessions_per_key``: (None, whether it was counted) or (the refusal to send, False).
        The shared state unreachable: this replica's own caps only, the decision counted."""
        mcp = self.face.gateway.config.server.mcp
        try:
            taken, cap, held = await self.store.open(self.mount, session_id, owner, self.ttl_s,
                                                     self.max_sessions, mcp.max_sessions_per_key)
        except StateUnavailable:
            self._degraded("mcp_sessions")
            return None, False
        if taken:
            return None, True
        if cap == "key":
            error = RpcError(Code.RATE_LIMITED, "Rate limited: too many open MCP sessions for this key",
                             {"limit": "mcp_sessions", "max": mcp.max_sessions_per_key, "open": held})
            return rpc_error(429, error), False
        log.warning("Refusing to open a new session: %d sessions are open on the replicas", held)
        error = RpcError(types.INTERNAL_ERROR, "Too many open sessions")
        return rpc_error(503, error), False

    async def _uncount(self, session_id: str, owner: str) -> None:
        try:
            await self.store.delete(self.mount, session_id, owner)
        except StateUnavailable:
            self._degraded("mcp_sessions")  # it leaves the count as it idles out

    async def _serve(self, transport: StreamableHTTPServerTransport, record: dict[str, str] | None, *,
                     task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """One session's server task on this replica (``serve_loop``'s recipe, with this module's
        dispatcher and write stream); a rebuilt session starts initialized, as its record says."""
        session_id = transport.mcp_session_id
        assert session_id is not None
        async with transport.connect() as (read_stream, write_stream):
            dispatcher = _Dispatcher(read_stream, _Outbound(write_stream, self, session_id),
                                     inline_methods=frozenset({"initialize"}), manager=self,
                                     session_id=session_id, id_base=self.id_base)
            connection = Connection.for_loop(dispatcher, session_id=session_id)
            copy = _Copy(transport, write_stream, dispatcher, connection)
            self.copies[session_id] = copy
            try:
                if record is not None:
                    await self._restore(connection, record)
                task_status.started()
                idle_scope = transport.idle_scope or anyio.CancelScope()
                with idle_scope:
                    await serve_connection(self.app, dispatcher, connection=connection,
                                           lifespan_state=self._lifespan_state)
                if idle_scope.cancelled_caught:
                    log.info("MCP session %s idle here: this replica's copy dropped", session_id)
            except Exception:
                log.exception("MCP session %s crashed", session_id)
            finally:
                if self.copies.get(session_id) is copy:
                    del self.copies[session_id]
                await self._discard_session(session_id, transport)

    async def _restore(self, connection: Connection, record: dict[str, str]) -> None:
        connection.protocol_version = record.get("v") or LATEST_HANDSHAKE_VERSION
        init = record.get("init")
        if init:
            connection.client_params = types.InitializeRequestParams.model_validate_json(init)
        connection.initialized.set()
        level = record.get("level")
        if level:
            await self._set_level(connection, level)

    async def _set_level(self, connection: Connection, level: str) -> None:
        """The level as the face's ``logging/setLevel`` handler keeps it for a connection."""
        try:
            params = types.SetLevelRequestParams.model_validate({"level": level})
        except ValueError:
            return
        await self.face.set_log_level(_ConnectionCtx(connection), params)  # type: ignore[arg-type]

    # -- the record ----------------------------------------------------------------------------
    async def _record(self, ctx: ServerRequestContext[Any, Any],
                      call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        """Middleware: what a session needs on another replica, written before its answer leaves
        (the client's next request may reach another replica at once)."""
        result = await call_next(ctx)
        if ctx.method not in ("initialize", "logging/setLevel"):
            return result
        connection = connection_of(ctx)
        session_id = getattr(connection, "session_id", None)
        if not session_id:
            return result  # stdio, or a 2026-07-28 exchange: nothing to share
        try:
            if ctx.method == "initialize":
                await self.store.save(self.mount, session_id, self._fields(ctx), self.ttl_s)
            else:
                level = (ctx.params or {}).get("level")
                if isinstance(level, str):  # for copies made from now on, and those made before
                    await self.store.set_field(self.mount, session_id, "level", level, self.ttl_s)
                    await self.store.publish(self.mount, {"k": "level", "s": session_id, "v": level})
        except StateUnavailable:
            self._degraded("mcp_sessions")
            copy = self.copies.get(session_id)
            if copy is not None and ctx.method == "initialize":
                copy.shared = False
            log.warning("MCP session %s not shared: the shared state is unreachable; it stays on "
                        "this replica", session_id[:64])
        return result

    @staticmethod
    def _fields(ctx: ServerRequestContext[Any, Any]) -> dict[str, str]:
        params = types.InitializeRequestParams.model_validate(ctx.params or {}, by_name=False)
        asked = params.protocol_version
        scope = getattr(ctx.request, "scope", None) or {}
        return {
            "v": asked if asked in HANDSHAKE_PROTOCOL_VERSIONS else LATEST_HANDSHAKE_VERSION,
            "init": params.model_dump_json(by_alias=True, exclude_none=True),
            "owner": json.dumps(_owner(scope)),
            "path": str(scope.get("path", "")),
        }

    # -- between replicas ----------------------------------------------------------------------
    async def forward(self, session_id: str, kind: str, message: JSONRPCMessage) -> None:
        """A message this replica cannot deliver, to whichever replica can ("out": holds the
        client's GET stream; "in": waits for this answer); best effort, like a notification."""
        self.forwarded += 1
        try:
            await self.store.publish(self.mount, {"k": kind, "s": session_id, "m": _wire(message)})
        except StateUnavailable:
            self._degraded("mcp_sessions")

    def _share_change(self, event: str, change: str) -> None:
        """A list change this replica heard, for the others' listeners (best effort, like the
        notification itself: dropped when 64 wait to go)."""
        with contextlib.suppress(anyio.WouldBlock):
            self._changes_send.send_nowait((event, change))

    async def _publish_changes(self) -> None:
        async for event, change in self._changes_recv:
            try:
                await self.store.publish(self.mount, {"k": "list", "e": event, "c": change})
            except StateUnavailable:
                self._degraded("mcp_sessions")

    async def _heard(self, data: dict[str, Any]) -> None:
        session_id, kind = data.get("s"), data.get("k")
        if kind == "list":
            self.face.changed_elsewhere(str(data.get("e")), str(data.get("c")))
            return
        if kind == "resume":
            if self._tg is not None:
                self._tg.start_soon(self._resume_here, data)
            return
        if kind in ("ack", "done"):
            self._replied(kind, data)
            return
        if not isinstance(session_id, str):
            return
        if kind == "end":
            transport = self._server_instances.get(session_id)
            if transport is not None:
                await self._discard_session(session_id, transport)
            return
        copy = self.copies.get(session_id)
        if copy is None:
            return
        if kind == "level":
            await self._set_level(copy.connection, str(data.get("v")))
            return
        try:
            message = jsonrpc_message_adapter.validate_json(data.get("m") or "", by_name=False)
        except ValueError:
            return
        try:
            if kind == "out" and copy.streams:
                if isinstance(message, JSONRPCNotification) and copy.duplicate(message.method):
                    return
                with anyio.move_on_after(1.0):
                    await copy.write.send(SessionMessage(message))
            elif kind == "in":
                await copy.dispatcher.take(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the copy is ending

    # -- 2026-07-28 calls held for their client's answers (held.py), resumed on another replica ----
    async def _resume_elsewhere(self, state: str, identity: str | None, responses: dict[str, Any],
                                refusal: MCPError) -> Outcome | types.InputRequiredResult:
        """A retry whose call another replica holds: its answers go there, and what the held call
        says next (its next questions, or its outcome) comes back. No replica holds it: ``refusal``."""
        asked = secrets.token_hex(8)
        acked, done = anyio.Event(), anyio.Event()
        reply: dict[str, Any] = {}
        self._resumes[asked] = (acked, done, reply)
        try:
            await self.store.publish(self.mount, {"k": "resume", "q": asked, "t": state, "i": identity,
                                                  "r": responses})
            with anyio.move_on_after(ACK_S):
                await acked.wait()
            if not acked.is_set():
                raise refusal
            with anyio.fail_after(self._resume_limit_s()):
                await done.wait()
        except StateUnavailable:
            self._degraded("mcp_sessions")
            raise refusal from None
        except TimeoutError:
            raise MCPError(types.INTERNAL_ERROR, "the replica holding this call stopped answering",
                           {"requestState": state}) from None
        finally:
            del self._resumes[asked]
        return _decoded(reply["o"])

    def _resume_limit_s(self) -> float:
        """The longest a held call may take to say what it does next: a question's wait, then the
        call's own time."""
        server = self.face.gateway.config.server
        return server.mcp.ask_timeout_s + server.default_timeout_ms / 1000

    def _replied(self, kind: str, data: dict[str, Any]) -> None:
        waiting = self._resumes.get(str(data.get("q")))
        if waiting is None or data.get("to") != self.store.replica_id:
            return
        acked, done, reply = waiting
        acked.set()
        if kind == "done":
            reply["o"] = data.get("o")
            done.set()

    async def _resume_here(self, data: dict[str, Any]) -> None:
        """Another replica's retry of a call held here: answered as a retry reaching this one is."""
        state = data.get("t")
        identity = data.get("i")
        try:
            held = self.face.holds.resuming(state if isinstance(state, str) else None,
                                            identity if isinstance(identity, str) else None)
        except MCPError:
            return  # not here (or not this caller's)
        if held is None:
            return
        answer = {"q": data.get("q"), "to": data.get("from")}
        try:
            await self.store.publish(self.mount, {"k": "ack", **answer})
            responses = data.get("r")
            held.answer(responses if isinstance(responses, dict) else {})
            got = await held.next()
            if isinstance(got, Outcome):
                held.collected.set()
            await self.store.publish(self.mount, {"k": "done", **answer, "o": _encoded(got)})
        except StateUnavailable:
            self._degraded("mcp_sessions")


def _encoded(got: Outcome | types.InputRequiredResult) -> dict[str, Any]:
    if isinstance(got, types.InputRequiredResult):
        return {"input_required": got.model_dump(by_alias=True, mode="json", exclude_none=True)}
    body: dict[str, Any] = {"cost": got.cost_pico, "saved": got.saved_pico}
    if got.error is not None:
        body["error"] = got.error.to_dict()
    elif got.result_json is not None:
        body["result_json"] = got.result_json.decode()
    else:
        body["result"] = got.result
    return body


def _decoded(body: Any) -> Outcome | types.InputRequiredResult:
    if not isinstance(body, dict):
        raise MCPError(types.INTERNAL_ERROR, "the replica holding this call answered nothing usable")
    if "input_required" in body:
        return types.InputRequiredResult.model_validate(body["input_required"])
    error = body.get("error")
    if isinstance(error, dict):
        outcome = Outcome(error=RpcError(int(error.get("code", types.INTERNAL_ERROR)),
                                         str(error.get("message", "")), error.get("data")))
    elif isinstance(body.get("result_json"), str):
        outcome = Outcome(result_json=body["result_json"].encode())
    else:
        outcome = Outcome(body.get("result"))
    outcome.cost_pico = body.get("cost")
    outcome.saved_pico = int(body.get("saved") or 0)
    return outcome


__all__ = ["ReplicaSessionManager", "SessionStore", "session_manager"]
