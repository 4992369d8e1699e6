"""Per-key quotas shared by every replica: each call's grant decided in the shared state.

An array's claims are decided a few at a time (one round trip each, on the shared state's
clock), each into its own ``Grant``: nothing is queued and matched to a call later. Concurrency
slots are leases, renewed while their calls run and freed in the background when they end. When
the shared state is unreachable the decision is closed (``-32003`` limit ``quota_unavailable``)
unless ``state.on_failure: open``, which decides that claim on this replica's own counters; both
are counted as degraded. Each decision also brings back the key's rpm bucket as it left it,
and its tpm bucket, which is what the ``/v1`` faces' ``x-ratelimit-*`` headers show (``window``).
A key's tpm is
checked and charged in the same round trip as its rpm token; the settlement to the real usage
goes with the freeing of the call's slot, in one round trip off the call's path.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError, rate_limited
from multiplexer.core.policy import Quota
from multiplexer.core.quota import FREE, LOCAL, Claim, Grant, Quotas
from multiplexer.core.state import SharedState, StateUnavailable


class SharedQuotas(Quotas):
    def __init__(self, clock: Clock, quotas: dict[str, Quota], state: SharedState, *,
                 fail_open: bool, degraded: Callable[[str], None]) -> None:
        super().__init__(clock, quotas)
        self.state = state
        self.fail_open = fail_open
        self.degraded = degraded
        self._ids = itertools.count()
        self._leases: dict[str, set[str]] = defaultdict(set)  # running calls' slots, renewed
        # (identity, lease or "", tokens to charge beyond the estimate) of calls that ended
        self._ended: list[tuple[str, str, int]] = []
        self._refunds: list[tuple[str, int, int]] = []  # (identity, UTC day, calls) charged to undo
        # (identity, rpm | tpm) -> (bucket level, shared-state time, local time) of its latest
        # shared decision
        self._seen: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._wake = anyio.Event()
        self._parallel = anyio.CapacityLimiter(16)  # round trips of one array at once

    def _unavailable(self) -> RpcError | None:
        """The shared state did not answer: a refusal, or None to decide here (``open``)."""
        self.degraded("quota")
        if self.fail_open:
            return None
        return rate_limited("quota_unavailable", 1.0, detail="the shared quota state is unreachable")

    async def decide(self, claims: Sequence[Claim | None]) -> list[Grant]:
        """Each claim's grant (a few round trips at once), in the claims' order. If the caller
        goes away meanwhile, what was already taken for it is given back."""
        grants: list[Grant] = [FREE] * len(claims)

        async def one(i: int, claim: Claim, quota: Quota) -> None:
            async with self._parallel:
                grant = grants[i] = Grant(claim.identity)  # holds what is taken, if cancelled
                refusal = await self._decide_shared(grant, claim, quota)
                if refusal is not None:  # what was taken (a slot, tokens) goes back
                    self.refund(grant)
                    self.release(grant)
                    grants[i] = Grant(claim.identity, refusal=refusal)

        try:
            async with anyio.create_task_group() as tg:
                for i, claim in enumerate(claims):
                    quota = self.limits(claim.identity) if claim is not None else None
                    if claim is not None and quota is not None:
                        tg.start_soon(one, i, claim, quota)
        except BaseException:
            for grant in grants:
                self.refund(grant)
                self.release(grant)
            raise
        return grants

    async def _decide_shared(self, grant: Grant, claim: Claim, quota: Quota) -> RpcError | None:
        """Take the claim's slot, then its batch charge, into ``grant``; the refusal if any."""
        identity = claim.identity
        assert identity is not None
        tokens = claim.tokens if quota.tpm is not None else 0
        if claim.call and (quota.rpm is not None or quota.concurrency is not None or tokens):
            refusal = await self._take_slot(grant, quota, tokens)
            if refusal is not None:
                return refusal
            if grant.slot is None:  # the state is down and quotas fail open: decide here
                local = self.decide_here(Claim(identity, call=True, tokens=tokens))
                if local.refusal is not None:
                    return local.refusal
                grant.slot, grant.tokens = local.slot, local.tokens
        if claim.batch_calls > 0 and quota.batch_calls_per_day is not None:
            return await self._charge(grant, quota, claim.batch_calls)
        return None

    async def _take_slot(self, grant: Grant, quota: Quota, tokens: int) -> RpcError | None:
        """One round trip for the key's rpm token, ``tokens`` and concurrency slot, into
        ``grant.slot`` and ``grant.tokens``."""
        identity = grant.identity
        assert identity is not None
        lease = f"{self.state.replica_id}:{next(self._ids)}"
        try:
            decision = await self.state.quota(identity, quota.rpm or 0.0, quota.concurrency or 0, lease,
                                              tpm=quota.tpm or 0.0, tokens=tokens)
        except StateUnavailable:
            self._seen.pop((identity, "rpm"), None)  # this replica's own buckets decide meanwhile
            self._seen.pop((identity, "tpm"), None)
            return self._unavailable()
        except BaseException:  # cancelled in the round trip: the slot may be taken; free it (any
            self._ended.append((identity, lease, 0))  # tokens it took stand: their reply is lost)
            self._wake.set()
            raise
        for kind, level in (("rpm", decision.level), ("tpm", decision.tokens_level)):
            if level is not None:
                seen = self._seen.get((identity, kind))
                if seen is None or seen[1] <= decision.at:  # the latest of an array decided at once
                    self._seen[(identity, kind)] = (level, decision.at, self.clock.now())
        if decision.wait > 0:
            which = decision.limit
            return rate_limited(which, decision.wait if which != "concurrency" else 0.05,
                                identity=identity)
        grant.slot, grant.tokens = lease, tokens
        self._leases[identity].add(lease)
        return None

    async def _charge(self, grant: Grant, quota: Quota, calls: int) -> RpcError | None:
        """The batch charge in the shared state, into ``grant.batch``."""
        identity = grant.identity
        assert identity is not None
        allowed = quota.batch_calls_per_day or 0
        wall = self.clock.wall()
        day = int(wall // 86_400)
        try:
            left = await self.state.batch_charge(identity, day, calls, allowed)
        except StateUnavailable:
            refusal = self._unavailable()
            if refusal is not None:
                return refusal
            local = self.decide_here(Claim(identity, call=False, batch_calls=calls))
            grant.batch = local.batch
            return local.refusal
        if left >= 0:
            return rate_limited("batch_calls_per_day", (day + 1) * 86_400 - wall, identity=identity,
                                allowed=allowed, remaining=left)
        grant.batch = (day, calls, True)
        return None

    def window(self, identity: str | None,
               kind: str = "rpm") -> tuple[float, float | None, float | None] | None:
        """The rpm or tpm bucket as the last shared decision for this key left it, refilled to
        now on this replica's clock: the headers cost no round trip of their own. Calls made (and
        tokens settled) through any replica since then show from this replica's next decision on."""
        quota = self.limits(identity)
        limit = None if quota is None else quota.rpm if kind == "rpm" else quota.tpm
        seen = self._seen.get((identity, kind)) if identity else None
        if limit is None or seen is None:
            return super().window(identity, kind)
        level, _, taken = seen
        rate = limit / 60.0
        left = min(limit, max(level, 0.0) + max(0.0, self.clock.now() - taken) * rate)
        return limit, left, (limit - left) / rate

    def _shared(self, grant: Grant) -> bool:
        """The grant's slot and tokens were taken in the shared state (not here, degraded)."""
        return grant.slot is not None and grant.slot != LOCAL and grant.identity is not None

    def release(self, grant: Grant, used: int | None = None) -> None:
        if not self._shared(grant):
            super().release(grant, used)
            return
        assert grant.identity is not None and grant.slot is not None
        charged, grant.tokens = grant.tokens, 0
        delta = used - charged if charged and used is not None else 0
        lease, grant.slot = grant.slot, None
        self._leases[grant.identity].discard(lease)
        self._ended.append((grant.identity, lease, delta))
        self._wake.set()

    def settle_tokens(self, grant: Grant, used: int | None) -> None:
        if not self._shared(grant):
            super().settle_tokens(grant, used)
            return
        charged, grant.tokens = grant.tokens, 0
        if used is not None and used != charged:
            self._ended.append((grant.identity, "", used - charged))  # type: ignore[arg-type]
            self._wake.set()

    def refund(self, grant: Grant) -> None:
        if self.refund_elsewhere(grant, self._refunds):
            self._wake.set()
        else:
            super().refund(grant)

    async def flush(self) -> None:
        """Free the slots of the calls that ended, settle their tokens, and give back the batch
        charges of calls that never ran (the gateway awaits this before it answers, so a caller's
        next call finds its slot free and its tokens settled)."""
        refunds, self._refunds = self._refunds, []
        for identity, day, calls in refunds:
            try:
                allowed = self.quotas[identity].batch_calls_per_day or 0
                await self.state.batch_charge(identity, day, -calls, allowed)
            except StateUnavailable:
                self.degraded("quota")  # the charge stands
        ended, self._ended = self._ended, []
        for identity, lease, delta in ended:
            quota = self.quotas.get(identity)
            try:
                await self.state.quota_release(identity, lease, delta,
                                               (quota.tpm or 0.0) if quota is not None else 0.0)
            except StateUnavailable:
                self.degraded("quota")  # the slot expires with its lease; the estimate stands

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
