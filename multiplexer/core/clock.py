"""Injectable time: the real monotonic clock, and a manual clock for tests.

Everything that waits (lanes, limiters, deadlines) asks a ``Clock`` so tests can
drive time explicitly instead of sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from typing import Protocol

import anyio


class Clock(Protocol):
    def now(self) -> float: ...

    def wall(self) -> float:
        """Seconds since the epoch, for absolute instants that upstreams send (Retry-After dates,
        rate-limit resets) and for what is stored across restarts; ``now`` is for waiting."""
        ...

    async def sleep_until(self, deadline: float) -> None: ...

    async def wait_event(self, event: anyio.Event, deadline: float | None) -> bool:
        """Wait for ``event`` until ``deadline``; True when the event fired."""
        ...

    def wake_at(self, event: Settable, deadline: float) -> Timer:
        """Set ``event`` at ``deadline`` unless the timer is cancelled first.

        For a waiter that owns its event and rechecks the time when woken (``wait_own``): a
        loop timer in place of ``wait_event``'s cancel scope around the wait."""
        ...


class Timer(Protocol):
    def cancel(self) -> None: ...


class Settable(Protocol):
    def set(self) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        await anyio.sleep(max(0.0, deadline - time.monotonic()))

    async def wait_event(self, event: anyio.Event, deadline: float | None) -> bool:
        if deadline is None:
            await event.wait()
            return True
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            await event.wait()
        return event.is_set()

    def wake_at(self, event: Settable, deadline: float) -> Timer:
        """The running event loop's timer (the gateway runs on asyncio)."""
        return asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), event.set)


class ManualClock:
    """Time moves only when a test calls ``advance``."""

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall - start
        self._timers: list[tuple[float, int, anyio.Event | _ManualTimer]] = []
        self._ids = itertools.count()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        """Wall time moves with ``advance``, from the ``wall`` the clock was made with."""
        return self._now + self._wall_offset

    def _schedule(self, deadline: float, target: anyio.Event | _ManualTimer) -> None:
        """Set ``target`` now if ``deadline`` has passed, else when ``advance`` reaches it."""
        if deadline <= self._now:
            target.set()
        else:
            heapq.heappush(self._timers, (deadline, next(self._ids), target))

    def _timer(self, deadline: float) -> anyio.Event:
        ev = anyio.Event()
        self._schedule(deadline, ev)
        return ev

    async def sleep_until(self, deadline: float) -> None:
        await self._timer(deadline).wait()

    async def wait_event(self, event: anyio.Event, deadline: float | None) -> bool:
        if event.is_set():
            return True
        if deadline is None:
            await event.wait()
            return True
        timer = self._timer(deadline)
        async with anyio.create_task_group() as tg:

            async def watch(ev: anyio.Event) -> None:
                await ev.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch, event)
            tg.start_soon(watch, timer)
        return event.is_set()

    def wake_at(self, event: Settable, deadline: float) -> Timer:
        timer = _ManualTimer(event)
        self._schedule(deadline, timer)
        return timer

    async def advance(self, seconds: float) -> None:
        """Move time forward, firing due timers, and let woken tasks run."""
        self._now += seconds
        while self._timers and self._timers[0][0] <= self._now:
            _, _, ev = heapq.heappop(self._timers)
            ev.set()
        for _ in range(5):
            await anyio.lowlevel.checkpoint()


class _ManualTimer:
    """A ``wake_at`` timer on the manual clock: sets its event when due, unless cancelled."""

    __slots__ = ("event",)

    def __init__(self, event: Settable) -> None:
        self.event: Settable | None = event

    def set(self) -> None:
        if self.event is not None:
            self.event.set()

    def cancel(self) -> None:
        self.event = None


async def wait_own(clock: Clock, event: asyncio.Event, deadline: float) -> None:
    """Wait for ``event`` until ``deadline`` (inf: no deadline), for a waiter that alone waits
    on the event and rechecks the time when woken: the deadline's timer sets the event itself.
    asyncio's event and a loop timer cost a third of anyio's event under a cancel scope, and
    the lanes and every call's settling wait this way."""
    if deadline == math.inf:
        await event.wait()
        return
    if deadline <= clock.now():  # one turn of the loop, as a zero timeout gives: asyncio's wait on
        await anyio.lowlevel.checkpoint()  # an event set at once would not yield, and a loop would spin
        return
    timer = clock.wake_at(event, deadline)
    try:
        await event.wait()
    finally:
        timer.cancel()


def remaining(clock: Clock, deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - clock.now()
