"""Handshake-era MCP sessions kept in Redis, so any replica serves any ``Mcp-Session-Id``.

One hash per session (``mx:mcp:<mount>:s:<session id>``: its negotiated revision, the client's
``initialize`` params, who opened it, its path, its log level), expiring ``server.mcp.session_idle_s``
after the last touch by any replica. One pub/sub channel per MCP mount carries what a replica
cannot deliver itself: a server-to-client message for a client whose GET stream another replica
holds, a client's answer (or cancel) for a request another replica is waiting on, and a session's
end. Open sessions are counted for every replica (``server.mcp.max_sessions`` and
``max_sessions_per_key``): a sorted set per mount of the sessions by when they idle out (pushed on
by every touch), and one per credential of its sessions, each taken and checked in one script as a
session opens and dropped as it ends (``DELETE``) or idles out. Any Redis error becomes
``StateUnavailable``: the face then serves the session where it is (sticky, as without Redis) and
counts the degraded decision.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import redis.asyncio as aioredis
from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from multiplexer.core.state import StateUnavailable

log = logging.getLogger(__name__)

# Only a session that still exists takes a new level (an expired one is not brought back as a
# half-record holding nothing but a level).
_SET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""


# KEYS: the mount's open set, the credential's. ARGV: session id, idle ms, most open on the mount
# (0: none), most open for the credential (0: none). Expired sessions leave the open set; a
# credential's sessions not in it are gone. {1, 0} when taken, else {0, 'all' or 'key', open}.
_OPEN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local most, per = tonumber(ARGV[3]), tonumber(ARGV[4])
local open = redis.call('ZCARD', KEYS[1])
if most > 0 and open >= most then return {0, 'all', open} end
if per > 0 then
  for _, sid in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if not redis.call('ZSCORE', KEYS[1], sid) then redis.call('ZREM', KEYS[2], sid) end
  end
  local mine = redis.call('ZCARD', KEYS[2])
  if mine >= per then return {0, 'key', mine} end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 86400000)
redis.call('PEXPIRE', KEYS[2], 86400000)
return {1, 0}
"""

# KEYS: the session's record, the mount's open set. ARGV: session id, idle ms. The session's idle
# time starts again (record and open set); 0 where its record is gone.
_TOUCH = """
if redis.call('PEXPIRE', KEYS[1], ARGV[2]) == 1 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[2], 86400000)
  return 1
end
return 0
"""

# KEYS: the session's record, the mount's open set. ARGV: session id, the credential's set's key
# prefix, the credential ('' when unknown: read from the record). The session ends everywhere.
_END = """
local owner = ARGV[3]
if owner == '' then owner = redis.call('HGET', KEYS[1], 'owner') or '' end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if owner ~= '' then redis.call('ZREM', ARGV[2] .. redis.sha1hex(owner), ARGV[1]) end
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisMcpSessions:
    """The session records and the message channel of one gateway's MCP mounts."""

    def __init__(self, r: aioredis.Redis, listener: aioredis.Redis, prefix: str, replica_id: str,
                 tag: Callable[[str], str]) -> None:
        self.r = r
        self._listener = listener  # no socket timeout: a subscription waits as long as it must
        self.prefix = prefix
        self.replica_id = replica_id
        self._tag = tag
        self._set = r.register_script(_SET_IF_EXISTS)
        self._open = r.register_script(_OPEN)
        self._touch = r.register_script(_TOUCH)
        self._end = r.register_script(_END)

    def _key(self, mount: str, session_id: str) -> str:
        return f"{self.prefix}:mcp:{self._tag(mount)}:s:{session_id}"

    def _open_key(self, mount: str) -> str:
        return f"{self.prefix}:mcp:{self._tag(mount)}:open"

    def _owner_key(self, mount: str, owner: str) -> str:
        return self._open_key(mount) + ":" + hashlib.sha1(owner.encode()).hexdigest()  # as _END names it

    async def open(self, mount: str, session_id: str, owner: str, ttl_s: float, most: int | None,
                   per_owner: int | None) -> tuple[bool, str, int]:
        """Count a session opening on any replica, unless the mount holds ``most`` open or its
        credential (``owner``, as the record keeps it) ``per_owner``: (taken, the cap that refused
        it: ``all`` or ``key``, how many are open under it)."""
        try:
            reply = await self._open(keys=[self._open_key(mount), self._owner_key(mount, owner)],
                                     args=[session_id, _ms(ttl_s), most or 0, per_owner or 0])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        if int(reply[0]) == 1:
            return True, "", 0
        return False, _text(reply[1]), int(reply[2])

    async def open_count(self, mount: str) -> int:
        """Sessions open on the mount, every replica's (those idled out not counted)."""
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.time()
                pipe.zrange(self._open_key(mount), 0, -1, withscores=True)
                (secs, micros), members = await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        now_ms = secs * 1000 + micros // 1000
        return sum(1 for _, score in members if score > now_ms)

    def channel(self, mount: str) -> str:
        return f"{self.prefix}:mcp:{self._tag(mount)}:bus"

    async def save(self, mount: str, session_id: str, fields: dict[str, str], ttl_s: float) -> None:
        key = self._key(mount, session_id)
        try:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                pipe.pexpire(key, _ms(ttl_s))
                await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def load(self, mount: str, session_id: str, ttl_s: float) -> dict[str, str] | None:
        """The session's record (its idle time starting again), or None where none is kept."""
        key = self._key(mount, session_id)
        try:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.hgetall(key)
                await self._touch(keys=[key, self._open_key(mount)], args=[session_id, _ms(ttl_s)],
                                  client=pipe)
                found, _ = await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        if not found:
            return None
        return {_text(k): _text(v) for k, v in found.items()}

    async def touch(self, mount: str, session_id: str, ttl_s: float) -> bool:
        """Start the session's idle time again; False if it is gone (ended or expired)."""
        try:
            return bool(await self._touch(keys=[self._key(mount, session_id), self._open_key(mount)],
                                          args=[session_id, _ms(ttl_s)]))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def set_field(self, mount: str, session_id: str, field: str, value: str,
                        ttl_s: float) -> bool:
        try:
            return bool(await self._set(keys=[self._key(mount, session_id)],
                                        args=[field, value, _ms(ttl_s)]))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def delete(self, mount: str, session_id: str, owner: str = "") -> None:
        """End the session for every replica: its record, and its place in the open counts
        (``owner``: its credential as the record keeps it; "" read from the record)."""
        try:
            await self._end(keys=[self._key(mount, session_id), self._open_key(mount)],
                            args=[session_id, self._open_key(mount) + ":", owner])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def publish(self, mount: str, message: dict[str, Any]) -> None:
        try:
            await self.r.publish(self.channel(mount), json.dumps({**message, "from": self.replica_id}))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def listen(self, mount: str, deliver: Callable[[dict[str, Any]], Awaitable[None]], *,
                     task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hand every other replica's message on this mount's channel to ``deliver``, until
        cancelled; a lost subscription is made again (what was published meanwhile is lost, as a
        notification to a client with no stream is)."""
        started = False
        while True:
            try:
                async with self._listener.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel(mount))
                    if not started:
                        started = True
                        task_status.started()
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        try:
                            data = json.loads(message["data"])
                        except (ValueError, TypeError):
                            continue
                        if isinstance(data, dict) and data.get("from") != self.replica_id:
                            await deliver(data)
            except (RedisError, OSError) as e:
                log.warning("MCP session channel lost (%s); subscribing again", e)
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(1.0)
