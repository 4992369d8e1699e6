"""Cancelling a request's work when its client goes away, without a task per request.

ASGI says a disconnect only through ``receive()``, so an endpoint that must notice one
while it waits for upstream work needs a second task parked on ``receive()``. On this
host that task (a task group, a spawn, a cancel) cost about a fifth of the gateway's CPU
on a small ``/rpc`` call. The gateway's own server (``faces/server_protocol.py``) puts a
hook in the scope instead: the connection calls it when it is lost. Under any other ASGI
server the watcher task still does the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
from starlette.types import Receive, Scope

HOOK = "multiplexer.disconnect"  # scope["extensions"][HOOK]: OnDisconnect
# scope["extensions"][DIRECT]: the server called the endpoint directly, and cancels the request's
# task itself when the client goes (faces/server_protocol.py)
DIRECT = "multiplexer.direct"
# scope["extensions"][FLUSH]: sends what the connection holds for the end of the loop's turn now
# (a stream's first event leaves at once, not after the rest of the provider's turn)
FLUSH = "multiplexer.flush"
# scope["extensions"][CHUNK]: writes one chunk of a streamed response whose head went out (the
# ASGI send's work for it, at a stream's rate); False where it cannot, and the ASGI send must
CHUNK = "multiplexer.chunk"
_NOTHING: AbstractAsyncContextManager[object] = contextlib.nullcontext()


class OnDisconnect:
    """Callbacks the connection runs once, when it is lost with a response still owed."""

    __slots__ = ("callbacks", "gone")

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], object]] = []
        self.gone = False

    def add(self, callback: Callable[[], object]) -> None:
        if self.gone:
            callback()
        else:
            self.callbacks.append(callback)

    def discard(self, callback: Callable[[], object]) -> None:
        if callback in self.callbacks:
            self.callbacks.remove(callback)

    def fire(self) -> None:
        self.gone = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


def cancelled_on_disconnect(scope: Scope, receive: Receive) -> AbstractAsyncContextManager[object]:
    """A block that the client's disconnect cancels: nothing to add where the server cancels the
    whole request (a direct call), a cancel scope on the server's hook, else a watcher task."""
    extensions = scope.get("extensions", {})
    if extensions.get(DIRECT):
        return _NOTHING
    hook = extensions.get(HOOK)
    if isinstance(hook, OnDisconnect):
        return _Hooked(hook)
    return _watched(receive)


class _Hooked:
    """The scope under the gateway's own server: a class, not a generator, as every request
    enters it (the generator's machinery cost as much as the scope)."""

    __slots__ = ("cancel", "hook")

    def __init__(self, hook: OnDisconnect) -> None:
        self.hook = hook
        self.cancel = anyio.CancelScope()

    async def __aenter__(self) -> anyio.CancelScope:
        self.cancel.__enter__()
        self.hook.add(self.cancel.cancel)
        return self.cancel

    async def __aexit__(self, *exc: Any) -> bool:
        self.hook.discard(self.cancel.cancel)
        return self.cancel.__exit__(*exc)


@asynccontextmanager
async def _watched(receive: Receive) -> AsyncIterator[anyio.CancelScope]:
    """Under any other ASGI server: a task parked on ``receive()`` cancels the scope."""

    async def watch(cancel: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        cancel.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        yield tg.cancel_scope
        tg.cancel_scope.cancel()
