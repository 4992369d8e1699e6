"""The request log's table, in the job store's database: SQLite (``store.path``) for one gateway,
PostgreSQL (``store.url``, schema ``store.schema``) shared by replicas.

One row per call, newest first by ``(at, id)``: that pair is the listing's order and its cursor,
and each filter the listing takes (key, team, route, model, status) has an index led by it and
ending in ``(at, id)``, so a page is an index range read whatever the table's size. Rows are
added a batch at a time (PostgreSQL: ``COPY``) and pruned in small steps (``prune``) by age and
by count, so no statement holds the table for long.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from multiplexer.jobs.sqlite_connect import connect as connect_sqlite

log = logging.getLogger(__name__)
WORD = re.compile(r"[^\W_]{3}")  # three letters or digits in a row: a trigram to look up

# a row as the writer adds it (``id`` is the database's)
COLUMNS = ("at", "request_id", "key", "team", "face", "method", "route", "model_asked", "model",
           "status", "code", "error", "attempts", "fallbacks", "batch_id", "mode", "shared",
           "input_tokens", "output_tokens", "cached_tokens", "cost", "saved", "latency_ms",
           "first_chunk_ms", "path", "request_body", "response_body")
LISTED = ("id", *COLUMNS[:24])  # what a listing returns (not the path, not the bodies)
FILTERS = ("key", "team", "route", "model", "status")  # equality filters, each with its index
SPLIT = FILTERS[:4]  # those whose index has the status second
LEADS = ("batch_id", "key", "model", "route", "team")  # whose index a listing reads, the first given
STEPS = (100, 400, 1500)  # rows a listing reads per step when some filter is not in its index
SCAN = sum(STEPS)  # the most it reads before it answers with what it found and where it stopped
MATCHES = 2000  # the most rows holding a text that a listing sorts (PostgreSQL's trigram index)
MATCHES_MS = 15  # the most milliseconds it spends looking them up before it scans instead
STATUSES = ("ok", "error")
Page = tuple[list[tuple[Any, ...]], tuple[float, int] | None]  # rows, and where a scan stopped
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
    # a batch's lines: only rows that have one are in it, so a call outside a batch adds nothing
    out.append(f"CREATE INDEX IF NOT EXISTS {name}_batch ON {table} (batch_id, at, id) "
               "WHERE batch_id IS NOT NULL")
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
    batch_id: str | None = None  # a /v1 batch's or a job's lines
    since: float | None = None
    until: float | None = None
    error: str | None = None  # text in the error message
    cursor: tuple[float, int] | None = None
    limit: int = 50


class RequestStore:
    """The SQLite table (its own connection to the job store's file)."""

    mark = "?"
    like = "LIKE"  # case-insensitive for ASCII in SQLite
    trigrams = False  # an index of the errors' text (PostgreSQL's pg_trgm)
    escape = " ESCAPE '\\'"  # SQLite's LIKE has no escape of its own

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

    def _conds(self, q: Query, names: Sequence[str]) -> tuple[list[str], list[Any]]:
        """``q``'s conditions on ``names`` (equality filters, ``code``, ``error`` for its text,
        ``time`` for since and until, ``cursor``), in the dialect's marks."""
        m = self.mark
        parts: list[str] = []
        args: list[Any] = []
        for name in names:
            if name == "time":
                for value, op in ((q.since, ">="), (q.until, "<")):
                    if value is not None:
                        parts.append(f"at {op} {m}")
                        args.append(value)
            elif name == "error":
                if q.error:
                    parts.append(f"error {self.like} {m}{self.escape}")
                    args.append("%" + q.error.replace("\\", "\\\\").replace("%", "\\%")
                                .replace("_", "\\_") + "%")
            elif name == "cursor":
                if q.cursor is not None:
                    parts.append(f"(at, id) < ({m}, {m})")
                    args += list(q.cursor)
            elif getattr(q, name) is not None:
                parts.append(f"{name} = {m}")
                args.append(getattr(q, name))
        return parts, args

    def _where(self, q: Query) -> tuple[str, list[Any]]:
        parts, args = self._conds(q, (*FILTERS, "batch_id", "code", "request_id", "time", "error", "cursor"))
        return (" WHERE " + " AND ".join(parts)) if parts else "", args

    def page(self, q: Query) -> Page:
        """Rows (``LISTED``) matching ``q``, newest first, at most ``q.limit``; and where the
        search stopped, ``(at, id)``, when it read ``SCAN`` rows without filling the page (None:
        the page is all there is up to its last row)."""
        if q.status is None and (q.code is not None or q.error):
            q = replace(q, status="error")  # only a failed call has a code or an error's text
        lead = next((f for f in LEADS if getattr(q, f) is not None), None)
        keyed = lead is None or lead in SPLIT  # its index holds the status
        rest = [f for f in (*FILTERS, "batch_id") if f != lead and getattr(q, f) is not None
                and not (f == "status" and keyed)]
        if q.code is not None:
            rest.append("code")
        if q.error:
            rest.append("error")
        if q.request_id is not None or not rest:
            return self._ranged(q, lead), None
        return self._scan(q, lead, rest)

    def _ranges(self, q: Query, lead: str | None) -> list[tuple[list[str], list[Any]]]:
        """The index ranges a listing reads, newest first: the lead filter's (with each status
        when it has a status index and no status is asked for), within the time and cursor."""
        if lead in SPLIT and q.status is None:
            return [self._conds(replace(q, status=s), (lead, "status", "time", "cursor")) for s in STATUSES]
        names = ("status",) if lead is None else (lead,) if lead == "batch_id" else (lead, "status")
        return [self._conds(q, (*names, "time", "cursor"))]

    def _ranged(self, q: Query, lead: str | None) -> list[tuple[Any, ...]]:
        """Every filter in its index: a page of each range, merged (at most two pages read)."""
        order = f"ORDER BY at DESC, id DESC LIMIT {int(q.limit)}"
        cols = ", ".join(LISTED)
        if q.request_id is not None:  # one HTTP request's calls: a few rows, all read
            where, args = self._where(q)
            sql = f"SELECT {cols} FROM {self.table}{where} {order}"
        else:
            sql, args = self._union(self._ranges(q, lead), cols, order, [], [])
        with self._lock:
            return [tuple(r) for r in self.conn.execute(sql, args).fetchall()]

    def _union(self, ranges: list[tuple[list[str], list[Any]]], cols: str, order: str,
               extra: list[str], extra_args: list[Any]) -> tuple[str, list[Any]]:
        """One range's rows, or each range's page merged into one."""
        selects, args = [], []
        for parts, more in ranges:
            where = (" WHERE " + " AND ".join(parts)) if parts else ""
            selects.append(f"SELECT {', '.join([cols, *extra])} FROM {self.table}{where} {order}")
            args += [*extra_args, *more]
        if len(selects) == 1:
            return selects[0], args
        merged = " UNION ALL ".join(f"SELECT * FROM ({s}) AS r{n}" for n, s in enumerate(selects))
        return f"{merged} {order}", args

    def _scan(self, q: Query, lead: str | None, rest: list[str]) -> Page:
        """A filter with no index of its own beside the lead's (another equality, a code, a
        text): the lead's rows read newest first, in growing steps, each marked by whether the
        rest match, until the page is full, the range ends, or ``SCAN`` rows were read; a text
        is also looked up in its own index after the first step (``_matches``)."""
        hits: list[tuple[float, int]] = []
        position = q.cursor
        m_parts, m_args = self._conds(q, rest)
        hit = f"CASE WHEN {' AND '.join(m_parts)} THEN 1 ELSE 0 END AS hit"
        for n, step in enumerate(STEPS):
            part = replace(q, cursor=position)
            order = f"ORDER BY at DESC, id DESC LIMIT {step}"
            sql, args = self._union(self._ranges(part, lead), "at, id", order, [hit], m_args)
            with self._lock:
                read = self.conn.execute(sql, args).fetchall()
            for at, row_id, matched in read:
                if matched:
                    hits.append((at, row_id))
                    if len(hits) == q.limit:
                        return self._rows(hits), None
            if len(read) < step:
                return self._rows(hits), None  # the range ended: nothing older matches
            position = (read[-1][0], read[-1][1])
            # a text that this step's rows seldom hold: looked up in its own index, unless what
            # they held says the steps left will fill the page
            if n == 0 and q.error and len(hits) * (SCAN - step) < (q.limit - len(hits)) * step:
                found = self._matches(replace(q, cursor=position), rest)
                if found is not None:
                    return self._rows(hits + found[:q.limit - len(hits)]), None
        return self._rows(hits), position

    def _matches(self, q: Query, rest: list[str]) -> list[tuple[float, int]] | None:
        """Every row after ``q.cursor`` that matches ``q``, newest first, found by its error's
        text in an index of its own, or None where there is no such index or it holds more than
        ``MATCHES`` rows with that text (the scan goes on instead)."""
        return None

    def _rows(self, hits: list[tuple[float, int]]) -> list[tuple[Any, ...]]:
        if not hits:
            return []
        marks = ", ".join([self.mark] * len(hits))
        sql = (f"SELECT {', '.join(LISTED)} FROM {self.table} WHERE id IN ({marks}) "
               "ORDER BY at DESC, id DESC")
        with self._lock:
            return [tuple(r) for r in self.conn.execute(sql, [i for _, i in hits]).fetchall()]

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
    like = "ILIKE"
    escape = ""  # a backslash is PostgreSQL's own: a constant pattern the trigram index can use

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
            self.trigrams = self._trigram_index(schema)

    def _trigram_index(self, schema: str) -> bool:
        """The errors' text in a trigram index (pg_trgm, a trusted extension: a database owner
        may add it), only failed calls' rows, so a call that succeeded adds nothing to it; False
        where the extension cannot be had (a text is then looked for by the scan alone)."""
        try:
            with self.conn.transaction():  # a savepoint: a refusal leaves the rest standing
                self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        except Exception as e:
            log.warning("no pg_trgm (%s): a text in the request log's errors is looked for by scanning", e)
            return False
        where = self.conn.execute("SELECT extnamespace::regnamespace::text FROM pg_extension "
                                  "WHERE extname = 'pg_trgm'").fetchone()[0]
        self.conn.execute(f"CREATE INDEX IF NOT EXISTS requests_error ON {self.table} "
                          f"USING gin (error {where}.gin_trgm_ops) WHERE status = 'error'")
        return True

    def _matches(self, q: Query, rest: list[str]) -> list[tuple[float, int]] | None:
        if not self.trigrams or q.error is None or not WORD.search(q.error):
            return None  # no index, or no three letters or digits in a row: no trigram to look up
        parts, args = self._conds(q, ("error", "time", "cursor"))
        m_parts, m_args = self._conds(q, rest)
        sql = (f"SELECT at, id, CASE WHEN {' AND '.join(m_parts)} THEN 1 ELSE 0 END FROM {self.table} "
               f"WHERE status = 'error' AND {' AND '.join(parts)} LIMIT {MATCHES + 1}")
        import psycopg

        try:
            with self._lock, self.conn.transaction():
                # the text's index, never the newest errors read in order until enough match; a
                # text that many errors hold takes the index long to list: given up on in time
                self.conn.execute("SET LOCAL enable_indexscan = off")
                self.conn.execute("SET LOCAL enable_seqscan = off")
                self.conn.execute(f"SET LOCAL statement_timeout = {MATCHES_MS}")
                found = self.conn.execute(sql, [*m_args, *args]).fetchall()
        except psycopg.errors.QueryCanceled:
            return None
        if len(found) > MATCHES:
            return None
        found.sort(reverse=True)
        return [(at, row_id) for at, row_id, hit in found if hit]

    def add(self, rows: Sequence[Sequence[Any]]) -> None:
        with self._lock, self.conn.cursor() as cur, \
                cur.copy(f"COPY {self.table} ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
