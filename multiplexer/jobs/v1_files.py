"""The ``/v1`` face's uploaded files in the job store's database (SQLite or PostgreSQL), written and
read a chunk at a time, so a file never has to be whole in a gateway's memory and every replica
on one ``store.url`` serves every file.

``v1_files`` has a row per file: its owner (a key's name), the team that key was in when it
uploaded, its size, when it expires, and its ``state``: ``uploading`` until its last chunk is in,
then ``processed``; only processed, unexpired files are served. ``v1_file_chunks`` holds its
bytes, ``CHUNK`` at a time, in order. ``v1_file_locks`` has a row per key and team whose quota an
upload checks: writing it first serializes two uploads of one key or team (a row lock in
PostgreSQL, the write lock in SQLite), so the usage read and the new row are one decision. An
upload in progress counts against its quotas already.

A database from before chunks is brought up to date on the first file operation, in one
transaction: its files table gains the new columns, and each file's content becomes its one chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .locked import locked

CHUNK = 1 << 20  # bytes a chunk row holds: what a write or a read of a file keeps in memory

FILE_TABLES = """
CREATE TABLE IF NOT EXISTS v1_files (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
  bytes BIGINT NOT NULL, created BIGINT NOT NULL, team TEXT NOT NULL DEFAULT '',
  expires_at BIGINT, state TEXT NOT NULL DEFAULT 'processed');
CREATE INDEX IF NOT EXISTS v1_files_owner ON v1_files(owner, created DESC, id DESC);
CREATE TABLE IF NOT EXISTS v1_file_chunks (
  file_id TEXT NOT NULL, n INTEGER NOT NULL, data {blob} NOT NULL, PRIMARY KEY (file_id, n));
CREATE TABLE IF NOT EXISTS v1_file_locks (holder TEXT PRIMARY KEY, n BIGINT NOT NULL);
"""
# on columns a database from before chunks lacks until it is brought up to date
_INDEXES = ("CREATE INDEX IF NOT EXISTS v1_files_team ON v1_files(team)",
            "CREATE INDEX IF NOT EXISTS v1_files_expiry ON v1_files(expires_at)",
            "CREATE INDEX IF NOT EXISTS v1_files_state ON v1_files(state, created)")
_UP_TO_DATE = ("ALTER TABLE v1_files ADD COLUMN team TEXT NOT NULL DEFAULT ''",
               "ALTER TABLE v1_files ADD COLUMN expires_at BIGINT",
               "ALTER TABLE v1_files ADD COLUMN state TEXT NOT NULL DEFAULT 'processed'",
               "INSERT INTO v1_file_chunks (file_id, n, data) SELECT id, 0, content FROM v1_files",
               "ALTER TABLE v1_files DROP COLUMN content")
FILE_COLUMNS = "id, owner, bytes, created, filename, purpose, expires_at"
_UNEXPIRED = "(expires_at IS NULL OR expires_at > ?)"
_SERVED = f"state='processed' AND {_UNEXPIRED}"
QUOTA_COLUMNS = ("owner", "team")  # what a quota counts by


@dataclass(frozen=True, slots=True)
class NewFile:
    id: str
    owner: str  # '' without auth (a plain ``=`` keeps the index)
    team: str  # '' without one
    filename: str
    purpose: str
    bytes: int
    created: int
    expires_at: int | None


@dataclass(frozen=True, slots=True)
class Over:
    """An upload's refusal: the quota (``column`` is ``owner`` or ``team``) it would pass."""

    column: str
    limit: int
    usage: int


