"""The ``/v1`` face's files and batch records, in the job store's database (SQLite or PostgreSQL),
so every replica on one ``store.url`` serves every file and batch.

The files' tables are ``v1_files.py``'s. Two more here: ``v1_batches`` (a batch's record: what
it is, where each line went, its status stamps; written whole once, at creation, then only its
small columns change) and ``v1_batch_results`` (one row per line that ended outside the batch's
job: refused at creation, or run through the lanes; inserted a page at a time, never rewritten).
Listings are indexed queries, newest first, by owner. A batch's lane lines are run by one
gateway at a time: it holds the batch (``runner``, ``runner_until``) and renews the hold while
it runs; a replica that dies leaves it to another once the hold runs out.

These are mixed into the job store (``store.py``), whose connection, lock and SQL dialect they
share: the methods block and run through ``store.run`` from async code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from multiplexer.core.jobrows import dumps, loads_many

from .line_runner import HoldLost
from .locked import locked
from .v1_files import FILE_TABLES, V1Files

V1_TABLES = FILE_TABLES + """
CREATE TABLE IF NOT EXISTS v1_batches (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, endpoint TEXT NOT NULL,
  input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, created BIGINT NOT NULL,
  metadata TEXT, total INTEGER NOT NULL, own_total INTEGER NOT NULL, job_id TEXT, errors TEXT,
  cancelled_at BIGINT, ended TEXT NOT NULL, counts TEXT, lines TEXT NOT NULL, requests {blob},
  runner TEXT, runner_until DOUBLE PRECISION);
CREATE INDEX IF NOT EXISTS v1_batches_owner ON v1_batches(owner, kind, created DESC, id DESC);
CREATE TABLE IF NOT EXISTS v1_batch_results (
  batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, status INTEGER NOT NULL,
  body TEXT NOT NULL, PRIMARY KEY (batch_id, line));
"""

# a batch's record without its per-line lists (``lines``) and kept request bodies
BATCH_COLUMNS = ("id", "owner", "kind", "endpoint", "input_file_id", "completion_window", "created",
                 "metadata", "total", "own_total", "job_id", "errors", "cancelled_at", "ended",
                 "counts", "runner_until")
_JSON = ("metadata", "errors", "ended", "counts")
_SELECT_BATCH = f"SELECT {', '.join(BATCH_COLUMNS)} FROM v1_batches"


def who(owner: str | None) -> str:
    """The owner column: a key's name, or '' without auth (a plain ``=`` keeps the index)."""
    return "" if owner is None else owner


def _batch(row: Sequence[Any], lines: str | None = None) -> dict[str, Any]:
    out = dict(zip(BATCH_COLUMNS, row, strict=True))
    out["owner"] = out["owner"] or None
    for key, value in zip(_JSON, loads_many([out[k] for k in _JSON]), strict=True):
        out[key] = value
    if lines is not None:
        out.update(loads_many([lines])[0])
    return out


