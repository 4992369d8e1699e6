"""Spend and savings by day, key, team, route and model, in the job store's database.

One row per (day, key, team, route, model) holds running sums: calls, cost, what was saved
(and by what), calls of unknown cost, input tokens and the prompt-cache reads among them, what
prompt-cache writes cost beyond plain input, and the cache moves with what they cost at most. The
writer adds a batch of such sums at a time, so the database sees one statement per group and
flush, never one per call. SQLite (``store.path``)
for one gateway, PostgreSQL (``store.url``, schema ``store.schema``) shared by replicas.
Amounts are integer nano-dollars; ``requests_saved`` counts thousandths of upstream requests.
A table made before the token columns gets them on open (0 for the rows it had).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multiplexer.jobs.sqlite_connect import connect as connect_sqlite

GROUPS = ("key", "team", "route", "model", "day")
SUMS = ("calls", "cost", "saved", "unknown_calls", "saved_batch", "saved_dedup", "saved_cache",
        "saved_prompt_cache", "requests_saved", "input_tokens", "cache_read_tokens",
        "cache_writes", "cache_moves", "cache_move_cost", "saved_semantic_cache")
# columns a table made by an earlier version lacks
ADDED = ("input_tokens", "cache_read_tokens", "cache_writes", "cache_moves", "cache_move_cost",
         "saved_semantic_cache")
COLUMNS = ("day", "key", "team", "route", "model", *SUMS)
# key and team are '' for keyless callers and keys without a team (a primary key has no NULLs)
TABLE = """CREATE TABLE IF NOT EXISTS {t} (
  day TEXT NOT NULL, key TEXT NOT NULL, team TEXT NOT NULL, route TEXT NOT NULL, model TEXT NOT NULL,
  calls BIGINT NOT NULL, cost BIGINT NOT NULL, saved BIGINT NOT NULL, unknown_calls BIGINT NOT NULL,
  saved_batch BIGINT NOT NULL, saved_dedup BIGINT NOT NULL, saved_cache BIGINT NOT NULL,
  saved_prompt_cache BIGINT NOT NULL, requests_saved BIGINT NOT NULL,
  input_tokens BIGINT NOT NULL DEFAULT 0, cache_read_tokens BIGINT NOT NULL DEFAULT 0,
  cache_writes BIGINT NOT NULL DEFAULT 0, cache_moves BIGINT NOT NULL DEFAULT 0,
  cache_move_cost BIGINT NOT NULL DEFAULT 0, saved_semantic_cache BIGINT NOT NULL DEFAULT 0,
  PRIMARY KEY (day, key, team, route, model))"""

Row = tuple[Any, ...]  # COLUMNS in order


def _upsert(table: str, mark: str) -> str:
    cols = ", ".join(COLUMNS)
    marks = ", ".join([mark] * len(COLUMNS))
    adds = ", ".join(f"{c} = s.{c} + excluded.{c}" for c in SUMS)
    return (f"INSERT INTO {table} AS s ({cols}) VALUES ({marks}) "
            f"ON CONFLICT (day, key, team, route, model) DO UPDATE SET {adds}")


def _query(table: str, group_by: Sequence[str], mark: str, one_key: bool) -> str:
    groups = ", ".join(group_by)
    sums = ", ".join(f"SUM({c})" for c in SUMS)
    head = (f"SELECT {groups + ', ' if groups else ''}{sums} FROM {table} "
            f"WHERE day >= {mark} AND day <= {mark}" + (f" AND key = {mark}" if one_key else ""))
    return head + (f" GROUP BY {groups} ORDER BY {groups}" if groups else "")


class SpendStore:
    """The SQLite spend table (its own connection to the job store's file)."""

    mark = "?"

    def __init__(self, path: str | Path) -> None:
        self.table = "spend"
        self._lock = threading.Lock()
        self.conn: Any = connect_sqlite(path)
        self.conn.execute(TABLE.format(t=self.table))
        for column in ADDED:
            self._add_column(column)

    def _add_column(self, column: str) -> None:
        """``column`` added to a table made without it (another worker may be adding it too)."""
        if column in {r[1] for r in self.conn.execute(f"PRAGMA table_info({self.table})")}:
            return
        try:
            self.conn.execute(f"ALTER TABLE {self.table} ADD COLUMN {column} BIGINT NOT NULL DEFAULT 0")
        except sqlite3.OperationalError as e:
            if "duplicate column" not in str(e):
                raise

    def add(self, rows: Sequence[Row]) -> None:
        with self._lock:
            self.conn.execute("BEGIN")
            try:
                self.conn.executemany(_upsert(self.table, self.mark), rows)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def query(self, group_by: Sequence[str], since: str, until: str, key: str | None = None) -> list[Row]:
        """Sums by ``group_by`` over days ``since``..``until`` (both included); ``key``: that key's
        rows only (a caller's own view), else every key's."""
        assert all(g in GROUPS for g in group_by)
        args = (since, until) if key is None else (since, until, key)
        with self._lock:
            return list(self.conn.execute(_query(self.table, group_by, self.mark, key is not None), args))

    def recorded(self, scope: str, name: str, since: str, until: str) -> int:
        """Nano-dollars a key (``scope`` "key") or a team spent over days ``since``..``until``."""
        column = "key" if scope == "key" else "team"
        m = self.mark
        with self._lock:
            row = self.conn.execute(f"SELECT COALESCE(SUM(cost), 0) FROM {self.table} "
                                    f"WHERE day >= {m} AND day <= {m} AND {column} = {m}",
                                    (since, until, name)).fetchone()
        return int(row[0])

    def prune(self, before_day: str) -> None:
        with self._lock:
            self.conn.execute(f"DELETE FROM {self.table} WHERE day < {self.mark}", (before_day,))

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class PgSpendStore(SpendStore):
    """The same table in PostgreSQL, in the job store's schema: every replica adds to it."""

    mark = "%s"

    def __init__(self, url: str, schema: str) -> None:
        from multiplexer.jobs.pg_connect import connect

        self.table = f"{schema}.spend"
        self._lock = threading.Lock()
        self.conn: Any = connect(url)
        with self.conn.transaction():  # two replicas starting at once: one creates the table
            self.conn.execute("SELECT pg_advisory_xact_lock(7341)")
            self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            self.conn.execute(TABLE.format(t=self.table))
            for column in ADDED:
                self.conn.execute(f"ALTER TABLE {self.table} ADD COLUMN IF NOT EXISTS {column} "
                                  "BIGINT NOT NULL DEFAULT 0")

    def add(self, rows: Sequence[Row]) -> None:
        with self._lock, self.conn.transaction(), self.conn.cursor() as cur:
            # one order for every replica's batch: two batches never wait on each other's rows
            cur.executemany(_upsert(self.table, self.mark), sorted(rows, key=lambda r: r[:5]))
