"""Each provider of a running gateway in a task of its own, started and closed in that task.

A provider may enter task groups in ``start`` (an MCP upstream's session supervisor, a local
model's pool); they must be exited in the task that entered them. So each provider, whether the
gateway started it or a config reload did (``gateway/reload.py``), runs ``start`` and later
``aclose`` in one task of the gateway's ``ProviderLives`` task group, inside a shielded scope:
the gateway's own cancellation never reaches it, ``ProviderLife.close`` ends it. That lets a
reload close a provider it drained as soon as its last call ended, whichever started it, instead
of only when the gateway stops. As the gateway stops, the providers still open are closed one at a
time in the reverse order of their starts (as an exit stack closes them).
"""

from __future__ import annotations

import logging
from types import TracebackType

import anyio
import anyio.abc

from multiplexer.core.provider import Provider

log = logging.getLogger(__name__)


class ProviderLife:
    """One provider's task: started, then closed, in this one task.

    The task's shielded scope is entered before the provider starts, so the task groups a
    provider enters in ``start`` nest inside it and exit in ``aclose`` in the same task. A start
    that raised leaves ``error`` set and nothing to close (``aclose`` is not called, as a
    provider whose start failed was never started); ``close`` cancels a start still under way."""

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.up = anyio.Event()  # its start ended, well (``error`` None) or not
        self.closed = anyio.Event()  # its task has ended: closed, or its start failed
        self._close = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self.error: BaseException | None = None

    def close(self) -> None:
        """Have its task close it (at once when it is up; a start under way is cancelled)."""
        self._close.set()
        if not self.up.is_set() and self._scope is not None:
            self._scope.cancel()

    async def run(self) -> None:
        try:
            with anyio.CancelScope(shield=True) as self._scope:
                try:
                    await self.provider.start()
                except Exception as e:
                    self.error = e
                self.up.set()
                if self.error is None:
                    await self._close.wait()
                    try:
                        await self.provider.aclose()
                    except Exception:
                        log.exception("provider %s did not close cleanly", self.provider.name)
        finally:
            if not self.up.is_set():  # its start was cancelled (it took too long)
                self.error = self.error or TimeoutError("its start did not end in time")
            self.up.set()
            self.closed.set()


class ProviderLives:
    """The gateway's providers' tasks (entered on the gateway's exit stack before the first
    provider starts, so its exit, which closes those still open, comes after everything the
    gateway entered later: its own task group, the writers, the key store)."""

    def __init__(self) -> None:
        self._tg: anyio.abc.TaskGroup | None = None
        self.open: list[ProviderLife] = []  # started and not closed yet, in the order they started

    async def __aenter__(self) -> ProviderLives:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        with anyio.CancelScope(shield=True):  # a shutdown's cancel still closes each one
            for life in reversed(list(self.open)):
                await self.close(life)
        assert self._tg is not None
        tg, self._tg = self._tg, None
        return await tg.__aexit__(kind, exc, tb)

    async def start(self, provider: Provider, timeout_s: float | None = None) -> ProviderLife:
        """``provider`` started in a task of its own; raises what its start raised (a start
        longer than ``timeout_s`` is cancelled: ``TimeoutError``)."""
        if self._tg is None:
            raise RuntimeError("the gateway is not running")
        life = ProviderLife(provider)
        self._tg.start_soon(life.run)
        self.open.append(life)  # closed with the others should this wait be cancelled
        with anyio.move_on_after(timeout_s):
            await life.up.wait()
        if not life.up.is_set():
            life.close()
            await life.up.wait()
        if life.error is not None:
            self.open.remove(life)
            raise life.error
        return life

    async def close(self, life: ProviderLife) -> None:
        """Close one provider now and wait until it has closed."""
        life.close()
        await life.closed.wait()
        if life in self.open:
            self.open.remove(life)
