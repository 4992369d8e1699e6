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

import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.limiter import NamedLimit, NamedLimits, OnWait, Permit, RateLimiter
from multiplexer.core.state import Granted, Learned, LimitSpec, SharedState, StateUnavailable

log = logging.getLogger(__name__)
RETRY_SHARED_S = 1.0  # after a failure, decide locally this long before trying the shared state again
MIN_POLL_S, MAX_POLL_S = 0.001, 0.05  # waiting for a concurrency slot: look again this often
MAX_GRANT = 64  # waiters one round trip asks for at most
NEAR_S = 0.1  # a waiter whose callers give up sooner is served after those with more time
_NO_LIMITS = LimitSpec()



@dataclass(eq=False, slots=True)
class _Waiter:
    """One acquire queued on this replica: what it asks for, and its permit once granted."""

    lease_id: str
    tokens: int
    slot: bool
    on_wait: OnWait | None
    deadline: float | None
    permit: Permit | None = None
    gone: bool = False  # its caller went away before it was granted
    woken: anyio.Event = field(default_factory=anyio.Event)


class SharedLimiter(RateLimiter):
    def __init__(self, clock: Clock, name: str, spec: LimitSpec, state: SharedState,
                 on_degraded: Callable[[str], None] | None = None) -> None:
        super().__init__(clock, concurrency=spec.concurrency)
        self.name = name
        self.spec = spec
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
        self._settle_send, self._settle_recv = anyio.create_memory_object_stream[
            tuple[Permit, bool]](math.inf)
        self._orphans: set[str] = set()  # slots a timed-out acquire may hold there: freed on return
        self._queue: deque[_Waiter] = deque()  # acquires not granted yet, in arrival order
        self._asking = False  # the first of them is taking its turn
        self._next_at = -math.inf  # when the shared state said the next permit can be had
        self._next_limit = ""  # and the limit that holds it until then
        self._poll = MIN_POLL_S
        self._named_held: dict[str, set[str]] = {}  # a named set's key -> its slots held here

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

    def named(self, scope: str, rules: Sequence[tuple[str, float | None, int]],
              matches: Callable[[str, str], bool]) -> NamedLimits:
        """Limits per name (an MCP tool's), kept in the shared state beside this provider's."""
        return SharedNamedLimits(self, scope, rules, matches)

    def hold_named(self, key: str, lease_id: str) -> None:
        self._named_held.setdefault(key, set()).add(lease_id)

    def release_named(self, key: str, lease_id: str) -> None:
        """A named slot's call ended: freed in the shared state off the caller's path."""
        held = self._named_held.get(key)
        if held is not None:
            held.discard(lease_id)
            if not held:
                del self._named_held[key]
        self._settle_send.send_nowait((Permit(slot=False, id=lease_id, shared=True, key=key), False))

    # -- around each batch (async) -------------------------------------------------
    async def ready(self, permit: Permit, on_wait: OnWait | None = None) -> None:
        """The batch's charge in the shared state: a request, its tokens and a slot."""
        lease = await self.acquire(permit.tokens, on_wait=on_wait, deadline=permit.deadline)
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

    async def acquire(self, tokens: int, *, slot: bool = True, on_wait: OnWait | None = None,
                      deadline: float | None = None) -> Permit:
        """A request, ``tokens`` and (with ``slot``) a concurrency slot; ``on_wait`` is told the
        limit it waits for, and None once it has them. ``deadline``: when its callers give up."""
        lease = await self._acquire(tokens, slot, on_wait, deadline)
        if on_wait is not None:
            on_wait(None)
        return lease

    async def _acquire(self, tokens: int, slot: bool, on_wait: OnWait | None,
                       deadline: float | None) -> Permit:
        """Waiters queue in arrival order; the first asks the shared state for itself and those
        behind it (up to ``MAX_GRANT``) in one round trip and hands out what it granted, in
        order. A waiter each would wake together at every refill and all but one ask again: a
        herd that grows with the callers and, on a busy machine, stalled the replicas and then
        let the saved-up tokens go in a burst. One round trip for several also leaves no
        permit waiting for a turn of its own while the bucket refills."""
        w = _Waiter(self._lease_id(), tokens, slot, on_wait, deadline)
        self._queue.append(w)
        try:
            while w.permit is None:
                if self._asking or self._queue[0] is not w:
                    w.woken = anyio.Event()
                    await w.woken.wait()
                    continue
                self._asking = True
                try:
                    await self._turn(w)
                finally:
                    self._asking = False
            await anyio.lowlevel.checkpoint_if_cancelled()  # granted in a shielded round trip
        except BaseException:
            if w.permit is not None:  # granted as its caller went away: never used
                self._give_back(w.permit)
            raise
        finally:
            if w.permit is None:
                w.gone = True
                self._queue.remove(w)
            if self._queue and not self._asking:
                self._queue[0].woken.set()  # the next asks
        return w.permit

    def _lease_id(self) -> str:
        return self._prefix + str(next(self._ids))

    async def _turn(self, w: _Waiter) -> None:
        """The first waiter's turn: sleep until the shared state said the next permit can be
        had, then ask for the waiters at the front (or decide ``w`` alone on this replica's
        share while the shared state is unreachable)."""
        if self.clock.now() < self._next_at:
            self._tell(self._next_limit)
            await self.clock.sleep_until(self._next_at)
            return
        batch = self._front()
        got = await self._ask(batch)
        if got is None:
            if await self._acquire_local(w.tokens, w.slot, w.on_wait):
                self._queue.remove(w)
                w.permit = Permit(w.tokens, slot=False, held=w.slot, id=w.lease_id)
            return
        for granted in batch[:got.granted]:
            self._grant(granted)
        wait = got.wait
        if got.granted:
            self._poll = MIN_POLL_S
        if got.limit == "concurrency":  # no telling when a slot frees: look again soon
            wait, self._poll = self._poll, min(self._poll * 2, MAX_POLL_S)
        self._next_at, self._next_limit = self.clock.now() + wait, got.limit

    def _front(self) -> list[_Waiter]:
        """The waiters to ask for: in order, except that those whose callers give up within
        ``NEAR_S`` come after the others. A permit handed to one of them is mostly spent on a
        request that never leaves (its callers gone before it is sent) or that no one waits
        for; under overload the oldest waiters are exactly those."""
        soon = self.clock.now() + NEAR_S
        later: list[_Waiter] = []
        near: list[_Waiter] = []
        for w in self._queue:  # the near ones are the oldest: the scan ends soon after them
            (later if w.deadline is None or w.deadline > soon else near).append(w)
            if len(later) == MAX_GRANT:
                break
        return (later + near)[:MAX_GRANT]

    async def _ask(self, batch: list[_Waiter]) -> Granted | None:
        """One round trip for ``batch``; None while the shared state is unreachable. It runs to
        its end even if the asker's caller goes away meanwhile (the others' grants are in it),
        and counts as lost past twice the state's own timeout. A lost answer may have taken
        slots there: they are freed once it answers again, and those waiters ask anew with new
        lease ids (one must never be freed while its call runs)."""
        if self.clock.now() < self._down_until:
            return None
        asks = [(w.lease_id if w.slot else "", w.tokens) for w in batch]
        try:
            with anyio.fail_after(2 * self.state.timeout_s, shield=True):
                got = await self.state.acquire_many(self.name, asks, self.spec)
        except (StateUnavailable, TimeoutError) as e:
            for w in batch:
                if w.slot:
                    self._orphans.add(w.lease_id)
                    w.lease_id = self._lease_id()
            self._degrade(e)
            return None
        self._share = 0  # it answers: a later outage starts this replica's share empty
        return got

    def _grant(self, w: _Waiter) -> None:
        permit = Permit(w.tokens, slot=False, held=w.slot, id=w.lease_id, shared=True)
        if w.slot:
            self._held.add(w.lease_id)
        if w.gone:  # its caller went away during the round trip
            self._give_back(permit)
            return
        self._queue.remove(w)
        w.permit = permit
        w.woken.set()

    def _tell(self, limit: str) -> None:
        """Every waiter learns the limit it waits for (a deadline then names it)."""
        for w in self._queue:
            if w.on_wait is not None:
                w.on_wait(limit)

    def _give_back(self, permit: Permit) -> None:
        """A permit granted and never used: its slot, request and tokens go back to the shared
        state (settled off the caller's path, like a release); a local one frees its slot."""
        if not permit.shared:
            if permit.held:
                self.release_soon(permit)
            return
        self._held.discard(permit.id)
        self._settle_send.send_nowait((permit, True))

    def release_soon(self, lease: Permit) -> None:
        """Free the slot now; settle with the shared state off the caller's path (``run``)."""
        if not lease.shared:
            self._local_in_flight -= 1
            self._slot_freed.set()
        else:
            self._held.discard(lease.id)
        self._settle_send.send_nowait((lease, False))

    async def release(self, lease: Permit) -> None:
        """``release_soon`` and wait for the settlement."""
        self.release_soon(lease)
        await self._settle(*await self._settle_recv.receive())

    async def _settle(self, lease: Permit, back: bool = False) -> None:
        """Settle one ended lease (``back``: granted, never used: its request and tokens are
        refunded too) with the corrections gathered since the last settlement."""
        if lease.key:  # a named slot (a tool's): nothing of the provider's own to settle
            try:
                await self.state.settle(lease.key, lease.id, 0.0, [], _NO_LIMITS)
            except StateUnavailable as e:
                self._degrade(e)  # the slot expires with its lease
            return
        delta, self._delta = self._delta, 0.0
        learned, self._learned = self._learned, []
        if not lease.shared and self.clock.now() < self._down_until:
            return
        if back:
            delta -= lease.tokens
        try:
            await self.state.settle(self.name, lease.id if lease.shared else "", delta, learned,
                                    self.spec, requests=int(back))
        except StateUnavailable as e:
            self._degrade(e)  # the slot expires with its lease; the correction is lost

    async def drain(self) -> None:
        """Settle what ended and is not settled yet (the gateway is closing)."""
        while True:
            try:
                lease = self._settle_recv.receive_nowait()
            except anyio.WouldBlock:
                return
            await self._settle(*lease)

    async def run(self) -> None:
        """Settle released leases in order, and keep this replica's slots alive while their
        calls run (a dead replica's expire after ``lease_s``)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._renew_forever)
            async for lease, back in self._settle_recv:
                await self._settle(lease, back)

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
            for key, held in list(self._named_held.items()):
                try:
                    await self.state.renew(key, list(held))
                except StateUnavailable as e:
                    self._degrade(e)
                    break

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


class SharedNamedLimits(NamedLimits):
    """``NamedLimits`` (an MCP upstream's ``tool_limits``) in the replicas' shared state, beside their
    provider's limits and on the same script: each name's rpm bucket and concurrency slots decided
    for every replica (and every worker) in one round trip, refused at once when spent. A slot is
    a lease its replica renews while the call runs and frees as it ends. While the shared state is
    unreachable, this replica enforces its share (each limit over the live replicas) and counts it."""

    def __init__(self, owner: SharedLimiter, scope: str, rules: Sequence[tuple[str, float | None, int]],
                 matches: Callable[[str, str], bool]) -> None:
        super().__init__(owner.clock, rules, matches)
        self.owner = owner
        self.scope = scope
        self._local: NamedLimits | None = None  # degraded: this replica's share
        self._keys: dict[tuple[str, str], str] = {}

    def _key(self, glob: str, name: str) -> str:
        key = self._keys.get((glob, name))
        if key is None:  # the shared state hashes it into one slot of its own
            key = self._keys[(glob, name)] = "\x1f".join((self.owner.name, "tool", self.scope, glob, name))
        return key

    async def acquire(self, name: str) -> tuple[NamedLimit | None, str | None, float]:
        rule = self.rule_of(name)
        if rule is None:
            return None, None, 0.0
        glob, rpm, concurrency = rule
        owner = self.owner
        if owner.clock.now() >= owner._down_until:
            key = self._key(glob, name)
            lease = owner._lease_id() if concurrency else ""
            try:  # shielded: a slot granted as the caller goes is still freed (below, by finish)
                with anyio.fail_after(2 * owner.state.timeout_s, shield=True):
                    got = await owner.state.acquire_many(key, [(lease, 0)],
                                                         LimitSpec(rpm or 0.0, 0.0, concurrency))
            except (StateUnavailable, TimeoutError) as e:
                owner._degrade(e)  # a slot a lost answer took expires with its lease
            else:
                if not got.granted:
                    return None, got.limit or "rpm", got.wait if got.limit == "rpm" else 0.0
                if lease:
                    owner.hold_named(key, lease)
                return NamedLimit(glob, None, concurrency, 1, key=key, lease=lease), None, 0.0
        return self._degraded(name)

    def _degraded(self, name: str) -> tuple[NamedLimit | None, str | None, float]:
        owner = self.owner
        share = owner.state.live_replicas()
        if self._local is None or self._local.share != share:
            self._local = NamedLimits(self.clock, self.rules, self._matches, share=share)
        if owner._on_degraded is not None:
            owner._on_degraded("limits")
        return self._local.take(name)

    def finish(self, limit: NamedLimit) -> None:
        if not limit.key:  # decided on this replica's share
            limit.in_flight -= 1
        elif limit.lease:
            self.owner.release_named(limit.key, limit.lease)
