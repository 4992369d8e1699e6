"""Gemini's batch limits as flushing limits: tokens enqueued per model, and batch jobs at once.

The Batch API counts the input tokens of every unfinished batch against a per-model limit of
the account's tier, and runs at most 100 batch jobs per key; a create beyond either is refused
with 429 ``RESOURCE_EXHAUSTED``. So a part waits here before it is created until what is still
running leaves room for it. A part larger than the limit on its own goes once nothing else of
its model runs (the vendor then says whether it fits).

Each remote batch's estimate rides in its display name, so after a restart the running batches
are counted again as soon as they are polled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.errors import cancelled


@dataclass(slots=True)
class Held:
    model: str
    tokens: int


class Enqueued:
    def __init__(self, limits: dict[str, int], max_jobs: int, clock: Clock, recheck_s: float) -> None:
        self.limits = limits
        self.max_jobs = max_jobs
        self.clock = clock
        self.recheck_s = recheck_s  # a batch may end unseen (another replica polls it): look again
        self.running: dict[str, Held] = {}  # remote id (or a reservation's key) -> what it holds
        self._changed = anyio.Event()
        self._n = 0

    def limit(self, model: str) -> int | None:
        return self.limits.get(model, self.limits.get("*"))

    def held(self, model: str) -> int:
        return sum(h.tokens for h in self.running.values() if h.model == model)

    def fits(self, model: str, tokens: int) -> bool:
        if len(self.running) >= self.max_jobs:
            return False
        limit = self.limit(model)
        held = self.held(model)
        return limit is None or held == 0 or held + tokens <= limit

    async def reserve(self, model: str, tokens: int,
                      stopped: Callable[[], Awaitable[bool]] | None = None) -> str:
        """Wait until the part fits; its reservation's key (``bind`` it to the remote id). A part
        whose job was cancelled meanwhile (``stopped``) stops waiting with a cancelled error."""
        while not self.fits(model, tokens):
            if self._changed.is_set():
                self._changed = anyio.Event()
            await self.clock.wait_event(self._changed, self.clock.now() + self.recheck_s)
            if stopped is not None and await stopped():
                raise cancelled("batch job cancelled")
        self._n += 1
        key = f"reserved-{self._n}"
        self.running[key] = Held(model, tokens)
        return key

    def bind(self, key: str, remote_id: str) -> None:
        held = self.running.pop(key, None)
        if held is not None:
            self.running[remote_id] = held

    def learn(self, remote_id: str, model: str, tokens: int) -> None:
        """A running batch this process did not create (a restart, another replica's)."""
        self.running.setdefault(remote_id, Held(model, tokens))

    def release(self, key: str) -> None:
        if self.running.pop(key, None) is not None:
            self._changed.set()
