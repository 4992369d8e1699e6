"""2026-07-28 single-exchange POSTs served in the request's own task, with the SDK's pieces.

The SDK's modern entry (``handle_modern_request``) runs each request's handler in a
task group beside a task parked on ``receive()``, handing notifications over a memory
stream, so that it can switch the response to SSE when one comes. On this host those
tasks cost about a fifth of the gateway's CPU on a small ``tools/call``. Here the
handler (the SDK's ``serve_one``) runs in the ASGI task, a hang-up cancels it through
the server's disconnect hook (``faces/disconnect.py``), and the response commits to
``text/event-stream`` only when a notification goes out (progress, upstream logs) or
the call has been silent for the keepalive interval; otherwise it is one JSON reply,
as the SDK sends it.

Only the well-formed request is served here. Whatever the SDK would refuse or treat
apart (content type, Accept, bodies that do not parse or are notifications,
``subscriptions/listen``, routing-header mismatches, ``Mcp-Param-*`` violations) goes
to the SDK's entry, so every status and error body stays the SDK's own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import anyio
from mcp.server import Server
from mcp.server.connection import Connection
from mcp.server.runner import modern_error_data, serve_one
from mcp.server.streamable_http import check_accept_headers
from mcp.shared.dispatcher import CallOptions
from mcp.shared.exceptions import NoBackChannelError
from mcp.shared.inbound import (
    ERROR_CODE_HTTP_STATUS,
    MCP_PARAM_HEADER_PREFIX,
    InboundLadderRejection,
    classify_inbound_request,
    find_duplicated_routing_header,
    validate_mcp_param_headers,
)
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from mcp.shared.message import ServerMessageMetadata
from mcp.shared.transport_context import TransportContext
from mcp_types import (
    JSONRPCError,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
    ProgressToken,
    RequestId,
)
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from multiplexer.faces.disconnect import cancelled_on_disconnect

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0  # the SDK's entry: silence before SSE commits, and between pings after
_PING: Final = b": ping\r\n\r\n"
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
_PARAM_PREFIX: Final = MCP_PARAM_HEADER_PREFIX.lower()


def sse_event(message: JSONRPCResponse | JSONRPCError | JSONRPCNotification) -> bytes:
    """One ``event: message`` frame, written as the SDK writes it."""
    return b"event: message\r\ndata: " + _json(message) + b"\r\n\r\n"


def _json(message: JSONRPCResponse | JSONRPCError | JSONRPCNotification) -> bytes:
    body = message.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps(body, separators=(",", ":")).encode()


class Exchange:
    """One request's dispatch context (the SDK's ``DispatchContext``) and its response.

    Notifications are written straight to the response, which becomes SSE on the
    first; after the reply is written, late ones are dropped, as the SDK drops them.
    """

    can_send_request = False

    def __init__(self, entry: SingleExchange, send: Send, request_id: RequestId,
                 progress_token: ProgressToken | None, transport: TransportContext,
                 metadata: ServerMessageMetadata) -> None:
        self._entry = entry
        self._send = send
        self.request_id = request_id
        self.progress_token = progress_token
        self.transport = transport
        self.message_metadata = metadata
        self.quiet_since = entry.tick  # the keepalive tick of the last write (or of the start)
        self.committed = False  # text/event-stream has started
        self.closed = False  # the reply is being written: nothing may follow it
        self._lock: anyio.Lock | None = None  # made by the first SSE write
        self._cancel: anyio.Event | None = None

    @property
    def cancel_requested(self) -> anyio.Event:
        """Never set: on this wire a client cancels by hanging up, which cancels the handler."""
        if self._cancel is None:
            self._cancel = anyio.Event()
        return self._cancel

    async def send_raw_request(self, method: str, params: Mapping[str, Any] | None,
                               opts: CallOptions | None = None) -> dict[str, Any]:
        raise NoBackChannelError(method)

    async def notify(self, method: str, params: Mapping[str, Any] | None,
                     opts: CallOptions | None = None) -> None:
        if self.closed:
            log.debug("dropped %s: the reply to %r is written", method, self.request_id)
            return
        body = dict(params) if params is not None else None
        await self.emit(sse_event(JSONRPCNotification(jsonrpc="2.0", method=method, params=body)))

    async def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        if self.progress_token is None:
            return
        params: dict[str, Any] = {"progressToken": self.progress_token, "progress": progress}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        await self.notify("notifications/progress", params)

    async def emit(self, chunk: bytes) -> None:
        """An SSE frame (or keepalive comment) on the open response; SSE starts with the first."""
        if self.closed:
            return
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self.closed:
                return
            if not self.committed:
                self.committed = True
                await self._send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await self._send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.quiet_since = self._entry.tick

    async def reply(self, message: JSONRPCResponse | JSONRPCError) -> None:
        """The reply: the last SSE frame once SSE started, else JSON with the SDK's status for its code."""
        self.closed = True
        if self.committed:
            assert self._lock is not None
            async with self._lock:
                final = sse_event(message)
                await self._send({"type": "http.response.body", "body": final, "more_body": False})
            return
        status = 200
        if isinstance(message, JSONRPCError):
            status = ERROR_CODE_HTTP_STATUS.get(message.error.code, 200)
        body = _json(message)
        await self._send({"type": "http.response.start", "status": status, "headers": [
            (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class SingleExchange:
    """The 2026-07-28 POST entry: the SDK's checks and ``serve_one``, without its per-request tasks.

    ``fallback`` is the SDK's session manager; ``lifespan_state`` gives what the manager
    entered for the server. ``running`` keeps the one task that pings silent calls.
    """

    def __init__(self, app: Server[Any], fallback: ASGIApp, lifespan_state: Callable[[], Any],
                 keepalive_s: float = KEEPALIVE_S, ticks_per_keepalive: int = 15) -> None:
        self.app = app
        self.fallback = fallback
        self.lifespan_state = lifespan_state
        self.keepalive_s = keepalive_s
        self.ticks_per_keepalive = ticks_per_keepalive
        self.tick = 0
        self._open: set[Exchange] = set()
        self._spawn: Callable[..., Any] | None = None
        self._busy: anyio.Event | None = None  # set when a call opens: the ticker runs only then

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self._spawn = tg.start_soon
            tg.start_soon(self._keepalive)
            try:
                yield
            finally:
                self._spawn = None
                tg.cancel_scope.cancel()

    async def _keepalive(self) -> None:
        """Each tick, a ping for every call silent for a keepalive interval (a task only for those);
        with no call open the ticker waits for one instead of waking an idle server every tick."""
        while True:
            if not self._open:
                self._busy = anyio.Event()
                await self._busy.wait()
            await anyio.sleep(self.keepalive_s / self.ticks_per_keepalive)
            self.tick += 1
            for exchange in list(self._open):
                if self.tick - exchange.quiet_since >= self.ticks_per_keepalive and self._spawn is not None:
                    exchange.quiet_since = self.tick
                    self._spawn(self._ping, exchange)

    async def _ping(self, exchange: Exchange) -> None:
        try:
            await exchange.emit(_PING)
        except Exception:  # a broken response must not end the keepalive task's group
            log.debug("keepalive ping to %r failed", exchange.request_id, exc_info=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, headers: Headers,
                       body: bytes) -> None:
        """``receive`` replays ``body``, already read; the SDK's entry gets both when it is to answer."""
        request = self._admit(scope, headers, body) if self._spawn is not None else None
        if request is None:
            await self.fallback(scope, receive, send)
            return
        req, verdict = request
        connection = Connection.from_envelope(verdict.protocol_version, verdict.client_info,
                                              verdict.client_capabilities)
        exchange = Exchange(self, send, req.id, progress_token_from_params(req.params),
                            TransportContext(kind="streamable-http", can_send_request=False, headers=headers),
                            ServerMessageMetadata(request_context=Request(scope, receive)))
        self._open.add(exchange)
        if self._busy is not None and not self._busy.is_set():
            self._busy.set()
        try:
            reply: JSONRPCResponse | JSONRPCError | None = None
            async with cancelled_on_disconnect(scope, receive):
                try:
                    result = await serve_one(self.app, exchange, req.method, req.params,
                                             connection=connection, lifespan_state=self.lifespan_state())
                except Exception as exc:
                    reply = JSONRPCError(jsonrpc="2.0", id=req.id, error=modern_error_data(exc))
                else:
                    reply = JSONRPCResponse(jsonrpc="2.0", id=req.id, result=result)
            if reply is not None:  # None: the client hung up, and its call was cancelled
                await exchange.reply(reply)
        finally:
            self._open.discard(exchange)
            exchange.closed = True

    def _admit(self, scope: Scope, headers: Headers, body: bytes) -> tuple[JSONRPCRequest, Any] | None:
        """The request and its envelope, if the SDK's entry would serve it; None to let it answer."""
        # Each header once, the first of a name as ``Headers`` reads it (a lookup there walks the list).
        folded = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}
        if not folded.get("content-type", "").lower().startswith("application/json"):
            return None
        if not all(check_accept_headers(Request(scope))):  # the SDK's own check, SSE mode
            return None
        try:
            decoded = json.loads(body)
            if not isinstance(decoded, dict) or "id" not in decoded:
                return None
            req = JSONRPCRequest.model_validate(decoded)
        except (ValueError, RecursionError):  # ValidationError is a ValueError
            return None
        if req.method == "subscriptions/listen":  # a stream by nature: the SDK's
            return None
        if find_duplicated_routing_header(headers.items()) is not None:
            return None
        verdict = classify_inbound_request(decoded, headers=folded)
        if isinstance(verdict, InboundLadderRejection) or self._param_rejected(req, headers):
            return None
        return req, verdict

    def _param_rejected(self, req: JSONRPCRequest, headers: Headers) -> bool:
        """Whether a ``tools/call``'s ``Mcp-Param-*`` headers disagree with its arguments
        (the SDK's check, on the schema of the face's last listing)."""
        if req.method != "tools/call":
            return False
        params = req.params or {}
        name, arguments = params.get("name"), params.get("arguments")
        if not isinstance(name, str) or (arguments is not None and not isinstance(arguments, Mapping)):
            return False
        if not arguments and not any(h.startswith(_PARAM_PREFIX) for h in headers):
            return False
        lookup = self.app.get_tool_input_schema
        if lookup is None:  # the SDK walks the server's tools/list for the schema, if it has one
            return self.app.get_request_handler("tools/list") is not None
        try:
            schema = lookup(name)
        except Exception:
            return True  # the SDK logs it and skips the check
        return schema is not None and validate_mcp_param_headers(schema, arguments or {}, headers) is not None

