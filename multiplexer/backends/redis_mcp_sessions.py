"""Handshake-era MCP sessions kept in Redis, so any replica serves any ``Mcp-Session-Id``.

One hash per session (``mx:mcp:<mount>:s:<session id>``: its negotiated revision, the client's
``initialize`` params, who opened it, its path, its log level), expiring ``server.mcp.session_idle_s``
after the last touch by any replica. One pub/sub channel per MCP mount carries what a replica
cannot deliver itself: a server-to-client message for a client whose GET stream another replica
holds, a client's answer (or cancel) for a request another replica is waiting on, and a session's
end. Any Redis error becomes ``StateUnavailable``: the face then serves the session where it is
(sticky, as without Redis) and counts the degraded decision.
"""

from __future__ import annotations

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

    def _key(self, mount: str, session_id: str) -> str:
        return f"{self.prefix}:mcp:{self._tag(mount)}:s:{session_id}"

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
                pipe.pexpire(key, _ms(ttl_s))
                found, _ = await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e
        if not found:
            return None
        return {_text(k): _text(v) for k, v in found.items()}

    async def touch(self, mount: str, session_id: str, ttl_s: float) -> bool:
        """Start the session's idle time again; False if it is gone (ended or expired)."""
        try:
            return bool(await self.r.pexpire(self._key(mount, session_id), _ms(ttl_s)))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def set_field(self, mount: str, session_id: str, field: str, value: str,
                        ttl_s: float) -> bool:
        try:
            return bool(await self._set(keys=[self._key(mount, session_id)],
                                        args=[field, value, _ms(ttl_s)]))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"{type(e).__name__}: {e}") from e

    async def delete(self, mount: str, session_id: str) -> None:
        try:
            await self.r.delete(self._key(mount, session_id))
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
