"""The SQLite job store shared by the worker processes of one gateway (``serve --workers N``).

Every worker opens the same file (WAL, a 30 s busy timeout: several processes may write), so
any worker answers ``jobs.*``, files and batches. What must not be shared is the driving of a
batch part: two workers resuming the same part would submit it upstream twice. So a part is
driven by one worker at a time, as replicas do on PostgreSQL (``pg_store.py``): a claim with
a lease (``owner``, ``lease_until``) and a fencing counter (``epoch``), kept in a table of
its own so files written before need no migration. A worker renews its claims while it runs;
a killed worker's parts are adopted by another once the lease runs out (or by its restart),
and a clean stop hands them back at once. Writes about a part's remote batch go through only
while the writer holds the part's current epoch (``LeaseLost`` otherwise).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .fencing import fence, fence_writes
from .locked import locked as _locked
from .store import JobStore

CLAIMS = """
CREATE TABLE IF NOT EXISTS part_claims (
  part_id TEXT PRIMARY KEY, owner TEXT, lease_until REAL, epoch INTEGER NOT NULL DEFAULT 0);
"""


class SharedSqliteStore(JobStore):
    """One worker's connection to the gateway's SQLite file, driving only the parts it claims."""

    shared = True

    def __init__(self, path: str | Path, lease_s: float = 30.0, wall: Callable[[], float] = time.time,
                 owner: str | None = None) -> None:
        self._depth = 0  # open transactions: an inner one is a savepoint
        super().__init__(path, wall)
        self.lease_s = lease_s
        self.owner = owner or secrets.token_hex(6)
        self._claims: dict[str, int] = {}  # part id -> the epoch this worker holds
        self._db.executescript(CLAIMS)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        """A transaction (BEGIN IMMEDIATE: the write lock first, so no deadlock between
        processes), or a savepoint inside one."""
        if self._depth == 0:
            self._depth = 1
            try:
                with super()._tx():
                    yield
            finally:
                self._depth = 0
            return
        name = f"sp{self._depth}"
        self._x(f"SAVEPOINT {name}")
        self._depth += 1
        try:
            yield
        except BaseException:
            self._x(f"ROLLBACK TO {name}")
            self._x(f"RELEASE {name}")
            raise
        finally:
            self._depth -= 1
        self._x(f"RELEASE {name}")

    # -- who drives each part ----------------------------------------------------------------
    @_locked
    def claim_part(self, part_id: str) -> bool:
        """Take the part if no live worker holds it (raising its epoch); True if it is ours."""
        now = self.wall()
        with self._tx():
            part = self._x("SELECT state FROM parts WHERE id=?", (part_id,)).fetchone()
            row = self._x("SELECT owner, lease_until, epoch FROM part_claims WHERE part_id=?",
                          (part_id,)).fetchone()
            taken = row is not None and row[0] not in (None, self.owner) and (row[1] or 0) >= now
            if part is None or part[0] == "done" or taken:
                self._claims.pop(part_id, None)
                return False
            epoch = (row[2] if row is not None else 0) + 1
            self._x("INSERT INTO part_claims VALUES (?,?,?,?) ON CONFLICT(part_id) DO UPDATE SET "
                    "owner=excluded.owner, lease_until=excluded.lease_until, epoch=excluded.epoch",
                    (part_id, self.owner, now + self.lease_s, epoch))
        self._claims[part_id] = epoch
        return True

    @_locked
    def renew_claims(self) -> list[str]:
        """Extend every claim this worker holds; the parts it lost (to stop driving them)."""
        lost = []
        until = self.wall() + self.lease_s
        with self._tx():
            for part_id, epoch in list(self._claims.items()):
                kept = self._x("UPDATE part_claims SET lease_until=? WHERE part_id=? AND owner=? "
                               "AND epoch=?", (until, part_id, self.owner, epoch)).rowcount
                if not kept:
                    del self._claims[part_id]
                    lost.append(part_id)
        return lost

    @_locked
    def unclaimed_parts(self, provider: str) -> list[str]:
        """Open parts no live worker drives (their worker died, or none took them yet)."""
        return [r[0] for r in self._x(
            "SELECT p.id FROM parts p LEFT JOIN part_claims c ON c.part_id = p.id "
            "WHERE p.provider=? AND p.state!='done' AND (c.owner IS NULL OR c.lease_until < ?) "
            "ORDER BY p.created", (provider, self.wall()))]

    def release_claim(self, part_id: str) -> None:
        """Forget the claim in memory: its driver ended (the part is done, or lost)."""
        self._claims.pop(part_id, None)

    @_locked
    def release_claims(self, part_ids: Iterable[str]) -> list[str]:
        """Hand back the claims held on ``part_ids`` (a clean stop), only where still ours at the
        epoch we took; the parts handed back."""
        held = [(p, self._claims.pop(p)) for p in part_ids if p in self._claims]
        out = []
        with self._tx():
            for part_id, epoch in held:
                if self._x("UPDATE part_claims SET owner=NULL, lease_until=NULL WHERE part_id=? "
                           "AND owner=? AND epoch=?", (part_id, self.owner, epoch)).rowcount:
                    out.append(part_id)
        return sorted(out)

    def _fence(self, part_id: str) -> None:
        """The part's claim row (locked for this transaction), judged by ``fencing.fence``."""
        row = self._x("SELECT owner, epoch, lease_until FROM part_claims WHERE part_id=?",
                      (part_id,)).fetchone()
        fence(row, part_id, self.owner, self._claims, self.wall())


fence_writes(SharedSqliteStore, "worker")
