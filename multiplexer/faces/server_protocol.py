"""uvicorn's httptools protocol with a disconnect hook in every request's scope, and writes
joined per turn of the event loop.

Everything else (parsing, keep-alive, pipelining, flow control, shutdown) stays uvicorn's;
this adds ``scope["extensions"]["multiplexer.disconnect"]`` and fires it when the
connection is lost before the response is complete (see ``faces/disconnect.py``), and
hands uvicorn a transport whose writes in one turn of the loop leave as one: uvicorn
writes a response's head and its body separately, two sends and two wakeups of the
client for every answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from multiplexer.faces.disconnect import HOOK, OnDisconnect


class JoinedWrites:
    """A transport whose writes wait for the end of the loop's current turn and leave together.

    A response's head and body, written one after the other, go out in one send (the
    client reads them in one wakeup); a streamed response's chunks still leave every turn.
    Everything but ``write`` and ``close`` is the transport's own."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():  # lost meanwhile: nobody to read it
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owed: list[tuple[RequestResponseCycle, OnDisconnect]] = []  # requests still owed an answer

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = JoinedWrites(transport, self.loop)  # type: ignore[assignment]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {HOOK: OnDisconnect()}  # type: ignore[typeddict-unknown-key]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # makes the request's cycle; its task has not run yet
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade: not ours to watch
        self._owed = [(c, h) for c, h in self._owed if not c.response_complete]
        self._owed.append((cycle, self.scope["extensions"][HOOK]))  # type: ignore[typeddict-item]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        owed, self._owed = self._owed, []
        for cycle, hook in owed:
            if not cycle.response_complete:
                hook.fire()
