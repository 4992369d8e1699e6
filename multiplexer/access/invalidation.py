"""Telling every replica that a key or team changed: Redis pub/sub on ``state.url``.

The message carries nothing secret (what changed and its id); each replica that hears it reloads
its snapshot from the store. A replica that misses a message (Redis down, reconnecting) still
reloads every ``key_store.ttl_s``; one that reconnects reloads at once, since it may have missed
some.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

log = logging.getLogger(__name__)


class Invalidation:
    def __init__(self, url: str, prefix: str, on_change: Callable[[], None]) -> None:
        import redis.asyncio as aioredis

        self.channel = f"{prefix}:access:changed"
        self.on_change = on_change
        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._listener = aioredis.Redis.from_url(url, socket_connect_timeout=2.0)
        self.subscribed = anyio.Event()

    async def publish(self, what: str) -> None:
        """Every replica (this one too) reloads; a failure is logged: their TTL reload still runs."""
        try:
            await self._redis.publish(self.channel, what)
        except Exception as e:
            log.warning("could not announce a key change through state.url (%s); replicas will "
                        "see it within key_store.ttl_s", e)

    async def listen_forever(self) -> None:
        while True:
            try:
                async with self._listener.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.on_change()  # (re)subscribed: whatever was missed is reloaded
                    self.subscribed.set()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.on_change()
            except Exception as e:
                log.warning("key invalidation channel lost (%s); retrying", e)
                await anyio.sleep(1.0)

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self._listener.aclose()
