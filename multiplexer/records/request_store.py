"""The request log's table, in the job store's database: SQLite (``store.path``) for one gateway,
PostgreSQL (``store.url``, schema ``store.schema``) shared by replicas.

One row per call, newest first by ``(at, id)``: that pair is the listing's order and its cursor,
and each filter the listing takes (key, team, route, model, status) has an index led by it and
ending in ``(at, id)``, so a page is an index range read whatever the table's size. Rows are
added a batch at a time (PostgreSQL: ``COPY``) and pruned in small steps (``prune``) by age and
by count, so no statement holds the table for long.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from multiplexer.jobs.sqlite_connect import connect as connect_sqlite

# a row as the writer adds it (``id`` is the database's)
COLUMNS = ("at", "request_id", "key", "team", "face", "method", "route", "model_asked", "model",
           "status", "code", "error", "attempts", "fallbacks", "batch_id", "mode", "shared",
           "input_tokens", "output_tokens", "cached_tokens", "cost", "saved", "latency_ms",
           "first_chunk_ms", "path", "request_body", "response_body")
LISTED = ("id", *COLUMNS[:24])  # what a listing returns (not the path, not the bodies)
FILTERS = ("key", "team", "route", "model", "status")  # equality filters, each with its index
SPLIT = FILTERS[:4]  # those whose index has the status second
STATUSES = ("ok", "error")
STEP = 5000  # rows deleted per statement while pruning

_TYPES = {"at": "DOUBLE PRECISION NOT NULL", "code": "INTEGER", "attempts": "INTEGER NOT NULL",
          "fallbacks": "INTEGER NOT NULL", "input_tokens": "BIGINT", "output_tokens": "BIGINT",
          "cached_tokens": "BIGINT", "cost": "BIGINT", "saved": "BIGINT",
          "latency_ms": "DOUBLE PRECISION NOT NULL", "first_chunk_ms": "DOUBLE PRECISION",
          "status": "TEXT NOT NULL"}


def _table(table: str, id_column: str) -> str:
    columns = ",\n  ".join(f"{c} {_TYPES.get(c, 'TEXT')}" for c in COLUMNS)
    return f"CREATE TABLE IF NOT EXISTS {table} (\n  {id_column},\n  {columns})"


def _indexes(table: str, name: str) -> list[str]:
    out = [f"CREATE INDEX IF NOT EXISTS {name}_at ON {table} (at, id)",
           f"CREATE INDEX IF NOT EXISTS {name}_rid ON {table} (request_id)"]
    out.append(f"CREATE INDEX IF NOT EXISTS {name}_status ON {table} (status, at, id)")
    # each other filter with the status second: "team X's errors" is one range; without a status
    # a listing reads the two ranges (ok, error) newest first and merges them (``page``)
    out += [f"CREATE INDEX IF NOT EXISTS {name}_{c}_s ON {table} ({c}, status, at, id)" for c in SPLIT]
    return out


@dataclass(slots=True)
class Query:
    """A listing's filters (None: any), newest first, after ``cursor`` (an ``(at, id)``)."""

    key: str | None = None
    team: str | None = None
    route: str | None = None
    model: str | None = None
    status: str | None = None  # ok or error
    code: int | None = None
    request_id: str | None = None
    since: float | None = None
    until: float | None = None
    error: str | None = None  # text in the error message
    cursor: tuple[float, int] | None = None
    limit: int = 50


