"""Circuit breakers: a provider endpoint that keeps failing is left alone for a while.

``Breaker`` is a pure state machine on an injected clock: closed, then open after
``allowed_fails`` failures within ``window_s``; after ``cooldown_s`` half-open, where one
probe call goes through: its success closes the breaker, its failure opens it again. A
failure while open (calls that were already upstream) does not extend the cooldown.

``Breakers`` holds one per endpoint and, when replicas share state (``state.url``), reports
failures to a ``BreakerStore`` and learns the others' openings from it in the background,
so one replica's discovery protects all. The hot path never waits on the store.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Literal, Protocol, runtime_checkable

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.policy import BreakerPolicy
from multiplexer.core.state import StateUnavailable

log = logging.getLogger(__name__)

State = Literal["closed", "open", "half_open"]
STATES: tuple[State, ...] = ("closed", "open", "half_open")


class Breaker:
    __slots__ = ("_fails", "_granted", "_on_change", "_probing", "_until", "clock", "name", "policy",
                 "shared")

    def __init__(self, name: str, policy: BreakerPolicy, clock: Clock,
                 on_change: Callable[[str, State], None] | None = None) -> None:
        self.name = name
        self.policy = policy
        self.clock = clock
        self._fails: deque[float] = deque()
        self._until: float | None = None  # None: closed; else open until then, half-open after
        self._probing = False
        self._on_change = on_change
        # shared by replicas: half-open admits its probe only once this replica holds the shared
        # probe (``Breakers.sync`` claims it), so one probe goes at a time across all of them
        self.shared = False
        self._granted = False

    @property
    def state(self) -> State:
        if self._until is None:
            return "closed"
        return "open" if self.clock.now() < self._until else "half_open"

    def retry_after(self) -> float:
        """Seconds until a probe may go (0 when closed or half-open)."""
        return 0.0 if self._until is None else max(self._until - self.clock.now(), 0.0)

    def may_pass(self) -> bool:
        """Whether ``allow`` would let a call through now (no probe is claimed)."""
        until = self._until
        return until is None or (self.clock.now() >= until and not self._probing
                                 and (self._granted or not self.shared))

    def wants_probe(self) -> bool:
        """Shared and half-open with no probe held: ``Breakers.sync`` should claim one."""
        until = self._until
        return (self.shared and until is not None and self.clock.now() >= until
                and not self._probing and not self._granted)

    def grant(self) -> None:
        """This replica holds the shared probe: the next call may go."""
        self._granted = True

    def allow(self) -> bool:
        """Whether a call may go to this endpoint now; half-open lets one probe through."""
        until = self._until
        if until is None:
            return True
        if self.clock.now() < until or self._probing or (self.shared and not self._granted):
            return False
        self._probing, self._granted = True, False
        self._changed("half_open")
        return True

    def success(self) -> None:
        """A call reached the endpoint and it answered (a caller's own error counts here too)."""
        if self._until is not None and (self._probing or self.clock.now() >= self._until):
            self._until, self._probing, self._granted = None, False, False
            self._fails.clear()
            self._changed("closed")

    def failure(self) -> bool:
        """The endpoint failed a call; True when this failure opened the breaker."""
        now = self.clock.now()
        if self._until is not None:
            if not self._probing:
                return False  # already open: a late failure does not extend the cooldown
            self._open(now + self.policy.cooldown_s)  # the probe failed
            return True
        fails = self._fails
        fails.append(now)
        while fails and fails[0] <= now - self.policy.window_s:
            fails.popleft()
        if len(fails) >= self.policy.allowed_fails:
            self._open(now + self.policy.cooldown_s)
            return True
        return False

    def release(self) -> None:
        """A probe ended without a verdict (its caller went): the next call may probe (shared:
        this replica still holds the shared probe)."""
        if self._probing:
            self._probing = False
            self._granted = self.shared

    def opened_elsewhere(self, seconds: float) -> None:
        """Another replica opened it: open here for what is left of its cooldown."""
        if seconds <= 0:
            return
        until = self.clock.now() + seconds
        if self._until is None or (not self._probing and until > self._until):
            self._open(until)

    def _open(self, until: float) -> None:
        self._until, self._probing, self._granted = until, False, False
        self._fails.clear()
        self._changed("open")

    def _changed(self, state: State) -> None:
        log.log(logging.WARNING if state == "open" else logging.INFO, "breaker %s is %s",
                self.name, state.replace("_", "-"))
        if self._on_change is not None:
            self._on_change(self.name, state)


class BreakerStore(Protocol):
    """Breaker state shared by replicas (``backends/redis_breaker.py``)."""

    async def report(self, name: str, policy: BreakerPolicy, failed: bool, probe: bool) -> float:
        """A failure, or a probe's result, of ``name``; seconds the shared breaker stays open."""
        ...

    async def claim_probe(self, name: str, policy: BreakerPolicy) -> bool:
        """Hold ``name``'s one probe across replicas (until its report, or a cooldown)."""
        ...

    async def open_for(self, names: list[str]) -> list[float]:
        """Seconds each named breaker stays open (0: closed)."""
        ...


@runtime_checkable
class SharesBreakers(Protocol):
    """A shared state that can hold breakers (the capability the gateway asks for)."""

    def breaker_store(self) -> BreakerStore: ...


class Breakers:
    """The gateway's breakers by endpoint name, local or shared through a ``BreakerStore``."""

    def __init__(self, policies: Mapping[str, BreakerPolicy], clock: Clock,
                 store: BreakerStore | None = None,
                 on_change: Callable[[str, State], None] | None = None,
                 poll_s: float = 0.25) -> None:
        self.clock = clock
        self.store = store
        self.poll_s = poll_s
        self._on_change = on_change
        self.all: dict[str, Breaker] = {}
        self._policies = dict(policies)
        self._reports: list[tuple[str, bool, bool]] = []
        self._wake = anyio.Event()
        self._lock = anyio.Lock()  # one round at a time (the background loop's, or a caller's)
        for name, policy in policies.items():
            self.add(name, policy)

    def add(self, name: str, policy: BreakerPolicy) -> Breaker:
        breaker = self.all[name] = Breaker(name, policy, self.clock, self._on_change)
        breaker.shared = self.store is not None
        self._policies[name] = policy
        return breaker

    def get(self, name: str) -> Breaker | None:
        return self.all.get(name)

    def record(self, name: str, failed: bool) -> None:
        """An attempt on ``name`` ended: a failure (an unwell reason) or an answer."""
        breaker = self.all.get(name)
        if breaker is None:
            return
        probe = breaker._probing
        if failed:
            breaker.failure()
        else:
            breaker.success()
        if self.store is not None and (failed or probe):
            self._reports.append((name, failed, probe))
            self._wake.set()

    async def sync(self) -> None:
        """Send the reports and learn the other replicas' openings (one round of ``run``)."""
        store = self.store
        if store is None:
            return
        async with self._lock:
            await self._round(store)

    async def _round(self, store: BreakerStore) -> None:
        reports, self._reports = self._reports, []
        try:
            for name, failed, probe in reports:
                left = await store.report(name, self._policies[name], failed, probe)
                self.all[name].opened_elsewhere(left)
            names = list(self.all)
            for name, left in zip(names, await store.open_for(names), strict=True):
                self.all[name].opened_elsewhere(left)
            for name, breaker in list(self.all.items()):
                if breaker.wants_probe() and await store.claim_probe(name, self._policies[name]):
                    breaker.grant()
        except StateUnavailable as e:  # the local breakers still work
            log.warning("shared breaker state unavailable: %s", e)

    async def run(self) -> None:
        """Keep the shared state and this replica's breakers in step (the gateway's lifetime)."""
        while True:
            await self.sync()
            await self.clock.wait_event(self._wake, self.clock.now() + self.poll_s)
            if self._wake.is_set():
                self._wake = anyio.Event()
