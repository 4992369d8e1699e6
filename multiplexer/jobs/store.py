"""Durable batch jobs in SQLite: jobs, their items (custom id -> call), parts, and results.

A part's life is written down before each irreversible step: ``submitting``
(with the wall time) is committed before the batch is created upstream, and the
remote batch id together with ``submitted`` in one transaction after it, so a
gateway killed at any instant knows on restart whether to poll, to look the
batch up, or to submit; never to submit twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio

from multiplexer.core.jobrows import ItemRow, JobRow, NewItem, PartRow, custom_id, dumps, loads_many

from .locked import locked as _locked
from .v1_tables import V1_TABLES, V1Tables

T = TypeVar("T")


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, identity TEXT, source TEXT NOT NULL, state TEXT NOT NULL,
  total INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS parts (
  id TEXT PRIMARY KEY, job_id TEXT NOT NULL, provider TEXT NOT NULL, attempt INTEGER NOT NULL,
  state TEXT NOT NULL, remote_id TEXT, remote_status TEXT, detail TEXT, intent_wall REAL,
  created REAL NOT NULL, updated REAL NOT NULL);
CREATE INDEX IF NOT EXISTS parts_open ON parts(provider, state);
CREATE INDEX IF NOT EXISTS parts_job ON parts(job_id);
"""
ITEMS = """
CREATE TABLE IF NOT EXISTS items (
  job_id TEXT NOT NULL, idx INTEGER NOT NULL, provider TEXT, route TEXT, operation TEXT,
  method TEXT, params TEXT, options TEXT, tokens INTEGER NOT NULL DEFAULT 1,
  custom_id TEXT NOT NULL, part_id TEXT, state TEXT NOT NULL, result TEXT, error TEXT,
  split TEXT, PRIMARY KEY (job_id, idx));
CREATE INDEX IF NOT EXISTS items_part ON items(part_id);
CREATE INDEX IF NOT EXISTS jobs_ended ON jobs(state, updated);
"""  # the same in PostgreSQL


_OPEN = "('open','running','cancelling')"  # the job states before its end
LIVE_SPLIT = '"live"'  # the split key of items moved to a route's live endpoint: a part of their own
_INTERNAL = -32603  # a failed item's code where its stored error has none



@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One SQLite transaction (autocommit connection): the write lock taken at once, committed
    when the block ends, rolled back if it raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")

class LeaseLost(Exception):
    """This replica no longer owns the part (its lease ran out and another replica took it)."""