class RequestStore:
    """The SQLite table (its own connection to the job store's file)."""

    mark = "?"
    unlimited = "LIMIT -1"
    like = "LIKE"  # case-insensitive for ASCII in SQLite

    def __init__(self, path: str | Path) -> None:
        self.table = "requests"
        self._lock = threading.Lock()
        self.conn: Any = connect_sqlite(path)
        statements = [_table(self.table, "id INTEGER PRIMARY KEY AUTOINCREMENT"),
                      *_indexes(self.table, "requests")]
        self.conn.execute("BEGIN")  # one commit for the table and its indexes: a gateway starts sooner
        try:
            for statement in statements:
                self.conn.execute(statement)
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def add(self, rows: Sequence[Sequence[Any]]) -> None:
        marks = ", ".join([self.mark] * len(COLUMNS))
        with self._lock:
            self.conn.execute("BEGIN")
            try:
                self.conn.executemany(f"INSERT INTO {self.table} ({', '.join(COLUMNS)}) VALUES ({marks})",
                                      rows)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def _where(self, q: Query, text: bool = True) -> tuple[str, list[Any]]:
        m = self.mark
        parts: list[str] = []
        args: list[Any] = []
        for name in FILTERS:
            value = getattr(q, name)
            if value is not None:
                parts.append(f"{name} = {m}")
                args.append(value)
        for column, value, op in (("code", q.code, "="), ("request_id", q.request_id, "="),
                                  ("at", q.since, ">="), ("at", q.until, "<")):
            if value is not None:
                parts.append(f"{column} {op} {m}")
                args.append(value)
        if q.error and text:
            parts.append(f"error {self.like} {m}")
            args.append("%" + q.error.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
            parts[-1] += " ESCAPE '\\'"
        if q.cursor is not None:
            parts.append(f"(at, id) < ({m}, {m})")
            args += list(q.cursor)
        return (" WHERE " + " AND ".join(parts)) if parts else "", args

    def page(self, q: Query) -> list[tuple[Any, ...]]:
        """Rows (``LISTED``) matching ``q``, newest first, at most ``q.limit``."""
        order = f"ORDER BY at DESC, id DESC LIMIT {int(q.limit)}"
        cols = ", ".join(LISTED)
        split = any(getattr(q, f) is not None for f in SPLIT)
        if q.status is None and (q.code is not None or q.error):
            q = replace(q, status="error")  # only a failed call has a code or an error's text
        if q.error and split:
            # the text looked for in the rows of the narrowest filter's index, newest first, until
            # a page is found: a planner that guesses the text rare or common never scans the table
            inner, args = self._where(q, text=False)
            outer, more = self._where(Query(error=q.error))
            sql = (f"SELECT {cols} FROM (SELECT * FROM {self.table}{inner} "
                   f"ORDER BY at DESC, id DESC {self.unlimited} OFFSET 0) AS r{outer} {order}")
            args += more
        elif split and q.status is None:
            # a page of each status's range, merged: at most two pages read whatever the table
            sql, args = "", []
            for status in STATUSES:
                where, more = self._where(replace(q, status=status))
                sql += (" UNION ALL " if sql else "") + (
                    f"SELECT * FROM (SELECT {cols} FROM {self.table}{where} {order}) AS {status}_")
                args += more
            sql += f" {order}"
        else:
            where, args = self._where(q)
            sql = f"SELECT {cols} FROM {self.table}{where} {order}"
        with self._lock:
            return [tuple(r) for r in self.conn.execute(sql, args).fetchall()]

    def get(self, row_id: int) -> dict[str, Any] | None:
        """One row, every column."""
        with self._lock:
            cur = self.conn.execute(f"SELECT id, {', '.join(COLUMNS)} FROM {self.table} "
                                    f"WHERE id = {self.mark}", (row_id,))
            row = cur.fetchone()
        return None if row is None else dict(zip(("id", *COLUMNS), row, strict=True))

    def count(self) -> int:
        with self._lock:
            return int(self.conn.execute(f"SELECT COUNT(*) FROM {self.table}").fetchone()[0])

    def prune_step(self, before: float | None, max_rows: int | None) -> int:
        """Delete at most ``STEP`` rows older than ``before`` or beyond the newest ``max_rows``
        (by id: ids a failed insert skipped make it keep a few less); how many went."""
        m = self.mark
        with self._lock:
            floor = None
            if max_rows is not None:
                top = self.conn.execute(f"SELECT MAX(id) FROM {self.table}").fetchone()[0]
                if top is not None and top > max_rows:
                    floor = top - max_rows  # ids at or below it go
            conds, args = [], []
            if before is not None:
                conds.append(f"at < {m}")
                args.append(before)
            if floor is not None:
                conds.append(f"id <= {m}")
                args.append(floor)
            if not conds:
                return 0
            return self._delete(" OR ".join(conds), args)

    def _delete(self, cond: str, args: list[Any]) -> int:
        cur = self.conn.execute(f"DELETE FROM {self.table} WHERE id IN (SELECT id FROM {self.table} "
                                f"WHERE {cond} ORDER BY id LIMIT {STEP})", args)
        return int(cur.rowcount or 0)

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class PgRequestStore(RequestStore):
    """The same table in PostgreSQL, in the job store's schema: every replica writes to it."""

    mark = "%s"
    unlimited = "LIMIT ALL"
    like = "ILIKE"

    def __init__(self, url: str, schema: str) -> None:
        from multiplexer.jobs.pg_connect import connect

        self.table = f"{schema}.requests"
        self._lock = threading.Lock()
        self.conn: Any = connect(url)
        with self.conn.transaction():  # two replicas starting at once: one creates the table
            self.conn.execute("SELECT pg_advisory_xact_lock(7346)")  # its own: no other table waits
            self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            self.conn.execute(_table(self.table, "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"))
            for statement in _indexes(self.table, "requests"):
                self.conn.execute(statement)

    def add(self, rows: Sequence[Sequence[Any]]) -> None:
        with self._lock, self.conn.cursor() as cur, \
                cur.copy(f"COPY {self.table} ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
