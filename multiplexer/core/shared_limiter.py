"""A provider's limits shared by every replica: the ``Limiter`` with its state in Redis.

The lane charges it as it charges a local one. ``take`` (in the lane's step) counts this
process's slot; ``ready`` (in the worker, before the provider runs) is the real decision:
``acquire``, one atomic round trip to the shared state that takes a request, the
estimated tokens and a concurrency slot, all or none. ``finish`` frees the slot and
settles off the caller's path: the token estimate against the real usage the provider
reported (``correct_tokens``) and what the upstream's headers taught (``observe``). Slots
are leases a live replica renews.

When the shared state is unreachable nothing stops: this replica enforces its
share of each limit (limit / live replicas last seen), never the whole limit, and
counts every such decision; the next call tries the shared state again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.limiter import OnWait, Permit, RateLimiter
from multiplexer.core.state import Learned, LimitSpec, SharedState, StateUnavailable

log = logging.getLogger(__name__)
RETRY_SHARED_S = 1.0  # after a failure, decide locally this long before trying the shared state again
MAX_POLL_S = 0.05  # a caller waiting for a concurrency slot looks again at least this often


class SharedLimiter(RateLimiter):
    def __init__(self, clock: Clock, name: str, spec: LimitSpec, state: SharedState,
                 on_degraded: Callable[[str], None] | None = None) -> None:
        super().__init__(clock, concurrency=spec.concurrency)
        self.name = name
        self.spec = spec
        self._no_slot = LimitSpec(spec.rpm, spec.tpm, 0)
        self.state = state
        self.shared = True
        self._on_degraded = on_degraded
        self._ids = itertools.count()
        self._prefix = f"{state.replica_id}:{name}:"
        self._held: set[str] = set()
        self._delta = 0.0
        self._learned: list[Learned] = []
        self._down_until = -math.inf
        self._share = 0
        self._local: RateLimiter = RateLimiter(clock)
        self._slots = 0  # degraded: this replica's concurrency share
        self._slot_freed = anyio.Event()
        self._local_in_flight = 0
        self._settle_send, self._settle_recv = anyio.create_memory_object_stream[Permit](math.inf)
        self._orphans: set[str] = set()  # slots a timed-out acquire may hold there: freed on return
        self._turn = anyio.Lock()  # the one caller of this replica that asks the shared state

    # -- what the lane and providers call (sync) ------------------------------------
    def delay(self, requests: int, tokens: int) -> tuple[float, str]:
        wait = self.paused_until - self.clock.now()
        return (max(0.0, wait), "retry_after")

    def consume(self, requests: int, tokens: int) -> None:
        """Charged in ``acquire``, where all replicas see it."""

    def correct_tokens(self, estimated: int, actual: int) -> None:
        self._delta += actual - estimated
        self._local.correct_tokens(estimated, actual)

    def observe(self, kind: str, limit: float | None, remaining: float, reset_in: float) -> None:
        self._learned.append(Learned(kind, limit, remaining, reset_in))
        del self._learned[:-8]  # the freshest readings are all that count
        self._local.observe(kind, limit, remaining, reset_in)

    # -- around each batch (async) -------------------------------------------------
    async def ready(self, permit: Permit, on_wait: OnWait | None = None) -> None:
        """The batch's charge in the shared state: a request, its tokens and a slot."""
        lease = await self.acquire(permit.tokens, on_wait=on_wait)
        permit.id, permit.shared, permit.held = lease.id, lease.shared, True

    def finish(self, permit: Permit) -> None:
        super().finish(permit)
        if permit.held:
            permit.held = False
            self.release_soon(permit)

    async def admit(self, requests: int = 1, tokens: int = 0, on_wait: OnWait | None = None) -> None:
        """Extra requests are charged to the shared rpm and tpm too (they take no slot: the
        batch they belong to holds one)."""
        for k in range(requests):
            await self.acquire(tokens if k == 0 else 0, slot=False, on_wait=on_wait)

    async def acquire(self, tokens: int, *, slot: bool = True, on_wait: OnWait | None = None) -> Permit:
        """A request, ``tokens`` and (with ``slot``) a concurrency slot; ``on_wait`` is told the
        limit it waits for, and None once it has them."""
        lease = await self._acquire(tokens, slot, on_wait)
        if on_wait is not None:
            on_wait(None)
        return lease

    async def _acquire(self, tokens: int, slot: bool, on_wait: OnWait | None) -> Permit:
        """One caller of this replica at a time asks the shared state, in arrival order (the lock
        is fair). A waiter each would wake together at every refill and all but one ask again: a
        herd that grows with the callers and, on a busy machine, stalled the replicas and then
        let the saved-up tokens go in a burst. The cost: a replica's acquires follow each other,
        one round trip apart (thousands a second; each is a batch's, not a call's)."""
        lease_id = self._prefix + str(next(self._ids))
        async with self._turn:
            return await self._wait_turn(lease_id, tokens, slot, on_wait)

    async def _ask(self, lease_id: str, tokens: int, slot: bool) -> Permit | tuple[float, str] | None:
        """One round trip: the permit, or how long to wait and for which limit; None while the
        shared state is unreachable."""
        if self.clock.now() < self._down_until:
            return None
        try:
            wait, which = await self.state.acquire(self.name, lease_id, tokens,
                                                   self.spec if slot else self._no_slot)
        except StateUnavailable as e:
            if slot:  # a slow answer may have taken the slot there: this call goes locally instead
                self._orphans.add(lease_id)
            self._degrade(e)
            return None
        except BaseException:  # cancelled in the round trip: the slot may be taken already
            if slot:
                with anyio.CancelScope(shield=True), contextlib.suppress(StateUnavailable):
                    await self.state.settle(self.name, lease_id, 0.0, [], self.spec)
            raise
        self._share = 0  # it answers: a later outage starts this replica's share empty
        if wait > 0:
            return wait, which
        if slot:
            self._held.add(lease_id)
        return Permit(tokens, slot=False, held=slot, id=lease_id, shared=True)

    async def _wait_turn(self, lease_id: str, tokens: int, slot: bool, on_wait: OnWait | None) -> Permit:
        poll = 0.001
        while True:
            asked = await self._ask(lease_id, tokens, slot)
            if isinstance(asked, Permit):
                return asked
            if asked is None:
                if await self._acquire_local(tokens, slot, on_wait):
                    return Permit(tokens, slot=False, held=slot, id=lease_id)
                continue
            wait, which = asked
            if which == "concurrency":  # no telling when a slot frees: look again soon
                poll = wait = min(poll * 2, MAX_POLL_S)
            if on_wait is not None:
                on_wait(which)
            await self.clock.sleep_until(self.clock.now() + wait)

    def release_soon(self, lease: Permit) -> None:
        """Free the slot now; settle with the shared state off the caller's path (``run``)."""
        if not lease.shared:
            self._local_in_flight -= 1
            self._slot_freed.set()
        else:
            self._held.discard(lease.id)
        self._settle_send.send_nowait(lease)

    async def release(self, lease: Permit) -> None:
        """``release_soon`` and wait for the settlement."""
        self.release_soon(lease)
        await self._settle(await self._settle_recv.receive())

    async def _settle(self, lease: Permit) -> None:
        delta, self._delta = self._delta, 0.0
        learned, self._learned = self._learned, []
        if not lease.shared and self.clock.now() < self._down_until:
            return
        try:
            await self.state.settle(self.name, lease.id if lease.shared else "", delta, learned,
                                    self.spec)
        except StateUnavailable as e:
            self._degrade(e)  # the slot expires with its lease; the correction is lost

    async def drain(self) -> None:
        """Settle what ended and is not settled yet (the gateway is closing)."""
        while True:
            try:
                lease = self._settle_recv.receive_nowait()
            except anyio.WouldBlock:
                return
            await self._settle(lease)

    async def run(self) -> None:
        """Settle released leases in order, and keep this replica's slots alive while their
        calls run (a dead replica's expire after ``lease_s``)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._renew_forever)
            async for lease in self._settle_recv:
                await self._settle(lease)

    async def free_orphans(self) -> None:
        """Free the slots that acquires which timed out may have taken (those calls ran on this
        replica's share instead), once the shared state answers again."""
        for lease_id in list(self._orphans):
            try:
                await self.state.settle(self.name, lease_id, 0.0, [], self.spec)
            except StateUnavailable:
                return
            self._orphans.discard(lease_id)

    async def _renew_forever(self) -> None:
        while True:
            await anyio.sleep(self.state.lease_s / 3)
            await self.free_orphans()
            if self._held:
                try:
                    await self.state.renew(self.name, list(self._held))
                except StateUnavailable as e:
                    self._degrade(e)

    # -- degraded: this replica's share ---------------------------------------------
    def _degrade(self, error: BaseException) -> None:
        if self.clock.now() >= self._down_until:
            log.warning("%s: shared limits unreachable (%s); enforcing this replica's share",
                        self.name, error)
        self._down_until = self.clock.now() + RETRY_SHARED_S

    def _reshare(self) -> None:
        n = self.state.live_replicas()
        if n == self._share:
            return
        self._share = n
        spec = self.spec
        local = RateLimiter(self.clock, spec.rpm / n if spec.rpm else None,
                            spec.tpm / n if spec.tpm else None)
        for bucket in (local.requests, local.tokens):  # empty: the shared one may have been spent
            if bucket is not None:
                bucket.level = 0.0
        self._local = local
        self._slots = max(1, spec.concurrency // n) if spec.concurrency else 1 << 30

    async def _acquire_local(self, tokens: int, slot: bool = True, on_wait: OnWait | None = None) -> bool:
        """One degraded decision: wait for this replica's share, then go (True)."""
        self._reshare()
        if self._on_degraded is not None:
            self._on_degraded("limits")
        while True:
            wait, which = self._local.delay(1, tokens)
            if wait <= 0:
                break
            if on_wait is not None:
                on_wait(which)
            await self.clock.sleep_until(self.clock.now() + min(wait, RETRY_SHARED_S))
            if self.clock.now() >= self._down_until:
                return False  # the shared state may be back: ask it
        self._local.consume(1, tokens)
        if not slot:
            return True
        while self._local_in_flight >= self._slots:
            if on_wait is not None:
                on_wait("concurrency")
            if self._slot_freed.is_set():  # a fresh one only once set: every waiter shares it
                self._slot_freed = anyio.Event()
            await self._slot_freed.wait()
        self._local_in_flight += 1
        return True
