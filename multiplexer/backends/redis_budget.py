"""Budget counters in Redis: every replica reserves and settles on the same counters, each
reservation one script run (all of a caller's caps checked and charged at once, or none).

Redis is the fast path, the store is the record: with ``seed`` set, a counter Redis does not have
(a new period, or a Redis restarted empty) is first set from the spend the store recorded for its
period, so a cold Redis does not hand a spent budget out again.

All budget keys share one hash tag, so a caller's key and team counters live in one slot of
a Redis Cluster and one script may touch them together."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from multiplexer.backends import redis_lua
from multiplexer.core.state import StateUnavailable

Seed = Callable[[Sequence[Any]], Awaitable[list[int]]]  # counters -> the spend recorded for each


class RedisBudgetCounters:
    """The ``money.budgets.Counters`` of a ``RedisState``."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = f"{prefix}:{{budget}}:"
        self.seed: Seed | None = None  # set by the composer when there is a store to seed from
        self._reserve = client.register_script(redis_lua.BUDGET_RESERVE)
        self._seed = client.register_script(redis_lua.BUDGET_SEED)
        self._settle = client.register_script(redis_lua.BUDGET_SETTLE)

    async def reserve(self, counters: Sequence[Any], amount: int) -> tuple[int, int, list[int]]:
        keys = [self.prefix + c.key for c in counters]
        args: list[Any] = [amount, "1" if self.seed is not None else "0"]
        for c in counters:
            args += [c.limit, c.alert, c.ttl_ms]
        try:
            refused, spent, *rest = await self._reserve(keys=keys, args=args)
            if int(refused) == -1 and self.seed is not None:  # cold: seeded, then asked again
                missing = [counters[int(i)] for i in rest]
                recorded = await self.seed(missing)
                seeds: list[Any] = []
                for c, value in zip(missing, recorded, strict=True):
                    seeds += [value, c.ttl_ms]
                await self._seed(keys=[self.prefix + c.key for c in missing], args=seeds)
                args[1] = "0"
                refused, spent, *rest = await self._reserve(keys=keys, args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        return int(refused), int(spent), [int(a) for a in rest]

    async def settle(self, changes: Sequence[tuple[str, int]]) -> None:
        if not changes:
            return
        try:
            await self._settle(keys=[self.prefix + k for k, _ in changes], args=[d for _, d in changes])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
