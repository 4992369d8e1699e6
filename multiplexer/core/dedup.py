"""Sharing identical calls: an in-flight table and an optional TTL result cache.

Only routes whose policy says so (or whose provider knows the call is
deterministic) come here. Keys carry the caller's identity unless the route is
explicitly global, so one client's private result never reaches another.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from multiplexer.core.batching import Pending
from multiplexer.core.call import Outcome
from multiplexer.core.clock import Clock

log = logging.getLogger(__name__)
Progress = Callable[[float, float | None, str | None], Awaitable[None]]


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def canonical(params: Any) -> str:
    data = _CANONICAL.encode(params)  # one encoder: json.dumps with options builds one per call
    # surrogatepass: a lone surrogate (valid JSON as "\ud800") must hash, not raise
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class TtlCache:
    """A size-bounded LRU of successful outcomes that expire after their TTL."""

    def __init__(self, clock: Clock, max_entries: int) -> None:
        self.clock = clock
        self.max_entries = max_entries
        self._data: OrderedDict[Hashable, tuple[float, Outcome]] = OrderedDict()

    def get(self, key: Hashable) -> Outcome | None:
        hit = self._data.get(key)
        if hit is None:
            return None
        expires, outcome = hit
        if expires <= self.clock.now():
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return outcome

    def put(self, key: Hashable, outcome: Outcome, ttl: float) -> None:
        if self.max_entries <= 0 or ttl <= 0:
            return
        self._data[key] = (self.clock.now() + ttl, outcome)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        """Every answer dropped (``DELETE /admin/cache``)."""
        self._data.clear()


class InFlight:
    """Executions currently running, by dedup key."""

    def __init__(self) -> None:
        self._table: dict[Hashable, Pending] = {}

    def join(self, key: Hashable) -> Pending | None:
        p = self._table.get(key)
        if p is None or p.future.done():
            return None
        p.waiters += 1
        return p

    def register(self, key: Hashable, p: Pending) -> None:
        self._table[key] = p

    def release(self, key: Hashable, p: Pending) -> None:
        if self._table.get(key) is p and (p.future.done() or p.waiters <= 0):
            del self._table[key]

    def __len__(self) -> int:
        return len(self._table)


class ProgressFanout:
    """The progress of one shared execution, sent to every caller that asked for it.

    A call that joins an identical one in flight adds its sink; a caller that goes
    away is removed; a sink that fails (its client left) is dropped and the rest go on.
    """

    __slots__ = ("sinks",)

    def __init__(self) -> None:
        self.sinks: list[Progress] = []

    def add(self, sink: Progress) -> None:
        self.sinks.append(sink)

    def remove(self, sink: Progress) -> None:
        with contextlib.suppress(ValueError):
            self.sinks.remove(sink)

    async def __call__(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        for sink in list(self.sinks):
            try:
                await sink(progress, total, message)
            except Exception as e:
                log.debug("progress sink dropped: %r", e)
                self.remove(sink)
