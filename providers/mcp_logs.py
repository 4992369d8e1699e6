"""An upstream's log messages (``notifications/message``), each to the call it belongs to, or to none.

The SDK's client hands a ``logging_callback`` the message alone: which request it
belongs to is gone. This module recovers it on the transport, from two facts:

- Streamable HTTP: a message related to a request travels on that request's own
  response stream, and the SDK's HTTP transport reads each stream in a task that
  inherits the context of whoever sent the request. The request is sent with
  ``CURRENT`` set to its ``LogRoute``, so a message read off its stream names its
  route; a message off the standalone stream, or off a stream the gateway opened
  for itself, names none.
- stdio: one pipe, and a notification names no request. A message belongs to a
  call only when that call is the one request in flight that may log: every
  request on a handshake-era connection (its level is per connection), only those
  that asked (``logLevel`` in ``_meta``) on a 2026-07-28 one. With two such
  requests in flight the message goes to neither (dropped, never swapped).

The rule is applied in wire order as messages are read (a log is read before its
request's reply), and the route delivers in the same order: the caller gets every
log message its call produced before it gets the call's result.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import Context, ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import mcp_types as types
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCError, JSONRPCNotification, JSONRPCRequest, JSONRPCResponse
from pydantic import ValidationError

from multiplexer.core.logs import LogFanout

log = logging.getLogger(__name__)

BUFFER = 256  # messages a slow client may fall behind by before the newest are dropped
R = TypeVar("R")
CURRENT: ContextVar[LogRoute | None] = ContextVar("multiplexer_mcp_log_route", default=None)


class LogRoute:
    """One upstream request's log messages on their way to its callers, in arrival order."""

    def __init__(self, fanout: LogFanout) -> None:
        self.fanout = fanout
        self._send, self._receive = anyio.create_memory_object_stream[types.LoggingMessageNotificationParams](
            BUFFER)

    def put(self, params: types.LoggingMessageNotificationParams) -> None:
        """From the transport's read loop: never waits (a client too far behind loses messages)."""
        try:
            self._send.send_nowait(params)
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            log.debug("an upstream log message was dropped: its callers fall behind")

    async def around(self, send: Callable[[], Awaitable[R]]) -> R:
        """``send()``, delivering while it runs; what is left is delivered before its result returns."""
        async def pump() -> None:
            async with self._receive:
                async for params in self._receive:
                    await self.fanout(params.level, params.data, params.logger)

        failed: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            try:
                result = await send()
            except Exception as e:  # raised below, as itself (not in the task group's group)
                failed = e
            finally:
                self._send.close()
        if failed is not None:
            raise failed
        return result


@dataclass(slots=True)
class _Sent:
    route: LogRoute | None
    may_log: bool


class LogRouter:
    """Per connection: the requests in flight on it, and which call a log message belongs to."""

    def __init__(self, on_event: Callable[[str], None] = lambda event: None) -> None:
        self.modern = False  # the connection speaks 2026-07-28 (set once it is up)
        self.on_event = on_event
        self._inflight: dict[Any, _Sent] = {}

    def sent(self, message: Any) -> None:
        """A message the gateway wrote, seen in the sending task (so ``CURRENT`` is the sender's)."""
        msg = message.message if isinstance(message, SessionMessage) else None
        if isinstance(msg, JSONRPCRequest):
            meta = (msg.params or {}).get("_meta")
            asked = isinstance(meta, dict) and types.LOG_LEVEL_META_KEY in meta
            self._inflight[msg.id] = _Sent(CURRENT.get(), asked or not self.modern)
        elif isinstance(msg, JSONRPCNotification) and msg.method == "notifications/cancelled":
            self._inflight.pop((msg.params or {}).get("requestId"), None)  # no reply will come

    def received(self, item: Any, sender: Context | None) -> None:
        """A message read off the transport, in wire order; ``sender`` is the context of the task
        that read it, where the transport keeps one (Streamable HTTP), else None (stdio)."""
        msg = item.message if isinstance(item, SessionMessage) else None
        if isinstance(msg, JSONRPCResponse | JSONRPCError):
            self._inflight.pop(msg.id, None)
        elif isinstance(msg, JSONRPCNotification) and msg.method == "notifications/message":
            route = self._route(sender)
            if route is None:
                self.on_event("log_dropped")
                return
            try:
                params = types.LoggingMessageNotificationParams.model_validate(msg.params or {})
            except ValidationError:
                return  # the SDK's own parse warns about it
            route.put(params)

    def _route(self, sender: Context | None) -> LogRoute | None:
        if sender is not None:  # the stream it came on says whose it is
            return sender.get(CURRENT)
        candidates = [s for s in self._inflight.values() if s.may_log]
        return candidates[0].route if len(candidates) == 1 else None
