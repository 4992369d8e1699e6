"""Idempotency keys (``_meta.idempotency_key``): a caller's own, and bound to the params they were
first sent with.

A call with an idempotency key shares one execution with the caller's earlier call under the
same key, route and method, whatever the route's ``dedup_scope`` says: the key is the caller's
word for "this call again", never another caller's (two keys both sending "1" are two calls). Its
dedup key carries a digest of the params, so a reuse of the key with other params never reads the
first call's answer; while that first call may still be in flight or its answer cached, such a
reuse is refused with -32602 naming the key, as Stripe-style servers do (the client has a bug:
its retry is not the call it made).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from multiplexer.core.clock import Clock
from multiplexer.core.errors import invalid_params

MAX_KEYS = 100_000  # remembered at most (the oldest go first): in flight and cached calls are fewer


class IdempotencyKey(NamedTuple):
    """The dedup key of a call with an idempotency key."""

    route: str
    method: str
    identity: str | None  # always the caller's (None: a gateway without keys)
    key: str
    digest: str  # of the params: the same key with other params is another dedup key

    @property
    def use(self) -> tuple[str, str, str | None, str]:
        """The key as the caller uses it, whatever the params."""
        return self.route, self.method, self.identity, self.key


class IdempotencyKeys:
    """The params digest each idempotency key was first used with, until its call's deadline
    plus its route's cache TTL have passed (by then it is neither in flight nor cached)."""

    def __init__(self, clock: Clock, max_keys: int = MAX_KEYS) -> None:
        self.clock = clock
        self.max_keys = max_keys
        self._seen: OrderedDict[tuple[str, str, str | None, str], tuple[str, float]] = OrderedDict()

    def check(self, key: IdempotencyKey, until: float) -> None:
        """Note ``key`` as used until ``until``; raise -32602 when it was used with other params
        and that use has not run out."""
        now = self.clock.now()
        seen = self._seen.get(key.use)
        if seen is not None and seen[1] > now:
            if seen[0] != key.digest:
                raise invalid_params(
                    f"idempotency key {key.key!r} was already used with other params; retry with "
                    "the same params, or use a new key for a new call",
                    param="_meta.idempotency_key", idempotency_key=key.key)
            until = max(until, seen[1])
        self._seen[key.use] = (key.digest, until)
        self._seen.move_to_end(key.use)
        while self._seen:
            oldest = next(iter(self._seen.values()))
            if oldest[1] > now and len(self._seen) <= self.max_keys:
                break
            self._seen.popitem(last=False)