class JobStore(V1Tables):
    """Blocking methods guarded by a lock; call them through ``run`` from async code."""

    shared = False  # one gateway owns this file: every part is its own to drive

    def __init__(self, path: str | Path, wall: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.wall = wall  # wall time of every row (injected by the retention soak)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                                   timeout=30.0)
        self._x("PRAGMA journal_mode=WAL")
        self._x("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA + ITEMS + V1_TABLES.format(blob="BLOB"))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> contextlib.AbstractContextManager[None]:
        return transaction(self._db)

    def _x(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._db.execute(sql, args)

    def _xm(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        return self._db.executemany(sql, rows)

    # -- jobs ------------------------------------------------------------------
    @_locked
    def ping(self) -> None:
        self._x("SELECT 1").fetchone()

    @_locked
    def create_job(self, job_id: str, identity: str | None, source: str, state: str) -> None:
        now = self.wall()
        self._x("INSERT INTO jobs VALUES (?,?,?,?,0,?,?)",
                         (job_id, identity, source, state, now, now))

    @_locked
    def job(self, job_id: str) -> JobRow | None:
        row = self._x("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return JobRow(*row) if row else None

    @_locked
    def list_jobs(self, identity: str | None, limit: int) -> list[JobRow]:
        rows = self._x(
            "SELECT * FROM jobs WHERE identity IS ? ORDER BY created DESC LIMIT ?",
            (identity, limit)).fetchall()
        return [JobRow(*r) for r in rows]

    @_locked
    def open_jobs(self, limit: int) -> list[JobRow]:
        """The jobs not ended yet, every caller's, newest first (the dashboard)."""
        rows = self._x(f"SELECT * FROM jobs WHERE state IN {_OPEN} ORDER BY created DESC LIMIT ?",
                       (limit,)).fetchall()
        return [JobRow(*r) for r in rows]

    @_locked
    def idle_open_jobs(self, before: float) -> list[str]:
        """Jobs still open whose last change is older than ``before`` (wall time)."""
        rows = self._x("SELECT id FROM jobs WHERE state='open' AND updated < ?", (before,))
        return [r[0] for r in rows.fetchall()]

    @_locked
    def set_job_state(self, job_id: str, state: str, only_from: Sequence[str] = ()) -> bool:
        sql = "UPDATE jobs SET state=?, updated=? WHERE id=?"
        args: list[Any] = [state, self.wall(), job_id]
        if only_from:
            sql += f" AND state IN ({','.join('?' * len(only_from))})"
            args += list(only_from)
        return self._x(sql, args).rowcount > 0

    @_locked
    def delete_job(self, job_id: str) -> bool:
        """Drop a job, its items and parts; True if it existed."""
        with self._tx():
            for table, col in (("items", "job_id"), ("parts", "job_id"), ("jobs", "id")):
                n = self._x(f"DELETE FROM {table} WHERE {col}=?", (job_id,)).rowcount
        return n > 0

    @_locked
    def purge(self, before: float, limit: int = 500) -> list[str]:
        """Delete up to ``limit`` ended jobs last changed before ``before`` (wall time)."""
        ids = [r[0] for r in self._x(
            "SELECT id FROM jobs WHERE state IN ('done','cancelled') AND updated < ? LIMIT ?",
            (before, limit))]
        for job_id in ids:
            self.delete_job(job_id)
        return ids

    @_locked
    def finish_job_if_done(self, job_id: str) -> str | None:
        """Close a sealed job whose items all ended; its final state if this call closed it."""
        job = self.job(job_id)
        if job is None or job.state not in ("running", "cancelling"):
            return None
        left = self._x(
            "SELECT COUNT(*) FROM items WHERE job_id=? AND state NOT IN ('succeeded','failed')",
            (job_id,)).fetchone()[0]
        if left:
            return None
        final = "cancelled" if job.state == "cancelling" else "done"
        self.set_job_state(job_id, final)
        return final

    @_locked
    def gauges(self) -> tuple[int, dict[str, int]]:
        """Jobs not ended, and their items by state (for ``/metrics``)."""
        open_jobs = self._x(f"SELECT COUNT(*) FROM jobs WHERE state IN {_OPEN}").fetchone()[0]
        items = dict(self._x(
            "SELECT i.state, COUNT(*) FROM jobs j JOIN items i ON i.job_id = j.id "
            f"WHERE j.state IN {_OPEN} GROUP BY i.state").fetchall())
        return int(open_jobs), {str(k): int(v) for k, v in items.items()}

    @_locked
    def tally(self, job_id: str) -> list[tuple[str | None, int | None, int]]:
        """(route, error code or None for a success, items) of a job's ended items."""
        out: list[tuple[str | None, int | None, int]] = [
            (route, None, int(n)) for route, n in self._x(
                "SELECT route, COUNT(*) FROM items WHERE job_id=? AND state='succeeded' GROUP BY route",
                (job_id,))]
        failed: dict[tuple[str | None, int], int] = {}
        for route, error in self._x("SELECT route, error FROM items WHERE job_id=? AND state='failed'",
                                    (job_id,)):
            code = json.loads(error).get("code") if error else None
            key = (route, code if isinstance(code, int) else _INTERNAL)
            failed[key] = failed.get(key, 0) + 1
        return out + [(route, code, n) for (route, code), n in failed.items()]

    @_locked
    def counts(self, job_id: str) -> dict[str, int]:
        counts = dict.fromkeys(("queued", "submitted", "succeeded", "failed"), 0)
        for state, n in self._x(
                "SELECT state, COUNT(*) FROM items WHERE job_id=? GROUP BY state", (job_id,)):
            counts[state] = n
        return counts

    @_locked
    def job_parts(self, job_id: str) -> list[PartRow]:
        rows = self._x("SELECT * FROM parts WHERE job_id=? ORDER BY created",
                                (job_id,)).fetchall()
        return [_part(r) for r in rows]

    # -- items -----------------------------------------------------------------
    _HOLD_JOB = "SELECT state, total FROM jobs WHERE id=?"  # BEGIN IMMEDIATE already holds SQLite

    @_locked
    def add_items(self, job_id: str, items: Iterable[NewItem]) -> int:
        with self._tx():
            return self._insert_items(job_id, items)

    @_locked
    def append_items(self, job_id: str, items: Sequence[NewItem]) -> int | None:
        """Add ``items`` (numbered from 0) after the job's current total, in one transaction that
        holds the job: two replicas appending to one open job get disjoint numbers, and a job
        sealed meanwhile takes none. The first new number, or None when the job is not open."""
        with self._tx():
            row = self._x(self._HOLD_JOB, (job_id,)).fetchone()
            if row is None or row[0] != "open":
                return None
            base = int(row[1])
            self._insert_items(job_id, [
                dataclasses.replace(n, idx=base + n.idx, custom_id=custom_id(job_id, base + n.idx))
                for n in items])
        return base

    def _insert_items(self, job_id: str, items: Iterable[NewItem]) -> int:
        cur = self._xm(
            "INSERT INTO items VALUES (?,?,?,?,?,?,?,?,?,?,NULL,?,NULL,?,?)",
            ((job_id, n.idx, n.provider, n.route, n.operation, n.method, dumps(n.params),
              dumps(n.options), n.tokens, n.custom_id, n.state,
              dumps(n.error) if n.error is not None else None, n.split) for n in items))
        added = int(cur.rowcount)
        self._x("UPDATE jobs SET total=total+?, updated=? WHERE id=?", (added, self.wall(), job_id))
        return added

    @_locked
    def jobs_with_unplanned(self, provider: str) -> list[str]:
        """Sealed jobs whose items for ``provider`` were never split into parts (crash window)."""
        return [j for (j,) in self._x(
            "SELECT DISTINCT i.job_id FROM items i JOIN jobs j ON j.id=i.job_id WHERE "
            "i.provider=? AND i.part_id IS NULL AND i.state='queued' AND j.state!='open'",
            (provider,))]

    @_locked
    def unplanned(self, job_id: str, provider: str) -> list[tuple[int, str | None, int]]:
        """(idx, split key, request size in bytes) of items not yet in a part."""
        return self._x(
            "SELECT idx, split, LENGTH(CAST(params AS BLOB)) FROM items WHERE job_id=? AND "
            "provider=? AND part_id IS NULL AND state='queued' ORDER BY idx",
            (job_id, provider)).fetchall()

    @_locked
    def unplanned_tokens(self, job_id: str, provider: str) -> dict[int, int]:
        """idx -> estimated tokens of items not yet in a part (for an enqueued-token quota)."""
        return dict(self._x(
            "SELECT idx, tokens FROM items WHERE job_id=? AND provider=? AND part_id IS NULL "
            "AND state='queued'", (job_id, provider)).fetchall())

    @_locked
    def part_operation(self, part_id: str) -> str | None:
        """The operation of a part's items (one per part: the split key holds it)."""
        row = self._x("SELECT operation FROM items WHERE part_id=? LIMIT 1", (part_id,)).fetchone()
        return row[0] if row else None

    @_locked
    def enqueued(self, provider: str, part_id: str) -> tuple[int, int, int]:
        """(the provider's other batches not yet ended, their tokens with this part's split key,
        this part's tokens): what a vendor's enqueued-token and active-batch quotas count."""
        mine = self._x("SELECT MIN(split), COALESCE(SUM(tokens),0) FROM items WHERE part_id=?",
                       (part_id,)).fetchone()
        active = self._x(
            "SELECT COUNT(*) FROM parts WHERE provider=? AND id!=? AND state IN "
            "('submitting','submitted')", (provider, part_id)).fetchone()[0]
        queued = self._x(
            "SELECT COALESCE(SUM(i.tokens),0) FROM items i JOIN parts p ON p.id=i.part_id "
            "WHERE p.provider=? AND p.id!=? AND p.state IN ('submitting','submitted') "
            "AND i.split=?", (provider, part_id, mine[0])).fetchone()[0]
        return int(active), int(queued), int(mine[1])

    @_locked
    def part_open(self, part_id: str) -> list[tuple[int, str]]:
        """(idx, custom_id) of the part's unfinished items: all that matching results needs."""
        return self._x(
            "SELECT idx, custom_id FROM items WHERE part_id=? AND state NOT IN ('succeeded','failed') "
            "ORDER BY idx", (part_id,)).fetchall()

    @_locked
    def part_requests(self, part_id: str) -> list[tuple[str, str, str]]:
        """(custom_id, operation, params JSON) of the part's unfinished items, for an upload."""
        return self._x(
            "SELECT custom_id, operation, params FROM items WHERE part_id=? "
            "AND state NOT IN ('succeeded','failed') ORDER BY idx", (part_id,)).fetchall()

    @_locked
    def part_items(self, part_id: str, pending_only: bool = False) -> list[ItemRow]:
        sql = ("SELECT idx, custom_id, route, operation, method, params, options, tokens, state "
               "FROM items WHERE part_id=?")
        if pending_only:
            sql += " AND state NOT IN ('succeeded','failed')"
        return [ItemRow(*r) for r in self._x(sql + " ORDER BY idx", (part_id,))]

    @_locked
    def record(self, job_id: str, rows: Sequence[tuple[int, str, Any, Any]]) -> int:
        """Store (idx, state, result, error) for items not already finished; returns how many."""
        with self._tx():
            cur = self._xm(
                "UPDATE items SET state=?, result=?, error=? WHERE job_id=? AND idx=? "
                "AND state NOT IN ('succeeded','failed')",
                ((state, dumps(result) if state == "succeeded" else None,
                  dumps(error) if error is not None else None, job_id, idx)
                 for idx, state, result, error in rows))
        return cur.rowcount

    @_locked
    def fail_open(self, job_id: str, error: dict[str, Any], part_id: str | None = None,
                  provider: str | None = None, unplanned_only: bool = False) -> int:
        """Fail unfinished items of a part, or of the job (optionally one provider's, unplanned)."""
        sql = ("UPDATE items SET state='failed', error=? WHERE job_id=? "
               "AND state NOT IN ('succeeded','failed')")
        args: list[Any] = [dumps(error), job_id]
        if part_id is not None:
            sql += " AND part_id=?"
            args.append(part_id)
        if provider is not None:
            sql += " AND provider=?"
            args.append(provider)
        if unplanned_only:
            sql += " AND part_id IS NULL"
        return self._x(sql, args).rowcount

    @_locked
    def page(self, job_id: str, cursor: int, limit: int) -> list[tuple[int, str, Any, Any, str | None]]:
        """(idx, state, result, error, route) from ``cursor``: the route is the one that ran it."""
        rows = self._x(
            "SELECT idx, state, result, error, route FROM items WHERE job_id=? AND idx>=? "
            "ORDER BY idx LIMIT ?", (job_id, cursor, limit)).fetchall()
        results = loads_many([r for _, _, r, _, _ in rows])
        errors = loads_many([e for _, _, _, e, _ in rows])
        return [(i, s, r, e, route)
                for (i, s, _, _, route), r, e in zip(rows, results, errors, strict=True)]

    @_locked
    def outcomes(self, job_id: str, count: int) -> list[tuple[str, Any, Any]]:
        """(state, result, error) of items 0..count-1, in order."""
        out: list[tuple[str, Any, Any]] = []
        for start in range(0, count, 5000):
            rows = self._x(
                "SELECT state, result, error FROM items WHERE job_id=? AND idx>=? AND idx<? "
                "ORDER BY idx", (job_id, start, min(start + 5000, count))).fetchall()
            results = loads_many([r for _, r, _ in rows])
            errors = loads_many([e for _, _, e in rows])
            out += [(s, r, e) for (s, _, _), r, e in zip(rows, results, errors, strict=True)]
        return out

    # -- parts -----------------------------------------------------------------
    @_locked
    def create_parts(self, job_id: str, provider: str, attempt: int,
                     parts: Sequence[tuple[str, Sequence[int]]]) -> None:
        now = self.wall()
        with self._tx():
            for part_id, idxs in parts:
                self._x("INSERT INTO parts VALUES (?,?,?,?,'pending',NULL,NULL,NULL,NULL,?,?)",
                           (part_id, job_id, provider, attempt, now, now))
                self._xm("UPDATE items SET part_id=?, state='queued' WHERE job_id=? AND idx=?",
                               ((part_id, job_id, i) for i in idxs))

    @_locked
    def reroute(self, part_id: str, job_id: str, moves: Sequence[NewItem]) -> int:
        """Take unfinished items out of a part whose remote batch failed whole and put them, unplanned,
        on their fallback route (``moves``: each item as that route makes it), in one transaction:
        the new provider's manager plans them, now or on its resume after a restart. How many moved."""
        with self._tx():
            cur = self._xm(
                "UPDATE items SET provider=?, route=?, operation=?, method=?, params=?, options=?, "
                "tokens=?, split=?, part_id=NULL, state='queued' WHERE job_id=? AND idx=? "
                "AND part_id=? AND state NOT IN ('succeeded','failed')",
                ((n.provider, n.route, n.operation, n.method, dumps(n.params), dumps(n.options),
                  n.tokens, n.split, job_id, n.idx, part_id) for n in moves))
            moved = int(cur.rowcount)
            self._x("UPDATE jobs SET updated=? WHERE id=?", (self.wall(), job_id))
        return moved

    @_locked
    def part_live(self, part_id: str) -> bool:
        """Whether the part's items run on the live endpoint (moved there from a failed batch)."""
        return self._x("SELECT 1 FROM items WHERE part_id=? AND split=? LIMIT 1",
                       (part_id, LIVE_SPLIT)).fetchone() is not None

    @_locked
    def part(self, part_id: str) -> PartRow | None:
        row = self._x("SELECT * FROM parts WHERE id=?", (part_id,)).fetchone()
        return _part(row) if row else None

    @_locked
    def open_parts(self, provider: str) -> list[PartRow]:
        rows = self._x(
            "SELECT * FROM parts WHERE provider=? AND state!='done' ORDER BY created",
            (provider,)).fetchall()
        return [_part(r) for r in rows]

    @_locked
    def claimed_remote_ids(self, provider: str) -> set[str]:
        return {r for (r,) in self._x(
            "SELECT remote_id FROM parts WHERE provider=? AND remote_id IS NOT NULL", (provider,))}

    @_locked
    def mark_submitting(self, part_id: str, intent_wall: float) -> None:
        self._x(
            "UPDATE parts SET state='submitting', intent_wall=?, updated=? WHERE id=?",
            (intent_wall, self.wall(), part_id))

    @_locked
    def mark_submitted(self, part_id: str, remote_id: str) -> None:
        with self._tx():
            self._x("UPDATE parts SET state='submitted', remote_id=?, updated=? WHERE id=?",
                       (remote_id, self.wall(), part_id))
            self._x("UPDATE items SET state='submitted' WHERE part_id=? AND state='queued'",
                       (part_id,))

    @_locked
    def set_remote_status(self, part_id: str, status: str) -> None:
        self._x("UPDATE parts SET remote_status=?, updated=? WHERE id=?",
                         (status, self.wall(), part_id))

    @_locked
    def finish_part(self, part_id: str, remote_status: str | None, detail: str | None) -> None:
        self._x(
            "UPDATE parts SET state='done', remote_status=COALESCE(?, remote_status), detail=?, "
            "updated=? WHERE id=?", (remote_status, detail, self.wall(), part_id))


    # -- who drives each part (one gateway: always this one; see pg_store for replicas) ----
    def claim_part(self, part_id: str) -> bool:
        return True

    def renew_claims(self) -> list[str]:
        return []

    def unclaimed_parts(self, provider: str) -> list[str]:
        return []

    def release_claim(self, part_id: str) -> None:
        pass

    def release_claims(self, part_ids: Iterable[str]) -> list[str]:
        return []


def _part(row: Sequence[Any]) -> PartRow:
    return PartRow(*row[:9])
