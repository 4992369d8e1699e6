"""Budget counters in Redis: every replica reserves and settles on the same counters, each
reservation one script run (all of a caller's caps checked and charged at once, or none).

All budget keys share one hash tag, so a caller's key and team counters live in one slot of
a Redis Cluster and one script may touch them together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from multiplexer.backends import redis_lua
from multiplexer.core.state import StateUnavailable


class RedisBudgetCounters:
    """The ``money.budgets.Counters`` of a ``RedisState``."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = f"{prefix}:{{budget}}:"
        self._reserve = client.register_script(redis_lua.BUDGET_RESERVE)
        self._settle = client.register_script(redis_lua.BUDGET_SETTLE)

    async def reserve(self, counters: Sequence[Any], amount: int) -> tuple[int, int, list[int]]:
        keys = [self.prefix + c.key for c in counters]
        args: list[Any] = [amount]
        for c in counters:
            args += [c.limit, c.alert, c.ttl_ms]
        try:
            refused, spent, *alerts = await self._reserve(keys=keys, args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        return int(refused), int(spent), [int(a) for a in alerts]

    async def settle(self, changes: Sequence[tuple[str, int]]) -> None:
        if not changes:
            return
        try:
            await self._settle(keys=[self.prefix + k for k, _ in changes], args=[d for _, d in changes])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
