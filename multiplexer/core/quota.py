"""Per-identity quotas: requests per minute, concurrent calls, and batch-job calls per day."""

from __future__ import annotations

from multiplexer.core.clock import Clock
from multiplexer.core.errors import rate_limited
from multiplexer.core.limiter import TokenBucket
from multiplexer.core.policy import Quota


class Quotas:
    def __init__(self, clock: Clock, quotas: dict[str, Quota]) -> None:
        self.clock = clock
        self.quotas = quotas
        self._buckets: dict[str, TokenBucket] = {}
        self._active: dict[str, int] = {}
        self._batch: dict[str, tuple[int, int]] = {}  # identity -> (UTC day, calls charged that day)

    def acquire(self, identity: str | None) -> bool:
        """Admit one call for ``identity`` or raise -32003; True when a slot must be released."""
        quota = self.quotas.get(identity) if identity else None
        if quota is None:
            return False
        assert identity is not None
        now = self.clock.now()
        if quota.concurrency is not None and self._active.get(identity, 0) >= quota.concurrency:
            raise rate_limited("concurrency", 0.05, identity=identity)
        if quota.rpm is not None:
            bucket = self._buckets.get(identity)
            if bucket is None:
                bucket = self._buckets[identity] = TokenBucket.per_minute(quota.rpm, now)
            wait = bucket.delay(1, now)
            if wait > 0:
                raise rate_limited("rpm", wait, identity=identity)
            bucket.consume(1, now)
        self._active[identity] = self._active.get(identity, 0) + 1
        return True

    def charge_batch(self, identity: str | None, calls: int) -> None:
        """Count ``calls`` carried by a batch job against the key's daily allowance, all or none:
        a job may hold 100,000 calls for the price of one request, so rpm alone cannot bound it."""
        quota = self.quotas.get(identity) if identity else None
        if quota is None or quota.batch_calls_per_day is None or calls <= 0:
            return
        assert identity is not None
        wall = self.clock.wall()
        day = int(wall // 86_400)
        seen_day, used = self._batch.get(identity, (day, 0))
        if seen_day != day:
            used = 0
        if used + calls > quota.batch_calls_per_day:
            raise rate_limited("batch_calls_per_day", (day + 1) * 86_400 - wall, identity=identity,
                               allowed=quota.batch_calls_per_day, remaining=quota.batch_calls_per_day - used)
        self._batch[identity] = (day, used + calls)

    def forgo_batch(self, identity: str | None) -> None:
        """A call refused before ``charge_batch``: in-process nothing was charged yet."""

    def rpm_state(self, identity: str | None) -> tuple[float, float | None, float | None] | None:
        """(limit, remaining, seconds until full) of the caller's rpm quota; None without one.
        Remaining and reset are None where this process does not hold the bucket (shared quotas)."""
        quota = self.quotas.get(identity) if identity else None
        if quota is None or quota.rpm is None:
            return None
        bucket = self._buckets.get(identity)  # type: ignore[arg-type]
        if bucket is None:
            return quota.rpm, None, None
        bucket.delay(0, self.clock.now())  # refill to now
        left = max(bucket.level, 0.0)
        return quota.rpm, left, (quota.rpm - left) / bucket.rate if bucket.rate else 0.0

    async def reserve(self, claims: list[tuple[str, int]]) -> None:
        """Shared quotas decide ahead, per (identity, batch calls); in-process ones need not."""

    async def admit(self, identity: str | None) -> bool:
        """``acquire`` for callers outside the gateway's call path (MCP resources and prompts)."""
        if identity is not None:
            await self.reserve([(identity, 0)])
        return self.acquire(identity)

    async def charge(self, identity: str | None, calls: int) -> None:
        """``charge_batch`` for callers that may wait (the jobs.* face)."""
        if identity is not None and calls > 0:
            await self.reserve([(identity, calls)])
        self.charge_batch(identity, calls)

    def release(self, identity: str | None) -> None:
        if identity is not None and self._active.get(identity, 0) > 0:
            self._active[identity] -= 1
