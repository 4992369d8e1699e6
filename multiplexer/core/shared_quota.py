"""Per-key quotas shared by every replica: decided in the shared state, ahead of admission.

The gateway admits a whole array of calls synchronously, so the shared decisions
are taken just before (``reserve``: one round trip per call, on the shared
state's clock) and ``acquire`` / ``charge_batch`` then take them in order.
Concurrency slots are leases, renewed while their calls run and freed in the
background when they end. When the shared state is unreachable the decision is
closed (``-32003`` limit ``quota_unavailable``) unless ``state.on_failure: open``,
which decides on this replica's own counters; both are counted as degraded.
Each decision also brings back the key's rpm bucket as it left it, which is what
the ``/v1`` faces' ``x-ratelimit-*`` headers show (``rpm_state``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Callable

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError, rate_limited
from multiplexer.core.policy import Quota
from multiplexer.core.quota import Quotas
from multiplexer.core.state import SharedState, StateUnavailable

Decision = str | RpcError | None  # a lease id, a refusal, or None: decide locally (state down, open)


class SharedQuotas(Quotas):
    def __init__(self, clock: Clock, quotas: dict[str, Quota], state: SharedState, *,
                 fail_open: bool, degraded: Callable[[str], None]) -> None:
        super().__init__(clock, quotas)
        self.state = state
        self.fail_open = fail_open
        self.degraded = degraded
        self._ids = itertools.count()
        self._calls: dict[str, deque[Decision]] = defaultdict(deque)
        self._batches: dict[str, deque[Decision]] = defaultdict(deque)
        self._leases: dict[str, list[str]] = defaultdict(list)
        self._local: dict[str, int] = defaultdict(int)  # slots taken locally (state down, open)
        self._ended: list[tuple[str, str]] = []  # (identity, lease) of calls that ended
        self._refunds: list[tuple[str, int, int]] = []  # (identity, UTC day, calls) charged to undo
        # identity -> (rpm level, shared-state time, local time) of its latest shared decision
        self._seen: dict[str, tuple[float, float, float]] = {}
        self._wake = anyio.Event()
        self._parallel = anyio.CapacityLimiter(16)  # round trips of one array at once

    def _refusal(self, e: StateUnavailable) -> Decision:
        self.degraded("quota")
        if self.fail_open:
            return None
        return rate_limited("quota_unavailable", 1.0, detail="the shared quota state is unreachable")

    async def reserve(self, claims: list[tuple[str, int]]) -> None:
        """Decide every claim (a few at a time), then queue the decisions in claim order."""
        decided: list[tuple[deque[Decision], Decision] | None] = [None] * len(claims)

        async def decide(i: int, identity: str, batch_calls: int, quota: Quota) -> None:
            async with self._parallel:
                if batch_calls:
                    decided[i] = (self._batches[identity], await self._charge(identity, quota, batch_calls))
                else:
                    decided[i] = (self._calls[identity], await self._admit(identity, quota))

        try:
            async with anyio.create_task_group() as tg:
                for i, (identity, batch_calls) in enumerate(claims):
                    quota = self.quotas.get(identity)
                    if quota is None:
                        continue
                    if (quota.batch_calls_per_day is not None if batch_calls
                            else quota.rpm is not None or quota.concurrency is not None):
                        tg.start_soon(decide, i, identity, batch_calls, quota)
        except BaseException:  # the caller went away: give back what was taken for it (in flush)
            for (identity, batch_calls), entry in zip(claims, decided, strict=True):
                if entry is not None and isinstance(entry[1], str):
                    if batch_calls:
                        self._refunds.append((identity, int(entry[1]), batch_calls))
                    else:
                        self._ended.append((identity, entry[1]))
            self._wake.set()
            raise
        for entry in decided:
            if entry is not None:
                entry[0].append(entry[1])

    async def _admit(self, identity: str, quota: Quota) -> Decision:
        lease = f"{self.state.replica_id}:{next(self._ids)}"
        try:
            decision = await self.state.quota(identity, quota.rpm or 0.0, quota.concurrency or 0,
                                              lease)
        except StateUnavailable as e:
            self._seen.pop(identity, None)  # this replica's own bucket decides meanwhile
            return self._refusal(e)
        except BaseException:  # cancelled in the round trip: the slot may be taken; free it
            self._ended.append((identity, lease))
            self._wake.set()
            raise
        if decision.level is not None:
            seen = self._seen.get(identity)
            if seen is None or seen[1] <= decision.at:  # the latest of an array decided at once
                self._seen[identity] = (decision.level, decision.at, self.clock.now())
        if decision.wait > 0:
            which = decision.limit
            return rate_limited(which, decision.wait if which == "rpm" else 0.05, identity=identity)
        return lease

    def rpm_state(self, identity: str | None) -> tuple[float, float | None, float | None] | None:
        """The rpm bucket as the last shared decision for this key left it, refilled to now on
        this replica's clock: the headers cost no round trip of their own. Calls made through
        other replicas since then show from this replica's next decision on."""
        quota = self.quotas.get(identity) if identity else None
        seen = self._seen.get(identity) if identity else None
        if quota is None or quota.rpm is None or seen is None:
            return super().rpm_state(identity)
        level, _, taken = seen
        rate = quota.rpm / 60.0
        left = min(quota.rpm, max(level, 0.0) + max(0.0, self.clock.now() - taken) * rate)
        return quota.rpm, left, (quota.rpm - left) / rate

    async def _charge(self, identity: str, quota: Quota, calls: int) -> Decision:
        allowed = quota.batch_calls_per_day or 0
        wall = self.clock.wall()
        day = int(wall // 86_400)
        try:
            left = await self.state.batch_charge(identity, day, calls, allowed)
        except StateUnavailable as e:
            return self._refusal(e)
        if left >= 0:
            return rate_limited("batch_calls_per_day", (day + 1) * 86_400 - wall, identity=identity,
                                allowed=allowed, remaining=left)
        return str(day)  # charged on this day (a refund must go to the same one)

    def acquire(self, identity: str | None) -> bool:
        queue = self._calls.get(identity) if identity else None
        decision = queue.popleft() if queue else None
        if decision is None:  # nothing decided ahead, or the state was down and quotas fail open
            held = super().acquire(identity)
            if held and identity is not None:
                self._local[identity] += 1
            return held
        if isinstance(decision, RpcError):
            raise decision
        self._leases[identity].append(decision)  # type: ignore[index]
        return True

    def charge_batch(self, identity: str | None, calls: int) -> None:
        queue = self._batches.get(identity) if identity else None
        decision = queue.popleft() if queue else None
        if isinstance(decision, RpcError):
            raise decision
        if decision is None:
            super().charge_batch(identity, calls)

    def forgo_batch(self, identity: str | None) -> None:
        """Drop the batch decision taken ahead for a call refused before ``charge_batch`` (so
        the next call does not take it), and give back what it charged (in ``flush``)."""
        queue = self._batches.get(identity) if identity else None
        decision = queue.popleft() if queue else None
        if isinstance(decision, str) and identity is not None:
            self._refunds.append((identity, int(decision), 1))
            self._wake.set()

    def release(self, identity: str | None) -> None:
        if identity is None:
            return
        if self._local.get(identity):
            self._local[identity] -= 1
            super().release(identity)
        elif self._leases.get(identity):
            self._ended.append((identity, self._leases[identity].pop()))
            self._wake.set()

    async def flush(self) -> None:
        """Free the slots of the calls that ended and give back the batch charges of calls that
        never ran (the gateway awaits this before it answers, so a caller's next call finds its
        slot free)."""
        refunds, self._refunds = self._refunds, []
        for identity, day, calls in refunds:
            try:
                allowed = self.quotas[identity].batch_calls_per_day or 0
                await self.state.batch_charge(identity, day, -calls, allowed)
            except StateUnavailable:
                self.degraded("quota")  # the charge stands
        ended, self._ended = self._ended, []
        for identity, lease in ended:
            try:
                await self.state.quota_release(identity, lease)
            except StateUnavailable:
                self.degraded("quota")  # the slot expires with its lease

    async def run(self) -> None:
        """Free slots released outside a gateway call (MCP resources), renew running ones."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._renew_forever)
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                await self.flush()

    async def _renew_forever(self) -> None:
        while True:
            await anyio.sleep(self.state.lease_s / 3)
            for identity, leases in list(self._leases.items()):
                if leases:
                    try:
                        await self.state.quota_renew(identity, list(leases))
                    except StateUnavailable:
                        self.degraded("quota")