class V1Tables(V1Files):
    """Mixed into ``JobStore``: ``_x``, ``_xm``, ``_tx`` and ``_lock`` are the store's."""

    _lock: Any
    shared: bool

    if TYPE_CHECKING:
        def _x(self, sql: str, args: Sequence[Any] = ()) -> Any: ...
        def _xm(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any: ...
        def _tx(self) -> AbstractContextManager[None]: ...

    # -- batches ---------------------------------------------------------------------------
    @locked
    def create_batch(self, record: dict[str, Any], lines: dict[str, Any], requests: bytes | None,
                     results: Sequence[tuple[int, str, int, Any]]) -> None:
        """The record, written once, with the results its lines already have (those refused at
        creation), in one transaction."""
        values = [who(record["owner"]) if k == "owner" else
                  (None if record[k] is None else dumps(record[k])) if k in _JSON else record[k]
                  for k in BATCH_COLUMNS]
        with self._tx():
            self._x(f"INSERT INTO v1_batches ({', '.join(BATCH_COLUMNS)}, lines, requests) "
                    f"VALUES ({','.join('?' * (len(BATCH_COLUMNS) + 2))})",
                    (*values, dumps(lines), requests))
            self._insert_results(record["id"], results)

    @locked
    def batch_row(self, batch_id: str, owner: str | None, everyone: bool = False,
                  lines: bool = True) -> dict[str, Any] | None:
        """The owner's batch (anyone's with ``everyone``); its per-line lists with ``lines``."""
        sql = f"SELECT {', '.join(BATCH_COLUMNS)}{', lines' if lines else ''} FROM v1_batches WHERE id=?"
        args: list[Any] = [batch_id]
        if not everyone:
            sql += " AND owner=?"
            args.append(who(owner))
        row = self._x(sql, args).fetchone()
        if row is None:
            return None
        return _batch(row[:len(BATCH_COLUMNS)], row[-1] if lines else None)

    @locked
    def batch_lines(self, batch_id: str) -> dict[str, Any] | None:
        """{custom_ids, job_lines, lane_lines} of a batch."""
        row = self._x("SELECT lines FROM v1_batches WHERE id=?", (batch_id,)).fetchone()
        return None if row is None else dict(loads_many([row[0]])[0])

    @locked
    def list_batches(self, owner: str | None, kind: str, limit: int, after: str | None = None,
                     before: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """A page of the owner's batches of one kind, newest first: the ``limit`` older than
        ``after``, or newer than ``before`` (the nearest ones), or the newest; and whether more
        lie beyond the page in that direction."""
        where, args = "WHERE owner=? AND kind=?", [who(owner), kind]
        order = "DESC"
        mark = after or before
        if mark is not None:
            at = self._x("SELECT created FROM v1_batches WHERE id=? AND owner=? AND kind=?",
                         (mark, who(owner), kind)).fetchone()
            if at is None:
                return [], False
            cmp = "<" if after else ">"
            where += f" AND (created {cmp} ? OR (created = ? AND id {cmp} ?))"
            args += [at[0], at[0], mark]
            order = "DESC" if after else "ASC"
        rows = self._x(f"{_SELECT_BATCH} {where} ORDER BY created {order}, id {order} LIMIT ?",
                       [*args, limit + 1]).fetchall()
        page = [_batch(r) for r in rows[:limit]]
        return (page if order == "DESC" else page[::-1]), len(rows) > limit

    @locked
    def batches_created_before(self, before: int) -> list[dict[str, Any]]:
        """Everyone's batches made before ``before`` (the ones a retention sweep looks at)."""
        return [_batch(r) for r in self._x(f"{_SELECT_BATCH} WHERE created < ?", (before,))]

    @locked
    def batches_reading(self, owner: str | None, file_id: str) -> list[str]:
        """The owner's OpenAI batches whose input is ``file_id``."""
        return [r[0] for r in self._x(
            "SELECT id FROM v1_batches WHERE owner=? AND kind='openai' AND input_file_id=?",
            (who(owner), file_id))]

    @locked
    def update_batch(self, batch_id: str, column: str, value: Any) -> None:
        """One of the record's small columns: ``cancelled_at``, ``ended``, ``counts``, ``requests``."""
        assert column in ("cancelled_at", "ended", "counts", "requests")
        if column in _JSON and value is not None:
            value = dumps(value)
        self._x(f"UPDATE v1_batches SET {column}=? WHERE id=?", (value, batch_id))

    @locked
    def batch_requests(self, batch_id: str) -> bytes | None:
        row = self._x("SELECT requests FROM v1_batches WHERE id=?", (batch_id,)).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    @locked
    def delete_batch(self, batch_id: str) -> None:
        with self._tx():
            self._x("DELETE FROM v1_batch_results WHERE batch_id=?", (batch_id,))
            self._x("DELETE FROM v1_batches WHERE id=?", (batch_id,))

    # -- who runs a batch's lane lines ----------------------------------------------------
    @locked
    def owed_batches(self, now: float) -> list[str]:
        """Batches, neither cancelled nor failed whole, whose lines outside the job have not all
        ended, and which no live gateway runs (on one gateway's SQLite: none but this one)."""
        free = " AND (runner IS NULL OR runner_until < ?)" if self.shared else ""
        return [r[0] for r in self._x(
            "SELECT id FROM v1_batches b WHERE cancelled_at IS NULL AND errors IS NULL "
            "AND own_total > (SELECT COUNT(*) FROM v1_batch_results r WHERE r.batch_id = b.id)"
            + free + " ORDER BY created", (now,) if self.shared else ())]

    @locked
    def hold_batch(self, batch_id: str, runner: str, now: float, until: float,
                   renew: bool = False) -> bool:
        """Take the batch's lane lines for ``runner`` until ``until``, if no other live gateway
        holds them and the batch is not cancelled (a cancel on another replica stops the runner
        at its next renewal); True if they are this runner's. A renewal (``renew``) only extends
        a hold that has not run out: once it lapsed, another gateway may have run lines meanwhile
        (and let go), so the runner stops rather than go on from the lines it read before."""
        if renew:
            live = " AND runner_until >= ?" if self.shared else ""
            return bool(self._x(
                "UPDATE v1_batches SET runner_until=? WHERE id=? AND cancelled_at IS NULL "
                "AND runner=?" + live,
                (until, batch_id, runner, now) if self.shared else (until, batch_id, runner)).rowcount)
        if not self.shared:
            now = float("inf")  # one gateway: a hold left by its previous process is void
        return bool(self._x(
            "UPDATE v1_batches SET runner=?, runner_until=? WHERE id=? AND cancelled_at IS NULL "
            "AND (runner IS NULL OR runner=? OR runner_until < ?)",
            (runner, until, batch_id, runner, now)).rowcount)

    @locked
    def release_batch(self, batch_id: str, runner: str) -> None:
        self._x("UPDATE v1_batches SET runner=NULL, runner_until=NULL WHERE id=? AND runner=?",
                (batch_id, runner))

    # -- per-line results ------------------------------------------------------------------
    @locked
    def add_results(self, batch_id: str, rows: Sequence[tuple[int, str, int, Any]],
                    runner: str | None = None, now: float = 0.0) -> int:
        """(line, custom_id, HTTP status, body) of lines that ended; a line that already has a
        result keeps it. How many were stored. With ``runner``: only while that runner's hold is
        live at ``now`` (``HoldLost`` otherwise), checked in the same transaction as the insert."""
        with self._tx():
            if runner is not None and not self._holds(batch_id, runner, now):
                raise HoldLost(batch_id)
            return self._insert_results(batch_id, rows)

    def _holds(self, batch_id: str, runner: str, now: float) -> bool:
        """Whether ``runner`` holds the batch at ``now``. A no-op update, not a read: it locks the
        batch's row (PostgreSQL; SQLite's write lock is held already) until the transaction ends,
        so no takeover lands between this check and the insert."""
        live = " AND runner_until >= ?" if self.shared else ""
        return bool(self._x("UPDATE v1_batches SET runner=runner WHERE id=? AND runner=?" + live,
                            (batch_id, runner, now) if self.shared else (batch_id, runner)).rowcount)

    def _insert_results(self, batch_id: str, rows: Sequence[tuple[int, str, int, Any]]) -> int:
        if not rows:
            return 0
        cur = self._xm("INSERT INTO v1_batch_results VALUES (?,?,?,?,?) ON CONFLICT DO NOTHING",
                       [(batch_id, n, cid, status, dumps(body)) for n, cid, status, body in rows])
        return int(cur.rowcount)

    @locked
    def results(self, batch_id: str, lo: int = 0, hi: int | None = None,
                bodies: bool = True) -> dict[int, dict[str, Any]]:
        """Line -> {status, raw (its body's JSON text, undecoded)} of the lines from ``lo`` to
        ``hi`` with a result; without ``bodies``, {status} alone."""
        sql = f"SELECT line, status{', body' if bodies else ''} FROM v1_batch_results " \
              "WHERE batch_id=? AND line>=?"
        args: list[Any] = [batch_id, lo]
        if hi is not None:
            sql += " AND line<?"
            args.append(hi)
        rows = self._x(sql, args).fetchall()
        if bodies:
            return {r[0]: {"status": r[1], "raw": r[2]} for r in rows}
        return {r[0]: {"status": r[1]} for r in rows}

    @locked
    def result_counts(self, batch_id: str) -> tuple[int, int]:
        """(lines with a result, of which succeeded)."""
        done, ok = self._x("SELECT COUNT(*), SUM(CASE WHEN status=200 THEN 1 ELSE 0 END) "
                           "FROM v1_batch_results WHERE batch_id=?", (batch_id,)).fetchone()
        return int(done), int(ok or 0)

    @locked
    def done_lines(self, batch_id: str) -> set[int]:
        return {r[0] for r in self._x("SELECT line FROM v1_batch_results WHERE batch_id=?",
                                      (batch_id,))}
