"""Batch jobs in PostgreSQL (``store.url``), shared by every replica.

The same queries as the SQLite store (``store.py``), in Postgres's dialect. What
several replicas add: each part (one remote batch) is driven by exactly one
replica at a time. A replica claims a part with a lease (``owner``,
``lease_until``) and a fencing counter (``epoch``, raised by every claim); it
renews its claims while it runs, and every write about a part's remote batch
carries the epoch it claimed, so a replica that was paused past its lease and
wakes up cannot overwrite the new owner's state (``LeaseLost``). A replica that
dies loses its parts after the lease, and another one adopts them where they
stopped; one that stops cleanly hands its claims back (compared on owner and
epoch), so a restart or another replica takes them at once. Why psycopg 3: the
maintained PostgreSQL driver, with transactions as context managers; it runs on
the store's worker thread like sqlite3 does.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .fencing import fence, fence_writes
from .pg_connect import connect
from .store import ITEMS, JobStore, _locked
from .v1_tables import V1_TABLES

TABLES = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, identity TEXT, source TEXT NOT NULL, state TEXT NOT NULL,
  total INTEGER NOT NULL DEFAULT 0, created DOUBLE PRECISION NOT NULL,
  updated DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS parts (
  id TEXT PRIMARY KEY, job_id TEXT NOT NULL, provider TEXT NOT NULL, attempt INTEGER NOT NULL,
  state TEXT NOT NULL, remote_id TEXT, remote_status TEXT, detail TEXT, intent_wall DOUBLE PRECISION,
  created DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL,
  owner TEXT, lease_until DOUBLE PRECISION, epoch BIGINT NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS parts_open ON parts(provider, state);
CREATE INDEX IF NOT EXISTS parts_job ON parts(job_id);
"""

_DIALECT = [(re.compile(r"\bIS \?"), "IS NOT DISTINCT FROM ?"),
            (re.compile(r"LENGTH\(CAST\(params AS BLOB\)\)"), "OCTET_LENGTH(params)")]
# Writes about a part's remote batch: only the replica holding the part's current epoch may make them.


def _pg(sql: str) -> str:
    for pattern, replacement in _DIALECT:
        sql = pattern.sub(replacement, sql)
    return sql.replace("?", "%s")


class PgJobStore(JobStore):
    shared = True
    _HOLD_JOB = "SELECT state, total FROM jobs WHERE id=? FOR UPDATE"  # replicas append one at a time
    def __init__(self, url: str, lease_s: float = 30.0, wall: Callable[[], float] = time.time,
                 owner: str | None = None, schema: str = "multiplexer") -> None:
        self.url = url
        self.schema = schema
        self.path = None  # type: ignore[assignment]
        self.wall = wall
        self.lease_s = lease_s
        self.owner = owner or secrets.token_hex(6)
        self._lock = threading.RLock()
        # not the base class's _db: that is sqlite3's, read only by the methods overridden here
        self._conn = connect(url)
        self._claims: dict[str, int] = {}  # part id -> the epoch this replica holds
        self._sql: dict[str, str] = {}
        self._in_schema(schema)

    def _in_schema(self, schema: str) -> None:
        """Every query of this connection in ``schema`` (created if missing), not in ``public``:
        the tables sit where the config says, beside whatever else the database holds."""
        from psycopg import sql

        name = sql.Identifier(schema)
        with self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(7331)")  # one replica creates the tables
            self._conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(name))
            self._conn.execute(sql.SQL("SET search_path TO {}").format(name))
            self._conn.execute(TABLES + ITEMS + V1_TABLES.format(blob="BYTEA"))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[None]:
        with self._conn.transaction():
            yield

    def _q(self, sql: str) -> str:
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = _pg(sql)
        return out

    def _x(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._conn.execute(self._q(sql), args)

    def _xm(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        cur = self._conn.cursor()
        cur.executemany(self._q(sql), list(rows))
        return cur

    # -- who drives each part ----------------------------------------------------------
    @_locked
    def claim_part(self, part_id: str) -> bool:
        """Take the part if no live replica holds it (raising its epoch); True if it is ours."""
        now = self.wall()
        row = self._x(
            "UPDATE parts SET owner=?, lease_until=?, epoch=epoch+1 WHERE id=? AND state!='done' "
            "AND (owner IS NULL OR owner=? OR lease_until < ?) RETURNING epoch",
            (self.owner, now + self.lease_s, part_id, self.owner, now)).fetchone()
        if row is None:
            self._claims.pop(part_id, None)
            return False
        self._claims[part_id] = row[0]
        return True

    @_locked
    def renew_claims(self) -> list[str]:
        """Extend every claim this replica holds; the parts it lost (to stop driving them)."""
        lost = []
        until = self.wall() + self.lease_s
        for part_id, epoch in list(self._claims.items()):
            kept = self._x("UPDATE parts SET lease_until=? WHERE id=? AND owner=? AND epoch=?",
                           (until, part_id, self.owner, epoch)).rowcount
            if not kept:
                del self._claims[part_id]
                lost.append(part_id)
        return lost

    @_locked
    def unclaimed_parts(self, provider: str) -> list[str]:
        """Open parts no live replica drives (their owner died or never took them)."""
        return [r[0] for r in self._x(
            "SELECT id FROM parts WHERE provider=? AND state!='done' "
            "AND (owner IS NULL OR lease_until < ?) ORDER BY created", (provider, self.wall()))]

    def release_claim(self, part_id: str) -> None:
        """Forget the claim in memory: its driver ended (the part is done, or lost)."""
        self._claims.pop(part_id, None)

    @_locked
    def release_claims(self, part_ids: Iterable[str]) -> list[str]:
        """Hand back the claims held on ``part_ids`` (a clean stop, once their drivers ended), so
        a restart or another replica takes the parts at once instead of after the lease. Only
        a claim still ours at the epoch we took is cleared: a part another replica has claimed
        since is left to it. The parts handed back."""
        held = [(p, self._claims.pop(p)) for p in part_ids if p in self._claims]
        if not held:
            return []
        rows = self._x(
            "UPDATE parts AS p SET owner=NULL, lease_until=NULL "
            "FROM unnest(?::text[], ?::bigint[]) AS c(id, epoch) "
            "WHERE p.id=c.id AND p.epoch=c.epoch AND p.owner=? RETURNING p.id",
            ([p for p, _ in held], [e for _, e in held], self.owner)).fetchall()
        return sorted(r[0] for r in rows)

    def _fence(self, part_id: str) -> None:
        """The part's claim row (locked for this transaction), judged by ``fencing.fence``."""
        row = self._x("SELECT owner, epoch, lease_until FROM parts WHERE id=? FOR UPDATE",
                      (part_id,)).fetchone()
        fence(row, part_id, self.owner, self._claims, self.wall())


fence_writes(PgJobStore, "replica")
