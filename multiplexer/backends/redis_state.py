"""Shared state in Redis: limits, quotas, batch allowances, the result cache, replica liveness.

One round trip per decision (``EVALSHA`` of a script in ``redis_lua``). Keys of one
provider or key share a hash tag (``mx:{p:<name>}:rpm``) so they land in one slot of
a Redis Cluster. Any Redis error or a reply slower than ``timeout_s`` becomes
``StateUnavailable``: the caller decides locally and counts it. Why the ``redis``
client: it is the maintained official client, asyncio-native, with script caching.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from multiplexer.core.startup import StartupError, os_reason
from multiplexer.core.state import Granted, Learned, LimitSpec, QuotaDecision, StateUnavailable

from . import redis_lua


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


START_ATTEMPTS = 3


def _why(error: BaseException, timeout_s: float) -> str:
    """What the operator reads when Redis cannot be used at start."""
    if isinstance(error, AuthenticationError):
        return f"authentication failed ({error})"
    if isinstance(error, RedisTimeoutError):
        return f"no answer within {timeout_s * 1000:g} ms (state.timeout_ms)"
    reason = os_reason(error)
    return f"cannot connect ({reason})" if reason else f"{type(error).__name__}: {error}"


def _tag(name: str) -> str:
    """A hash-tag-safe name: braces or odd characters in a provider or key name cannot split it."""
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


class RedisState:
    def __init__(self, url: str, prefix: str = "mx", lease_s: float = 30.0,
                 timeout_s: float = 0.5) -> None:
        self.url = url
        self.prefix = prefix
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.replica_id = secrets.token_hex(6)
        self._live = 1
        self.r = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        # blocking reads (a flight's end) wait longer than ``timeout_s``: their own connections
        self._blocking = aioredis.Redis.from_url(
            url, socket_timeout=None, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._acquire = self.r.register_script(redis_lua.ACQUIRE)
        self._settle = self.r.register_script(redis_lua.SETTLE)
        self._renew = self.r.register_script(redis_lua.RENEW)
        self._heartbeat = self.r.register_script(redis_lua.HEARTBEAT)
        self._batch = self.r.register_script(redis_lua.BATCH_CHARGE)
        self._claim = self.r.register_script(redis_lua.CLAIM)
        self._publish = self.r.register_script(redis_lua.PUBLISH)
        self._keep = self.r.register_script(redis_lua.KEEP)
        self._abandon = self.r.register_script(redis_lua.ABANDON)
        self._result = self.r.register_script(redis_lua.RESULT)

    def _keys(self, scope: str, name: str) -> list[str]:
        base = f"{self.prefix}:{{{scope}:{_tag(name)}}}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:inflight"]

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """The first heartbeat, which must reach Redis: a wrong ``state.url`` (nothing listening,
        a password refused, no such database) stops start-up with one line, rather than a
        gateway that starts degraded and stays so. Later outages degrade (``StateUnavailable``).
        A slow answer is asked again (a busy host at start), a refusal is final."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                await self.heartbeat()
                return
            except StateUnavailable as e:
                cause = e.__cause__ or e
                if not (isinstance(cause, RedisTimeoutError) and attempt < START_ATTEMPTS):
                    raise StartupError("state.url", self.url, _why(cause, self.timeout_s)) from None

    async def aclose(self) -> None:
        await self._blocking.aclose()
        await self.r.aclose()

    async def ping(self) -> None:
        try:
            await self.r.ping()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def heartbeat(self) -> int:
        live = await self._call(self._heartbeat, [f"{self.prefix}:replicas"],
                                [self.replica_id, self.lease_s])
        self._live = max(1, int(live))
        return self._live

    async def heartbeat_forever(self) -> None:
        while True:
            with contextlib.suppress(StateUnavailable):
                await self.heartbeat()
            await anyio.sleep(self.lease_s / 3)

    def live_replicas(self) -> int:
        return self._live

    def breaker_store(self) -> Any:
        """Circuit breakers shared by the replicas (``core/breaker.SharesBreakers``)."""
        from .redis_breaker import RedisBreakers

        return RedisBreakers(self.r, self.prefix)

    # -- provider limits -------------------------------------------------------------
    async def acquire(self, provider: str, lease_id: str, tokens: int,
                      spec: LimitSpec) -> tuple[float, str]:
        got = await self.acquire_many(provider, [(lease_id, tokens)], spec)
        return (0.0, "") if got.granted else (got.wait, got.limit)

    async def acquire_many(self, provider: str, asks: Sequence[tuple[str, int]],
                           spec: LimitSpec) -> Granted:
        args: list[Any] = [spec.rpm, spec.tpm, spec.concurrency, self.lease_s]
        for lease_id, tokens in asks:
            args += [lease_id, tokens]
        reply = await self._call(self._acquire, self._keys("p", provider), args)
        return Granted(int(reply[4]), float(reply[0]), _text(reply[1]))

    async def settle(self, provider: str, lease_id: str, token_delta: float,
                     learned: Sequence[Learned], spec: LimitSpec, requests: int = 0) -> None:
        if not lease_id and not token_delta and not learned and not requests:
            return
        args: list[Any] = [spec.rpm, spec.tpm, lease_id, token_delta, requests]
        for obs in learned:
            args += [obs.kind, obs.limit if obs.limit else -1, obs.remaining, obs.reset_in]
        await self._call(self._settle, self._keys("p", provider), args)

    async def renew(self, provider: str, lease_ids: Sequence[str]) -> None:
        await self._call(self._renew, self._keys("p", provider)[2:], list(lease_ids))

    # -- per-key quotas ----------------------------------------------------------------
    async def quota(self, identity: str, rpm: float, concurrency: int, lease_id: str, *,
                    tpm: float = 0.0, tokens: int = 0) -> QuotaDecision:
        wait, which, level, at, granted, tokens_level = await self._call(
            self._acquire, self._keys("q", identity),
            [rpm, tpm, concurrency, self.lease_s, lease_id, tokens])
        level, tokens_level = _text(level), _text(tokens_level)
        if granted:
            wait, which = 0.0, ""
        return QuotaDecision(float(wait), _text(which), float(level) if level else None,
                             float(at), float(tokens_level) if tokens_level else None)

    async def quota_release(self, identity: str, lease_id: str, token_delta: int = 0,
                            tpm: float = 0.0) -> None:
        await self.settle_keys(self._keys("q", identity), lease_id, token_delta, tpm)

    async def settle_keys(self, keys: list[str], lease_id: str, token_delta: int = 0,
                          tpm: float = 0.0) -> None:
        await self._call(self._settle, keys, [0, tpm, lease_id, token_delta, 0])

    async def quota_renew(self, identity: str, lease_ids: Sequence[str]) -> None:
        await self._call(self._renew, self._keys("q", identity)[2:], list(lease_ids))

    async def batch_charge(self, identity: str, day: int, calls: int, allowed: int) -> int:
        key = f"{self.prefix}:{{q:{_tag(identity)}}}:batch:{day}"
        return int(await self._call(self._batch, [key], [calls, allowed]))

    def mcp_sessions(self) -> Any:
        """Handshake-era MCP sessions any replica serves (``faces/mcp/replica_sessions.py``)."""
        from multiplexer.backends.redis_mcp_sessions import RedisMcpSessions

        return RedisMcpSessions(self.r, self._blocking, self.prefix, self.replica_id, _tag)

    def budget_counters(self) -> Any:
        """Budget counters on this state's server (money/budgets.py decides with them)."""
        from multiplexer.backends.redis_budget import RedisBudgetCounters

        return RedisBudgetCounters(self.r, self.prefix)

    # -- single flight and the result cache ----------------------------------------------
    def _flight(self, key: str, token: str = "") -> list[str]:
        base = f"{self.prefix}:{{f:{key}}}"
        return [f"{base}:lock", f"{base}:res:{token}", f"{base}:cache", f"{base}:end:{token}"]

    async def claim(self, key: str, token: str) -> tuple[str, Any]:
        keys = self._flight(key)
        state, value, *left = await self._call(self._claim, [keys[0], keys[2]],
                                               [token, int(self.lease_s * 1000)])
        state = state.decode() if isinstance(state, bytes) else state
        if state == "cached":
            return state, (json.loads(value), max(int(left[0]), 0) / 1000.0)
        return state, value.decode() if isinstance(value, bytes) else value

    async def publish(self, key: str, token: str, result: Any, cache_ttl_s: float) -> None:
        await self._call(self._publish, self._flight(key, token),
                         [token, json.dumps(result), int(self.lease_s * 1000),
                          int(cache_ttl_s * 1000)])

    async def abandon(self, key: str, token: str) -> None:
        keys = self._flight(key, token)
        await self._call(self._abandon, [keys[0], keys[3]], [token, int(self.lease_s * 1000)])

    async def keep(self, key: str, token: str) -> bool:
        return bool(await self._call(self._keep, self._flight(key)[:1],
                                     [token, int(self.lease_s * 1000)]))

    async def result(self, key: str, token: str) -> tuple[bool, Any]:
        reply = await self._call(self._result, self._flight(key, token)[:2], [token])
        if reply[0] == 1:
            return True, json.loads(reply[1])
        if reply[0] == 0:
            return False, None
        raise LookupError(key)

    async def wait(self, key: str, token: str, timeout_s: float) -> tuple[bool, Any]:
        done, value = await self.result(key, token)
        if done:
            return done, value
        try:  # woken by the flight's end (published or abandoned), or after timeout_s
            await self._blocking.xread({self._flight(key, token)[3]: "0-0"}, count=1,
                                       block=max(1, int(timeout_s * 1000)))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        return await self.result(key, token)