class V1Files:
    """Mixed into ``JobStore`` (through ``V1Tables``): ``_x``, ``_tx`` and ``_lock`` are the store's."""

    _lock: Any
    _files_ready = False  # set on the instance once the tables are known to be up to date

    if TYPE_CHECKING:
        def _x(self, sql: str, args: Sequence[Any] = ()) -> Any: ...
        def _xm(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any: ...
        def _tx(self) -> AbstractContextManager[None]: ...

    def _files(self) -> None:
        """Bring a database from before chunks up to date, once per store (under its lock)."""
        if self._files_ready:
            return
        with self._tx():
            self._hold("tables")  # one replica, or worker, at a time
            columns = {d[0] for d in self._x("SELECT * FROM v1_files LIMIT 0").description}
            if "content" in columns:
                for sql in _UP_TO_DATE:
                    self._x(sql)
            for sql in _INDEXES:
                self._x(sql)
        self._files_ready = True

    def _hold(self, holder: str) -> None:
        """Take ``holder``'s row lock until the transaction ends (see the module's docstring)."""
        self._x("INSERT INTO v1_file_locks VALUES (?, 0) ON CONFLICT (holder) DO UPDATE SET n = excluded.n",
                (holder,))

    def _usage(self, column: str, value: str, now: int) -> int:
        assert column in QUOTA_COLUMNS
        row = self._x(f"SELECT COALESCE(SUM(bytes), 0) FROM v1_files WHERE {column}=? AND {_UNEXPIRED}",
                      (value, now)).fetchone()
        return int(row[0])

    @locked
    def reserve_file(self, new: NewFile, limits: Sequence[tuple[str, int]], now: int) -> Over | None:
        """Insert the file's row, ``uploading``, if each quota in ``limits`` (column, bytes) has
        room for it beside the unexpired files it counts already; else the first it would pass."""
        self._files()
        with self._tx():
            for column, _ in sorted(limits):
                self._hold(f"{column}:{getattr(new, column)}")
            for column, limit in limits:
                used = self._usage(column, getattr(new, column), now)
                if used + new.bytes > limit:
                    return Over(column, limit, used)
            self._x("INSERT INTO v1_files (id, owner, filename, purpose, bytes, created, team, "
                    "expires_at, state) VALUES (?,?,?,?,?,?,?,?,'uploading')",
                    (new.id, new.owner, new.filename, new.purpose, new.bytes, new.created, new.team,
                     new.expires_at))
        return None

    @locked
    def put_file_chunk(self, file_id: str, n: int, data: bytes) -> None:
        self._x("INSERT INTO v1_file_chunks VALUES (?,?,?)", (file_id, n, data))

    @locked
    def finish_file(self, file_id: str) -> None:
        """Its last chunk is in: the file is served from now on."""
        self._x("UPDATE v1_files SET state='processed' WHERE id=?", (file_id,))

    @locked
    def file_row(self, file_id: str, owner: str, now: int | None) -> tuple[Any, ...] | None:
        """(id, owner, bytes, created, filename, purpose, expires_at) of the owner's file, if it is
        served at ``now`` (None: expired or not, as long as its upload finished)."""
        self._files()
        sql = f"SELECT {FILE_COLUMNS} FROM v1_files WHERE id=? AND owner=? AND state='processed'"
        args: list[Any] = [file_id, owner]
        if now is not None:
            sql += f" AND {_UNEXPIRED}"
            args.append(now)
        row: tuple[Any, ...] | None = self._x(sql, args).fetchone()
        return row

    @locked
    def file_chunk(self, file_id: str, n: int) -> bytes | None:
        """The file's ``n``-th chunk; None past its last."""
        row = self._x("SELECT data FROM v1_file_chunks WHERE file_id=? AND n=?", (file_id, n)).fetchone()
        return None if row is None else bytes(row[0])

    @locked
    def delete_file(self, file_id: str) -> None:
        self._files()
        with self._tx():
            self._x("DELETE FROM v1_file_chunks WHERE file_id=?", (file_id,))
            self._x("DELETE FROM v1_files WHERE id=?", (file_id,))

    @locked
    def list_files(self, owner: str, purpose: str | None, now: int) -> list[tuple[Any, ...]]:
        """The owner's files served at ``now``, newest first."""
        self._files()
        sql = f"SELECT {FILE_COLUMNS} FROM v1_files WHERE owner=? AND {_SERVED}"
        args: list[Any] = [owner, now]
        if purpose is not None:
            sql += " AND purpose=?"
            args.append(purpose)
        return list(self._x(sql + " ORDER BY created DESC, id DESC", args).fetchall())

    @locked
    def file_usage(self, column: str, value: str, now: int) -> int:
        """Bytes the unexpired files of an owner or a team take (uploads in progress included)."""
        self._files()
        return self._usage(column, value, now)

    @locked
    def files_due(self, now: int, stale_before: int, limit: int) -> list[tuple[str, str]]:
        """(id, owner) of up to ``limit`` files to delete: expired at ``now``, or uploads that
        never finished, begun before ``stale_before`` (their gateway went away mid-upload)."""
        self._files()
        due = self._x("SELECT id, owner FROM v1_files WHERE expires_at <= ? ORDER BY expires_at "
                      "LIMIT ?", (now, limit)).fetchall()
        if len(due) < limit:
            due += self._x("SELECT id, owner FROM v1_files WHERE state='uploading' AND created < ? "
                           "LIMIT ?", (stale_before, limit - len(due))).fetchall()
        return [(r[0], r[1]) for r in due]
