"""Budget counters in the job store's database, for gateways without ``state.url``.

One row per cap and period (``key:alice:daily:2026-12-03``, ``team:research:total:all``): the
nano-dollars it holds (reservations in flight plus what answered calls cost), whether its alert
fired, and when it may go (a day after its period ends; never for ``total``). SQLite at
``store.path`` or PostgreSQL at ``store.url``, next to the spend table, each with its own
connection. Every method is blocking: callers run it on a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from multiplexer.jobs.sqlite_connect import connect as connect_sqlite

TABLE = """CREATE TABLE IF NOT EXISTS {t} (
  key TEXT PRIMARY KEY, spent BIGINT NOT NULL, alerted SMALLINT NOT NULL, expires DOUBLE PRECISION)"""
PRUNE_STEP = 500  # expired rows deleted per statement: no write waits long behind a prune

Ask = tuple[str, int, int, float | None]  # (counter key, limit, alert (0: none), expires (None: kept))
Change = tuple[str, int, int, float | None]  # (counter key, delta, alerted 0/1, expires)
T = TypeVar("T")


class BudgetStore:
    """The SQLite table (its own connection to the job store's file)."""

    mark = "?"

    def __init__(self, path: str | Path) -> None:
        self.table = "budget_counters"
        self._lock = threading.Lock()
        self.conn: Any = connect_sqlite(path)
        self._create()

    def _create(self) -> None:
        self.conn.execute(TABLE.format(t=self.table))
        self.conn.execute(f"CREATE INDEX IF NOT EXISTS budget_counters_expires ON {self.table} (expires)")

    def _greatest(self, a: str, b: str) -> str:
        return f"MAX({a}, {b})"

    def _transaction(self, work: Callable[[Any], T]) -> T:
        """``work`` in a write transaction that holds the file's write lock from its first
        statement: a read-check-write by another process on the file waits, never interleaves."""
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                out = work(self.conn)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")
            return out

    def load(self, now: float) -> list[tuple[str, int, int, float | None]]:
        """Every counter whose period has not ended: (key, spent, alerted, expires)."""
        m = self.mark
        with self._lock:
            rows = self.conn.execute(f"SELECT key, spent, alerted, expires FROM {self.table} "
                                     f"WHERE expires IS NULL OR expires > {m}", (now,)).fetchall()
        return [(str(k), int(s), int(a), e) for k, s, a, e in rows]

    def add(self, changes: Sequence[Change]) -> dict[str, tuple[int, int]]:
        """Add each delta (made if missing), keep each alert flag set; each (count, alerted)
        after, which hold what other processes on this database added too."""
        m, t = self.mark, self.table
        sql = (f"INSERT INTO {t} AS c (key, spent, alerted, expires) VALUES ({m}, {m}, {m}, {m}) "
               f"ON CONFLICT (key) DO UPDATE SET spent = c.spent + excluded.spent, "
               f"alerted = {self._greatest('c.alerted', 'excluded.alerted')} RETURNING spent, alerted")

        def work(conn: Any) -> dict[str, tuple[int, int]]:
            out = {}
            for c in sorted(changes):  # one order for every writer: no two wait on each other
                spent, alerted = conn.execute(sql, c).fetchone()
                out[c[0]] = (int(spent), int(alerted))
            return out

        return self._transaction(work) if changes else {}

    def reserve(self, asks: Sequence[Ask], amount: int) -> tuple[int, int, list[int]]:
        """``money.budgets.Counters.reserve`` in one transaction: refused (1-based index, its
        spend) while any counter has reached its limit, else ``amount`` added to every one and
        the indexes whose alert fired now (once per period)."""
        m, t = self.mark, self.table

        def work(conn: Any) -> tuple[int, int, list[int]]:
            for key, _, _, expires in sorted(asks):  # rows locked in one order by every process
                conn.execute(f"INSERT INTO {t} (key, spent, alerted, expires) VALUES ({m}, 0, 0, {m}) "
                             f"ON CONFLICT (key) DO NOTHING", (key, expires))
            held = {r[0]: (int(r[1]), int(r[2])) for r in conn.execute(self._held(len(asks)),
                                                                        [a[0] for a in asks])}
            for i, (key, limit, _, _) in enumerate(asks):
                if held[key][0] >= limit:
                    return i + 1, held[key][0], []
            alerts = []
            for i, (key, _, alert, _) in enumerate(asks):
                spent, alerted = held[key]
                fired = bool(alert) and not alerted and spent + amount >= alert
                if fired:
                    alerts.append(i)
                conn.execute(f"UPDATE {t} SET spent = spent + {m}, alerted = {m} WHERE key = {m}",
                             (amount, int(alerted or fired), key))
            return 0, 0, alerts

        return self._transaction(work)

    def _held(self, n: int) -> str:
        return f"SELECT key, spent, alerted FROM {self.table} WHERE key IN ({', '.join([self.mark] * n)})"

    def settle(self, changes: Sequence[tuple[str, int]]) -> None:
        """Add each (key, delta) to counters that still exist (a period that ended is gone)."""
        sql = f"UPDATE {self.table} SET spent = spent + {self.mark} WHERE key = {self.mark}"

        def work(conn: Any) -> None:
            for key, delta in sorted(changes):
                conn.execute(sql, (delta, key))

        if changes:
            self._transaction(work)

    def prune(self, now: float, step: int = PRUNE_STEP) -> int:
        """Delete up to ``step`` counters whose period ended over a day ago; how many went."""
        m, t = self.mark, self.table
        with self._lock:
            return int(self.conn.execute(
                f"DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires < {m} LIMIT {m})",
                (now, step)).rowcount)

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class PgBudgetStore(BudgetStore):
    """The same table in PostgreSQL, in the job store's schema: shared by every gateway on it."""

    mark = "%s"

    def __init__(self, url: str, schema: str) -> None:
        from multiplexer.jobs.pg_connect import connect

        self.table = f"{schema}.budget_counters"
        self._lock = threading.Lock()
        self.conn = connect(url)
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(7341)")  # one gateway creates the table
            self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            self._create()

    def _transaction(self, work: Callable[[Any], T]) -> T:
        with self._lock, self.conn.transaction():
            return work(self.conn)

    def _greatest(self, a: str, b: str) -> str:
        return f"GREATEST({a}, {b})"

    def _held(self, n: int) -> str:  # the rows stay locked until the transaction ends
        return super()._held(n) + " ORDER BY key FOR UPDATE"
