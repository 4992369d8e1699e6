"""Circuit breakers shared by replicas in Redis (``core/breaker.BreakerStore``).

Per endpoint, a sorted set of recent failures (scored by Redis' own time, so replicas' clocks
never disagree) and an ``open`` key that lives for the cooldown. A failure that brings the
window's count to ``allowed_fails`` sets the key; every replica reads its time to live in the
background and opens its own breaker for what is left of it. A probe's success clears the
failures. One round trip per report, one per poll of all breakers.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from multiplexer.core.policy import BreakerPolicy
from multiplexer.core.state import StateUnavailable

# KEYS: fails, open, probe. ARGV: window_ms, allowed_fails, cooldown_ms, failed (1/0), member,
# probe (1/0). Returns the milliseconds the breaker stays open (0: closed).
REPORT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[6] == '1' then
  redis.call('DEL', KEYS[3])
  if ARGV[4] == '1' then
    redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
    return tonumber(ARGV[3])
  end
end
if ARGV[4] ~= '1' then
  redis.call('DEL', KEYS[1])
  return 0
end
local open = redis.call('PTTL', KEYS[2])
if open > 0 then return open end
redis.call('ZADD', KEYS[1], now, ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  return tonumber(ARGV[3])
end
return 0
"""


def _tag(name: str) -> str:
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


class RedisBreakers:
    def __init__(self, r: aioredis.Redis, prefix: str) -> None:
        self.r = r
        self.prefix = prefix
        self._report = r.register_script(REPORT)
        self._seq = 0

    def _keys(self, name: str) -> list[str]:
        base = f"{self.prefix}:{{b:{_tag(name)}}}"
        return [f"{base}:fails", f"{base}:open", f"{base}:probe"]

    async def report(self, name: str, policy: BreakerPolicy, failed: bool, probe: bool) -> float:
        self._seq += 1
        member = f"{id(self):x}:{self._seq}"
        args: list[Any] = [int(policy.window_s * 1000), policy.allowed_fails,
                           int(policy.cooldown_s * 1000), 1 if failed else 0, member, 1 if probe else 0]
        try:
            ms = await self._report(keys=self._keys(name), args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        return max(int(ms), 0) / 1000.0

    async def claim_probe(self, name: str, policy: BreakerPolicy) -> bool:
        """SET NX with the cooldown as its lease: a probe whose replica died frees itself."""
        try:
            return bool(await self.r.set(self._keys(name)[2], "1", nx=True,
                                         px=int(policy.cooldown_s * 1000)))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def open_for(self, names: list[str]) -> list[float]:
        if not names:
            return []
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.pttl(self._keys(name)[1])
                ttls = await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        return [max(int(ms), 0) / 1000.0 for ms in ttls]
