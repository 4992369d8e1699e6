"""The keys' daily batch allowance (``batch_calls_per_day``) decided for all the workers of
``serve --workers N`` at once, in a SQLite file they share; their other quotas stay split.

Without shared state each worker enforces its part of a key's rpm, tpm and concurrency (limit /
N: connections spread evenly, so the parts add up to the limit). A day's batch allowance does
not split that way: one ``jobs.submit`` may carry the whole of it, and whichever worker gets it
must see the whole allowance, and a refusal must say what truly is left. So that one counter is
kept in the job store's SQLite file (``store.path``), which every worker opens, a row per key and
UTC day, charged all or none in one write transaction; the file's write lock orders the workers.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from multiplexer.core.clock import Clock
from multiplexer.core.errors import rate_limited
from multiplexer.core.policy import Quota
from multiplexer.core.quota import FREE, Claim, Grant, Quotas

TABLE = """CREATE TABLE IF NOT EXISTS batch_allowance (
  identity TEXT NOT NULL, day INTEGER NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (identity, day))"""

Ask = tuple[str, int, int]  # (identity, calls, allowed)


class DayCounts:
    """The table, on its own connection to the file, opened at its first use (a gateway whose
    keys never submit a batch makes no file). Blocking: callers run it on a thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False,
                                   isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(TABLE)
            self._conn = conn
        return self._conn

    def change(self, day: int, asks: Sequence[Ask], refunds: Sequence[tuple[str, int, int]]) -> list[int]:
        """Give back ``refunds`` (identity, day, calls), then charge each ask for UTC ``day`` all
        or none, in order, in one transaction: -1 for an ask charged, else the calls it had left."""
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")  # the write lock first: no other worker reads between
            try:
                for identity, on, calls in refunds:
                    db.execute("UPDATE batch_allowance SET used = MAX(0, used - ?) "
                               "WHERE identity = ? AND day = ?", (calls, identity, on))
                out = [self._charge(db, day, ask) for ask in asks]
                if asks:
                    db.execute("DELETE FROM batch_allowance WHERE day < ?", (day - 1,))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return out

    @staticmethod
    def _charge(db: sqlite3.Connection, day: int, ask: Ask) -> int:
        identity, calls, allowed = ask
        row = db.execute("SELECT used FROM batch_allowance WHERE identity = ? AND day = ?",
                         (identity, day)).fetchone()
        used = 0 if row is None else int(row[0])
        if used + calls > allowed:
            return max(0, allowed - used)
        db.execute("INSERT INTO batch_allowance VALUES (?, ?, ?) ON CONFLICT (identity, day) "
                   "DO UPDATE SET used = used + excluded.used", (identity, day, calls))
        return -1

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class WorkerQuotas(Quotas):
    """One worker's quotas: its part of each key's rpm, tpm and concurrency (``part``, which
    leaves ``batch_calls_per_day`` whole), and the whole daily batch allowance in ``counts``."""

    def __init__(self, clock: Clock, quotas: dict[str, Quota], part: Callable[[Quota], Quota],
                 counts: DayCounts) -> None:
        super().__init__(clock, quotas, part)
        self.counts = counts
        self._refunds: list[tuple[str, int, int]] = []  # (identity, UTC day, calls) to give back

    def _in_file(self, claim: Claim | None) -> Ask | None:
        """(identity, calls, allowed) of a claim whose batch calls the file decides."""
        if claim is None or claim.batch_calls <= 0 or claim.identity is None:
            return None
        quota = self.limits(claim.identity)
        if quota is None or quota.batch_calls_per_day is None:
            return None
        return claim.identity, claim.batch_calls, quota.batch_calls_per_day

    async def decide(self, claims: Sequence[Claim | None]) -> list[Grant]:
        """Each claim's grant, in order, all or none: its batch calls charged in the file first
        (one thread hop for the array, with the refunds queued since the last one), then the
        rest here; a claim refused here gives its batch charge back before the answer."""
        asks = {i: ask for i, c in enumerate(claims) if (ask := self._in_file(c)) is not None}
        if not asks:
            return await super().decide(claims)
        wall = self.clock.wall()
        day = int(wall // 86_400)
        lefts = dict(zip(asks, await self._change(day, list(asks.values())), strict=True))
        grants: list[Grant] = []
        for i, claim in enumerate(claims):
            if claim is None:
                grants.append(FREE)
                continue
            left = lefts.get(i, -1)
            if left >= 0:  # refused by the file: nothing is taken here either
                grants.append(Grant(claim.identity, refusal=rate_limited(
                    "batch_calls_per_day", (day + 1) * 86_400 - wall, identity=claim.identity,
                    allowed=asks[i][2], remaining=left)))
                continue
            grant = self.decide_here(claim)  # its batch calls left out (``_batch_room``)
            if i in asks:
                if grant.refusal is None:
                    grant.batch = (day, claim.batch_calls, True)
                else:  # refused here (rpm, concurrency): its batch charge goes back
                    self._refunds.append((asks[i][0], day, claim.batch_calls))
            grants.append(grant)
        await self.flush()
        return grants

    def _batch_room(self, identity: str, quota: Quota, calls: int) -> tuple[int, int] | None:
        if quota.batch_calls_per_day is not None and calls > 0:
            return None  # decided in the file (``decide``)
        return super()._batch_room(identity, quota, calls)

    def refund(self, grant: Grant) -> None:
        if not self.refund_elsewhere(grant, self._refunds):
            super().refund(grant)

    async def flush(self) -> None:
        """Give back the batch charges of calls that never ran (the gateway awaits this before
        it answers)."""
        if self._refunds:
            await self._change(0, [])

    async def _change(self, day: int, asks: list[Ask]) -> list[int]:
        refunds, self._refunds = self._refunds, []
        try:
            with anyio.CancelScope(shield=True):  # a charge made must reach its grant, or go back
                lefts = await anyio.to_thread.run_sync(self.counts.change, day, asks, refunds)
        except Exception:  # rolled back: the refunds are still owed
            self._refunds[:0] = refunds
            raise
        return lefts
