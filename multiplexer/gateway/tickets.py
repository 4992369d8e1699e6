"""A caller's ticket on a call, and the one wait that settles a whole array of them.

``submit_many`` parks one small ticket per call (not a task per call) and waits for all
of them on a single event: a result wakes it, and so does the earliest deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from multiplexer.core.asking import PAUSED
from multiplexer.core.batching import Pending
from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import Clock, wait_own
from multiplexer.core.dedup import ProgressFanout
from multiplexer.core.errors import RpcError, timeout_error
from multiplexer.core.lane import Lane
from multiplexer.core.logs import LogFanout, LogSink
from multiplexer.core.plain_metrics import Level
from multiplexer.core.quota import FREE, Grant

Handler = Callable[[Call], Awaitable[Any]]  # a gateway-level method (jobs.*, ...)


class Finish(Protocol):
    def __call__(self, t: Ticket, outcome: Outcome, *, withdraw: bool = False) -> None: ...


@dataclass(slots=True, eq=False)
class Ticket:
    """One caller's claim on a call: what it waits for, what it holds, and its outcome."""

    label: str
    identity: str | None
    deadline: float
    outcome: Outcome | None = None
    pending: Pending | None = None
    lane: Lane | None = None
    key: Hashable | None = None
    cache_ttl: float | None = None
    grant: Grant = FREE  # what the call holds of its key's quota, given back when it ends
    handler: Handler | None = None
    call: Call | None = None
    waiter: Waiter | None = None
    progress: tuple[ProgressFanout, Any] | None = None  # this caller's sink on a shared execution
    log: tuple[LogFanout, LogSink] | None = None  # the same for the upstream's log messages
    span: Any = None  # the call's trace span, when calls are traced
    shape: Callable[[Outcome], Outcome] | None = None  # the face's last step (``Call.shape``)
    started: float = 0.0  # the clock's time at admission
    in_flight: Level | None = None  # its route's in-flight count, while it is counted there
    attempts: Any = None  # gateway/fallbacks.Attempts: its walk over fallback routes
    plan: Any = None  # its admission plan, when calls are priced (``spend.enabled``)
    shared: str | None = None  # how it shared another's execution: ``dedup``, ``cache``
    batch: Any = None  # its lane's batch of it alone, to run in the caller's task (``run_here``)
    paused: float = 0.0  # seconds its deadline moved while its client was asked (``postponed``)

    def leave_fanouts(self) -> None:
        """Stop receiving the shared execution's progress and log messages (the call ended, or
        its attempt failed and the next goes elsewhere)."""
        if self.progress is not None:
            self.progress[0].remove(self.progress[1])
            self.progress = None
        if self.log is not None:
            self.log[0].remove(self.log[1])
            self.log = None

    def __call__(self) -> None:
        """Done-callback of the pending it waits on (a bound object, not a closure per call)."""
        if self.waiter is not None:
            self.waiter.ready.append(self)
            self.waiter.wake.set()


class Waiter:
    """What one ``settle`` waits on. Its event is asyncio's own, not anyio's wrapper: every call
    makes one and waits on it, and the wrapper cost 2 us more to make and 2.5 us more to wait on."""

    __slots__ = ("ready", "wake")

    def __init__(self) -> None:
        self.ready: list[Ticket] = []
        self.wake = asyncio.Event()


def deadline_error(t: Ticket) -> RpcError:
    """The timeout of a call whose deadline came first, with the stage it found the call in:
    ``rate_limit`` (and the limit) when it never reached the upstream for want of a token or a
    slot, else ``queued`` or ``running``; a shared flight's, ``claiming`` its key or waiting on
    the ``replica`` that runs it (its run here, once it won the key, is its stage)."""
    p, lane = t.pending, t.lane
    if p is None or lane is None:
        return timeout_error("queued")
    if p.via is not None:
        p = p.via
    if p.state in ("claiming", "replica"):
        return timeout_error(p.state)
    held = p.item.held if p.state == "running" else lane.holding() if p.state == "queued" else None
    if held is not None:
        return timeout_error("rate_limit", limit=held, provider=lane.provider)
    return timeout_error("running" if p.state == "running" else "queued")  # done: dropped unsent


async def settle(tickets: Sequence[Ticket], clock: Clock, finish: Finish) -> None:
    """Wait until every ticket has its outcome: a result, or its deadline's timeout."""
    waiting = [t for t in tickets if t.outcome is None]
    if not waiting:
        return
    waiter = Waiter()
    ready = waiter.ready
    for t in waiting:
        assert t.pending is not None
        t.waiter = waiter
        t.pending.future.add_done_callback(t)
    deadlines = [(t.deadline, i) for i, t in enumerate(waiting)]
    heapq.heapify(deadlines)
    left = len(waiting)
    while True:
        for t in ready:  # (a fallback's next attempt may join ``ready`` while it is walked)
            if t.outcome is None:
                finish(t, t.pending.future.outcome())  # type: ignore[union-attr]
                if t.outcome is not None:  # else it moved on to a fallback route
                    left -= 1
        ready.clear()
        now = clock.now()
        while deadlines and deadlines[0][0] <= now:
            i = heapq.heappop(deadlines)[1]
            t = waiting[i]
            if t.outcome is None:
                later = postponed(t)
                if later is not None:
                    heapq.heappush(deadlines, (later, i))
                    continue
                finish(t, Outcome.fail(deadline_error(t)), withdraw=True)
                left -= 1
        if left <= 0:
            return
        while deadlines and waiting[deadlines[0][1]].outcome is not None:
            heapq.heappop(deadlines)
        if waiter.wake.is_set():  # fired for tickets settled above: a fresh one for what is left
            waiter.wake = asyncio.Event()
        await wait_own(clock, waiter.wake, deadlines[0][0] if deadlines else math.inf)


def postponed(t: Ticket) -> float | None:
    """The ticket's deadline, moved by as much as its item's call paused for its client's questions
    since it was last moved (an MCP call's provider pauses it while the client is asked,
    ``core/asking.PAUSED``); None: it did not move."""
    p = t.pending
    paused = p.item.options.get(PAUSED) if p is not None else None
    if not paused or paused <= t.paused:
        return None
    t.deadline += paused - t.paused
    t.paused = paused
    return t.deadline


class _Expiry:
    """The deadline of a call run in its caller's task: at it, the call ends with its timeout
    and, withdrawn, its batch is cancelled, as ``settle`` does for a call that waits."""

    __slots__ = ("clock", "finish", "ticket", "timer")

    def __init__(self, ticket: Ticket, finish: Finish, clock: Clock) -> None:
        self.ticket, self.finish, self.clock = ticket, finish, clock
        self.timer: Any = None

    def set(self) -> None:
        t = self.ticket
        if t.outcome is None:
            later = postponed(t)
            if later is not None:
                self.timer = self.clock.wake_at(self, later)
                return
            self.finish(t, Outcome.fail(deadline_error(t)), withdraw=True)


async def run_here(t: Ticket, clock: Clock, finish: Finish) -> None:
    """Run the lone call's batch (``Lane.express``) in this task, under its deadline, and give the
    ticket its outcome."""
    batch, t.batch = t.batch, None
    assert t.lane is not None and t.pending is not None
    expiry = None
    if t.deadline != math.inf:
        expiry = _Expiry(t, finish, clock)
        expiry.timer = clock.wake_at(expiry, t.deadline)
    try:
        await t.lane.run_here(batch)
    finally:
        if expiry is not None:
            expiry.timer.cancel()
    if t.outcome is None:
        finish(t, t.pending.future.outcome())  # type: ignore[arg-type]
