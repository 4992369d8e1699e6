"""uvicorn's httptools protocol with a disconnect hook in every request's scope.

Everything else (parsing, keep-alive, pipelining, flow control, shutdown) stays uvicorn's;
this only adds ``scope["extensions"]["multiplexer.disconnect"]`` and fires it when the
connection is lost before the response is complete (see ``faces/disconnect.py``).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from multiplexer.faces.disconnect import HOOK, OnDisconnect


class GatewayHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owed: list[tuple[RequestResponseCycle, OnDisconnect]] = []  # requests still owed an answer

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
