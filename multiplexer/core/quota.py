"""Per-key quotas: requests and tokens per minute, concurrent calls, and batch-job calls per day.

A quota is decided once per call, as a ``Grant`` that the call keeps until it ends: the
refusal, or what it holds (a concurrency slot, a batch charge) and must give back. The
grant travels with the call, so nothing is ever matched to a call by its position in a
queue, and giving back is the grant's own business (once, however the call ends).

Tokens per minute are charged the call's estimate (``Item.tokens``, the one its lane charges to
the provider's ``tpm``) at admission and settled to the usage its answer reports when it ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError, rate_limited
from multiplexer.core.limiter import TokenBucket
from multiplexer.core.policy import Quota

LOCAL = "local"  # a slot held on this process's counters (no shared lease)


@dataclass(slots=True, frozen=True)
class Claim:
    """What one call asks of its key's quota: a call (rpm, concurrency and ``tokens``, its
    estimate, asked only of a key with tpm) and/or batch calls."""

    identity: str | None
    call: bool = True
    batch_calls: int = 0
    tokens: int = 0


@dataclass(slots=True, eq=False)
class Grant:
    """One call's quota decision: refused, or what it holds until it ends.

    ``slot`` is ``LOCAL`` or the shared lease id of the key's concurrency slot it holds;
    ``batch`` the (UTC day, calls, decided in shared state) it charged to the key's batch
    allowance, given back only if the call never runs (``Quotas.refund``); ``tokens`` the
    estimate it charged to the key's tpm, settled to the real usage as it ends
    (``Quotas.release``)."""

    identity: str | None = None
    refusal: RpcError | None = None
    slot: str | None = None
    batch: tuple[int, int, bool] | None = None
    tokens: int = 0


FREE = Grant()  # keyless callers and keys without a quota: nothing held, never mutated


class Quotas:
    """The in-process quotas of one gateway; ``SharedQuotas`` decides in the shared state."""

    def __init__(self, clock: Clock, quotas: dict[str, Quota],
                 part: Callable[[Quota], Quota] | None = None) -> None:
        self.clock = clock
        self.part = part  # this process's part of a key's quota (workers without shared state)
        self.quotas = quotas if part is None else {k: part(q) for k, q in quotas.items()}
        self._buckets: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}  # identity -> its tpm bucket
        self._active: dict[str, int] = {}
        self._batch: dict[str, tuple[int, int]] = {}  # identity -> (UTC day, calls charged that day)

    def set_limits(self, identity: str, quota: Quota | None) -> None:
        """A key's quota changed while the gateway runs (keys in the store): its rpm bucket starts
        again at the new rate; slots held stay held and are released as usual."""
        if quota is not None and self.part is not None:
            quota = self.part(quota)
        if quota is None:
            self.quotas.pop(identity, None)
        elif self.quotas.get(identity) != quota:
            self.quotas[identity] = quota
        else:
            return
        self._buckets.pop(identity, None)
        self._tokens.pop(identity, None)

    def limits(self, identity: str | None) -> Quota | None:
        return self.quotas.get(identity) if identity is not None else None

    async def decide(self, claims: Sequence[Claim | None]) -> list[Grant]:
        """One grant per claim, in order (None: the call asks nothing of a quota)."""
        return [FREE if c is None else self.decide_here(c) for c in claims]

    def decide_here(self, claim: Claim) -> Grant:
        """Decide on this process's counters, all or nothing: a refused call takes no rpm token,
        no tokens, no slot and no batch charge."""
        identity = claim.identity
        quota = self.limits(identity)
        if quota is None or identity is None:
            return FREE
        now = self.clock.now()
        bucket = tokens = None
        try:
            if claim.call:
                if quota.concurrency is not None and self._active.get(identity, 0) >= quota.concurrency:
                    raise rate_limited("concurrency", 0.05, identity=identity)
                if quota.rpm is not None:
                    bucket = self._buckets.get(identity)
                    if bucket is None:
                        bucket = self._buckets[identity] = TokenBucket.per_minute(quota.rpm, now)
                    wait = bucket.delay(1, now)
                    if wait > 0:
                        raise rate_limited("rpm", wait, identity=identity)
                if quota.tpm is not None and claim.tokens > 0:
                    tokens = self._tokens.get(identity)
                    if tokens is None:
                        tokens = self._tokens[identity] = TokenBucket.per_minute(quota.tpm, now)
                    wait = tokens.delay(claim.tokens, now)
                    if wait > 0:
                        raise rate_limited("tpm", wait, identity=identity)
            day_used = self._batch_room(identity, quota, claim.batch_calls)
        except RpcError as e:
            return Grant(identity, refusal=e)
        grant = Grant(identity)
        if claim.call:
            if bucket is not None:
                bucket.consume(1, now)
            if tokens is not None:
                tokens.consume(claim.tokens, now)
                grant.tokens = claim.tokens
            self._active[identity] = self._active.get(identity, 0) + 1
            grant.slot = LOCAL
        if day_used is not None:
            day, used = day_used
            self._batch[identity] = (day, used + claim.batch_calls)
            grant.batch = (day, claim.batch_calls, False)
        return grant

    def _batch_room(self, identity: str, quota: Quota, calls: int) -> tuple[int, int] | None:
        """(UTC day, calls used that day) when ``calls`` fit the key's daily batch allowance;
        None when nothing is to be charged; a -32003 refusal when they do not fit: a job may
        hold 100,000 calls for the price of one request, so rpm alone cannot bound it."""
        if quota.batch_calls_per_day is None or calls <= 0:
            return None
        wall = self.clock.wall()
        day = int(wall // 86_400)
        seen_day, used = self._batch.get(identity, (day, 0))
        if seen_day != day:
            used = 0
        if used + calls > quota.batch_calls_per_day:
            raise rate_limited("batch_calls_per_day", (day + 1) * 86_400 - wall, identity=identity,
                               allowed=quota.batch_calls_per_day, remaining=quota.batch_calls_per_day - used)
        return day, used

    def release(self, grant: Grant, used: int | None = None) -> None:
        """The call ended: free its slot (once, however often it is asked) and settle its tokens
        to ``used`` (None: unknown, the estimate stands)."""
        if grant.tokens:
            self.settle_tokens(grant, used)
        if grant.slot == LOCAL and grant.identity is not None:
            grant.slot = None
            if self._active.get(grant.identity, 0) > 0:
                self._active[grant.identity] -= 1

    def settle_tokens(self, grant: Grant, used: int | None) -> None:
        """Move the key's tpm bucket by what the call used beyond its estimate (once)."""
        charged, grant.tokens = grant.tokens, 0
        bucket = self._tokens.get(grant.identity)  # type: ignore[arg-type]
        if used is not None and used != charged and bucket is not None:
            bucket.correct(used - charged, self.clock.now())

    def refund(self, grant: Grant) -> None:
        """The call was refused after its decision and never ran: give back its batch charge
        and its tokens."""
        if grant.tokens:
            self.settle_tokens(grant, 0)
        if grant.batch is None or grant.identity is None:
            return
        (day, calls, _), grant.batch = grant.batch, None
        seen_day, used = self._batch.get(grant.identity, (day, 0))
        if seen_day == day:
            self._batch[grant.identity] = (day, max(0, used - calls))

    def refund_elsewhere(self, grant: Grant, refunds: list[tuple[str, int, int]]) -> bool:
        """Refund a grant whose batch charge is kept outside this process (``batch[2]``: the shared
        state, the workers' file): its tokens given back now, its (identity, day, calls) noted in
        ``refunds`` for the subclass's ``flush``. False: the charge is this process's own."""
        if grant.batch is None or not grant.batch[2] or grant.identity is None:
            return False
        if grant.tokens:
            self.settle_tokens(grant, 0)
        (day, calls, _), grant.batch = grant.batch, None
        refunds.append((grant.identity, day, calls))
        return True

    def window(self, identity: str | None,
               kind: str = "rpm") -> tuple[float, float | None, float | None] | None:
        """(limit, remaining, seconds until full) of the caller's ``rpm`` or ``tpm`` quota; None
        without one. Remaining and reset are None where this process does not hold the bucket
        (shared quotas)."""
        quota = self.limits(identity)
        limit = None if quota is None else quota.rpm if kind == "rpm" else quota.tpm
        if limit is None:
            return None
        bucket = (self._buckets if kind == "rpm" else self._tokens).get(identity)  # type: ignore[arg-type]
        if bucket is None:
            return limit, None, None
        left = max(bucket.available(self.clock.now()), 0.0)
        return limit, left, (limit - left) / bucket.rate if bucket.rate else 0.0

    async def admit(self, identity: str | None) -> Grant:
        """One call's grant for callers outside the gateway's call path (MCP resources and
        prompts, task lookups); raises the refusal."""
        return _granted((await self.decide([Claim(identity)]))[0])

    @asynccontextmanager
    async def held(self, identity: str | None,
                   refused: Callable[[RpcError], Exception]) -> AsyncIterator[Grant]:
        """One request of the caller's key held while the body runs (a request that submits no
        call: MCP resources and prompts, task lookups, ``/v1`` files and batch records) and
        released however it ends. A refusal is raised as ``refused`` makes it, the face's shape;
        the body's own errors pass through as they are."""
        try:
            grant = await self.admit(identity)
        except RpcError as e:
            raise refused(e) from None
        try:
            yield grant
        finally:
            self.release(grant)

    async def charge(self, identity: str | None, calls: int) -> Grant:
        """A batch charge for ``calls`` (a ``jobs.submit``'s calls); raises the refusal."""
        return _granted((await self.decide([Claim(identity, call=False, batch_calls=calls)]))[0])

    async def flush(self) -> None:
        """Shared quotas hand back what ended before the gateway answers; in-process, at once."""


def _granted(grant: Grant) -> Grant:
    if grant.refusal is not None:
        raise grant.refusal
    return grant
