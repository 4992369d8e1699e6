"""Per-identity quotas: requests per minute and concurrent calls."""

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

    def release(self, identity: str | None) -> None:
        if identity is not None and self._active.get(identity, 0) > 0:
            self._active[identity] -= 1
