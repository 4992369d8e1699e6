"""Budget counters kept in the job store's database, for gateways without ``state.url``.

``WriteBehindCounters``: one process decides in memory with no await, as ``LocalCounters`` does,
and every settlement batch (``budgets.SETTLE_EVERY_S``) adds what changed to the store with
``spent = spent + delta``; the store's counts come back and replace the memory's, so a restart
starts from them (read once, before the first decision) and another process that adds to the same
rows is seen within a batch.

``StoreCounters``: gateways that share the store as workers (``serve --workers N``, or replicas on
one PostgreSQL store) decide on one count, each reservation one transaction in the store (on a
thread), so the cap is passed by at most the reservations admitted while it had room.

``seed_from_spend``: with Redis, a counter Redis does not have is set from the spend the store
recorded for its period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import anyio

from multiplexer.core.state import StateUnavailable
from multiplexer.money.budget_store import PRUNE_STEP, BudgetStore, PgBudgetStore
from multiplexer.money.budgets import Counter, LocalCounters, expires_at, period_days
from multiplexer.money.spend_store import SpendStore

log = logging.getLogger(__name__)
_KEY, _FIRST = attrgetter("key"), itemgetter(0)


def budget_store_for(path: Any, url: str | None, schema: str) -> Callable[[], BudgetStore]:
    """How to open the counters' table in the job store's database (blocking: on a thread)."""
    if url:
        return lambda: PgBudgetStore(url, schema)
    return lambda: BudgetStore(path)


class _Opened:
    """The store, opened on a thread the first time it is needed."""

    def __init__(self, open_store: Callable[[], BudgetStore], wall: Callable[[], float]) -> None:
        self._open = open_store
        self._wall = wall
        self.store: BudgetStore | None = None
        self._opening = anyio.Lock()

    async def opened(self) -> BudgetStore:
        if self.store is None:
            async with self._opening:
                if self.store is None:
                    self.store = await anyio.to_thread.run_sync(self._open)
        return self.store

    async def prune(self) -> None:
        """Delete the counters of ended periods a step at a time (short transactions); nothing
        where no call has needed the store yet (a gateway without budgets)."""
        store = self.store
        if store is None:
            return
        while await anyio.to_thread.run_sync(store.prune, self._wall()) >= PRUNE_STEP:
            pass

    async def aclose(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            await anyio.to_thread.run_sync(store.close)


class WriteBehindCounters(LocalCounters):
    """``LocalCounters`` whose counts the store keeps: read before the first decision, written behind."""

    def __init__(self, wall: Callable[[], float], open_store: Callable[[], BudgetStore]) -> None:
        super().__init__(wall)
        self.loaded = False
        self.touched = []
        self.base: dict[str, int] = {}  # each counter's count in the store as last read
        self._store = _Opened(open_store, wall)
        self._writing = anyio.Lock()

    async def reserve(self, counters: Sequence[Counter], amount: int) -> tuple[int, int, list[int]]:
        if not self.loaded:
            await self.start()
        return self.reserve_now(counters, amount)

    def forget(self, keys: Sequence[str]) -> None:
        super().forget(keys)
        for key in keys:
            self.base.pop(key, None)

    def dirty(self) -> set[str]:
        """The counters changed since the last write, from what was noted as it happened."""
        lists = {id(cs): cs for cs in self.touched or ()}.values()  # most callers' lists recur
        out = set(map(_KEY, chain.from_iterable(lists)))
        out.update(map(_FIRST, chain.from_iterable(self.settled)))
        return out

    async def start(self) -> None:
        """Every counter of a current period from the store, added to what this process counted
        meanwhile (nothing, unless a call was decided before the read ended)."""
        async with self._writing:
            if self.loaded:
                return
            try:
                store = await self._store.opened()
                rows = await anyio.to_thread.run_sync(store.load, self.wall())
            except Exception:
                log.exception("budget counters could not be read from the store; counting from zero")
                rows = []
            for key, spent, alerted, expires in rows:
                self.spent[key] = spent + self.spent.get(key, 0) - self.base.get(key, 0)
                self.base[key] = spent
                if expires is not None:
                    self.expires[key] = expires
                if alerted:
                    self.alerted.add(key)
            self.loaded = True

    async def write(self) -> None:
        """Add each changed counter's delta to the store, then take the store's count (this
        process's delta and any other's) plus what changed here while the write ran."""
        async with self._writing:
            keys = self.dirty()
            if not keys:
                return
            self.touched, self.settled = [], []
            sent = {k: self.spent[k] for k in keys if k in self.spent}
            changes = [(k, v - self.base.get(k, 0), int(k in self.alerted), self.expires.get(k))
                       for k, v in sent.items()]
            with anyio.CancelScope(shield=True):  # once added, the base must move with it
                try:
                    store = await self._store.opened()
                    counts = await anyio.to_thread.run_sync(store.add, changes)
                except Exception:
                    self.settled.append([(k, 0) for k in keys])  # sent again with the next batch
                    log.exception("budget counts could not be written; they are sent with the next batch")
                    return
            for key, (count, alerted) in counts.items():
                now = self.spent.get(key)
                if now is not None:
                    self.spent[key] = count + now - sent[key]
                    self.base[key] = count
                    if alerted:
                        self.alerted.add(key)

    async def prune(self) -> None:
        await self._store.prune()

    async def aclose(self) -> None:
        await self.write()
        await self._store.aclose()


class StoreCounters:
    """``money.budgets.Counters`` decided in the store: one transaction per reservation."""

    def __init__(self, wall: Callable[[], float], open_store: Callable[[], BudgetStore]) -> None:
        self._store = _Opened(open_store, wall)

    async def reserve(self, counters: Sequence[Counter], amount: int) -> tuple[int, int, list[int]]:
        asks = [(c.key, c.limit, c.alert, expires_at(c)) for c in counters]
        try:
            store = await self._store.opened()
            # once sent it is kept: a caller that left meanwhile is given back its reservation
            with anyio.CancelScope(shield=True):
                answer = await anyio.to_thread.run_sync(store.reserve, asks, amount)
        except Exception as e:
            raise StateUnavailable(f"budget store: {type(e).__name__}: {e}") from e
        return answer

    async def settle(self, changes: Sequence[tuple[str, int]]) -> None:
        store = await self._store.opened()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(store.settle, changes)

    async def prune(self) -> None:
        await self._store.prune()

    async def aclose(self) -> None:
        await self._store.aclose()


def seed_from_spend(open_store: Callable[[], SpendStore]) -> Callable[[Sequence[Counter]], Any]:
    """Redis's seed: each counter's spend as the store recorded it for its period (the calls
    written, at most ``spend.flush_interval_s`` behind; reservations in flight are not in it)."""

    async def seed(counters: Sequence[Counter]) -> list[int]:
        def read() -> list[int]:
            store = open_store()
            return [store.recorded(c.scope, c.name, *period_days(c)) for c in counters]

        try:
            return await anyio.to_thread.run_sync(read)
        except Exception as e:
            raise StateUnavailable(f"spend store: {type(e).__name__}: {e}") from e

    return seed
