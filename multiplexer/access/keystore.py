"""Keys, teams and the admin audit log in the job store's database (SQLite at ``store.path``, or
PostgreSQL at ``store.url`` in ``store.schema``, shared by replicas): tables of their own.

A key is kept as the SHA-256 of itself (hex) and a short display prefix; the plaintext exists
only in the answer that created or rotated it. A rotated key keeps its old digest until
``old_valid_until``. Revoking stamps ``revoked_at``: the row stays, for the audit trail. The
methods block (one connection, one lock); async code calls them through ``run``.

Every change is one ``UPDATE`` of only the columns it names, checked in its own ``WHERE``
(``revoked_at IS NULL``) and returning the row as written, in one transaction with its audit
row: never a row read, edited in memory and written back whole, which would undo a revocation
(or any other field) committed in between by another request or replica. Settings kept as JSON
are changed field by field in the database (``json_set`` / ``json_remove`` in SQLite, ``||`` and
``-`` on ``jsonb`` in PostgreSQL).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

from multiplexer.jobs.locked import locked
from multiplexer.jobs.store import transaction

T = TypeVar("T")

TABLES = """
CREATE TABLE IF NOT EXISTS access_teams (
  id TEXT PRIMARY KEY, access TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
  updated DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS access_keys (
  id TEXT PRIMARY KEY, name TEXT NOT NULL, prefix TEXT NOT NULL, digest TEXT NOT NULL UNIQUE,
  team TEXT, access TEXT NOT NULL, expires_at DOUBLE PRECISION, created DOUBLE PRECISION NOT NULL,
  updated DOUBLE PRECISION NOT NULL, revoked_at DOUBLE PRECISION, old_digest TEXT,
  old_valid_until DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS access_audit (
  id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
  target TEXT, detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS access_audit_at ON access_audit(at DESC, id DESC);
CREATE TABLE IF NOT EXISTS access_mcp_servers (
  id TEXT PRIMARY KEY, spec TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
  updated DOUBLE PRECISION NOT NULL);
"""
KEY_COLUMNS = ("id", "name", "prefix", "digest", "team", "access", "expires_at", "created",
               "updated", "revoked_at", "old_digest", "old_valid_until")
_KEYS = f"SELECT {', '.join(KEY_COLUMNS)} FROM access_keys"


@dataclass(slots=True)
class KeyRow:
    id: str
    name: str
    prefix: str
    digest: str  # hex SHA-256 of the key
    team: str | None
    access: dict[str, Any]  # Access fields as JSON
    expires_at: float | None
    created: float
    updated: float
    revoked_at: float | None = None
    old_digest: str | None = None
    old_valid_until: float | None = None

    @classmethod
    def of(cls, row: Sequence[Any]) -> KeyRow:
        values = dict(zip(KEY_COLUMNS, row, strict=True))
        values["access"] = json.loads(values["access"])
        return cls(**values)


@dataclass(slots=True)
class TeamRow:
    id: str
    access: dict[str, Any]
    created: float
    updated: float


@dataclass(slots=True)
class AuditRow:
    id: str
    at: float
    actor: str
    action: str
    target: str | None
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Change:
    """What one PATCH writes: whole columns, and single fields of the row's JSON settings (set to
    a value, or removed)."""

    columns: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    cleared: tuple[str, ...] = ()


KEY_CHANGEABLE = frozenset({"name", "team", "expires_at"})
_KEY_RETURNING = f" RETURNING {', '.join(KEY_COLUMNS)}"


class KeyStore:
    """SQLite; ``PgKeyStore`` below speaks PostgreSQL with the same methods."""

    shared = False

    def __init__(self, path: str | Path) -> None:
        self._lock = threading.RLock()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                   timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(TABLES)

    def _x(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._db.execute(sql, args)

    def _tx(self) -> contextlib.AbstractContextManager[None]:
        return transaction(self._db)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- keys --------------------------------------------------------------------------------
    @locked
    def add_key(self, row: KeyRow, audit: AuditRow) -> None:
        with self._tx():
            self._x(f"INSERT INTO access_keys ({', '.join(KEY_COLUMNS)}) VALUES "
                    f"({', '.join('?' * len(KEY_COLUMNS))})",
                    (row.id, row.name, row.prefix, row.digest, row.team, json.dumps(row.access),
                     row.expires_at, row.created, row.updated, row.revoked_at, row.old_digest,
                     row.old_valid_until))
            self._audit(audit)

    @locked
    def key(self, key_id: str) -> KeyRow | None:
        row = self._x(f"{_KEYS} WHERE id=?", (key_id,)).fetchone()
        return KeyRow.of(row) if row else None

    @locked
    def keys(self, team: str | None = None, *, live_only: bool = False) -> list[KeyRow]:
        sql, args = _KEYS + " WHERE 1=1", []
        if team is not None:
            sql += " AND team=?"
            args.append(team)
        if live_only:
            sql += " AND revoked_at IS NULL"
        return [KeyRow.of(r) for r in self._x(sql + " ORDER BY created, id", args).fetchall()]

    def _key_write(self, sets: str, args: Sequence[Any], key_id: str, audit: AuditRow) -> KeyRow | None:
        """One ``UPDATE`` of a key that is not revoked, with its audit row: the key as written, or
        None (nothing written) when no unrevoked key has this id."""
        with self._tx():
            row = self._x(f"UPDATE access_keys SET {sets} WHERE id=? AND revoked_at IS NULL"
                          + _KEY_RETURNING, (*args, key_id)).fetchone()
            if row is None:
                return None
            self._audit(audit)
        return KeyRow.of(row)

    @locked
    def change_key(self, key_id: str, change: Change, updated: float, audit: AuditRow) -> KeyRow | None:
        """A PATCH: the columns and settings fields it names, nothing else."""
        unknown = set(change.columns) - KEY_CHANGEABLE
        assert not unknown, unknown  # column names are code's, never a request's
        sets = [f"{column}=?" for column in change.columns]
        access, access_args = self._merged("access", change)
        args = [*change.columns.values(), *access_args, updated]
        return self._key_write(", ".join([*sets, f"access={access}", "updated=?"]), args, key_id, audit)

    @locked
    def rotate_key(self, key_id: str, new_digest: str, prefix: str, old_valid_until: float | None,
                   updated: float, audit: AuditRow) -> KeyRow | None:
        """The new digest in; the one it replaces (as the row holds it now) kept until
        ``old_valid_until``, or dropped at once when that is None."""
        keep = old_valid_until is not None
        sets = ("old_digest=CASE WHEN ? THEN digest END, old_valid_until=?, digest=?, prefix=?, "
                "updated=?")
        return self._key_write(sets, (keep, old_valid_until, new_digest, prefix, updated), key_id, audit)

    @locked
    def revoke_key(self, key_id: str, at: float, audit: AuditRow) -> KeyRow | None:
        """Stamp ``revoked_at``; None when the key is unknown or already revoked (nothing written)."""
        return self._key_write("revoked_at=?, updated=?", (at, at), key_id, audit)

    def _merged(self, column: str, change: Change) -> tuple[str, list[Any]]:
        """SQL for ``column``'s JSON with ``change``'s settings fields set and cleared."""
        expr, args = column, []
        if change.settings:
            expr = f"json_set({expr}{', ?, json(?)' * len(change.settings)})"
            for name, value in change.settings.items():
                args += [f"$.{name}", json.dumps(value)]
        if change.cleared:
            expr = f"json_remove({expr}{', ?' * len(change.cleared)})"
            args += [f"$.{name}" for name in change.cleared]
        return expr, args

    # -- teams -------------------------------------------------------------------------------
    @locked
    def add_team(self, row: TeamRow, audit: AuditRow) -> bool:
        """False when a team of that name exists."""
        with self._tx():
            if self._x("SELECT 1 FROM access_teams WHERE id=?", (row.id,)).fetchone():
                return False
            self._x("INSERT INTO access_teams VALUES (?,?,?,?)",
                    (row.id, json.dumps(row.access), row.created, row.updated))
            self._audit(audit)
        return True

    @locked
    def team(self, team_id: str) -> TeamRow | None:
        row = self._x("SELECT id, access, created, updated FROM access_teams WHERE id=?",
                      (team_id,)).fetchone()
        return TeamRow(row[0], json.loads(row[1]), row[2], row[3]) if row else None

    @locked
    def teams(self) -> list[TeamRow]:
        rows = self._x("SELECT id, access, created, updated FROM access_teams ORDER BY id").fetchall()
        return [TeamRow(r[0], json.loads(r[1]), r[2], r[3]) for r in rows]

    @locked
    def change_team(self, team_id: str, change: Change, updated: float, audit: AuditRow) -> TeamRow | None:
        """A PATCH of a team's settings fields; None (nothing written) for an unknown team."""
        return self._settings_write("access_teams", "access", team_id, change, updated, audit)

    def _settings_write(self, table: str, column: str, row_id: str, change: Change, updated: float,
                        audit: AuditRow) -> TeamRow | None:
        merged, args = self._merged(column, change)
        with self._tx():
            row = self._x(f"UPDATE {table} SET {column}={merged}, updated=? WHERE id=? "
                          f"RETURNING id, {column}, created, updated", (*args, updated, row_id)).fetchone()
            if row is None:
                return None
            self._audit(audit)
        return TeamRow(row[0], json.loads(row[1]), row[2], row[3])

    # -- virtual MCP servers (their specs as JSON: tools, keys, teams) --------------------------
    @locked
    def add_server(self, row: TeamRow, audit: AuditRow) -> bool:
        """False when a server of that name exists."""
        with self._tx():
            if self._x("SELECT 1 FROM access_mcp_servers WHERE id=?", (row.id,)).fetchone():
                return False
            self._x("INSERT INTO access_mcp_servers VALUES (?,?,?,?)",
                    (row.id, json.dumps(row.access), row.created, row.updated))
            self._audit(audit)
        return True

    @locked
    def servers(self) -> list[TeamRow]:
        rows = self._x("SELECT id, spec, created, updated FROM access_mcp_servers ORDER BY id").fetchall()
        return [TeamRow(r[0], json.loads(r[1]), r[2], r[3]) for r in rows]

    @locked
    def change_server(self, server_id: str, change: Change, updated: float,
                      audit: AuditRow) -> TeamRow | None:
        """A PATCH of a virtual server's spec fields; None (nothing written) for an unknown one."""
        return self._settings_write("access_mcp_servers", "spec", server_id, change, updated, audit)

    @locked
    def delete_server(self, server_id: str, audit: AuditRow) -> bool:
        with self._tx():
            gone = self._x("DELETE FROM access_mcp_servers WHERE id=?", (server_id,)).rowcount > 0
            if gone:
                self._audit(audit)
        return gone

    # -- audit -------------------------------------------------------------------------------
    def _audit(self, row: AuditRow) -> None:
        self._x("INSERT INTO access_audit VALUES (?,?,?,?,?,?)",
                (row.id, row.at, row.actor, row.action, row.target, json.dumps(row.detail)))

    @locked
    def record(self, row: AuditRow) -> None:
        """An audit row of its own (a config reload), with no key or team written beside it."""
        with self._tx():
            self._audit(row)

    @locked
    def audit(self, limit: int = 100, target: str | None = None) -> list[AuditRow]:
        sql, args = "SELECT id, at, actor, action, target, detail FROM access_audit", []
        if target is not None:
            sql += " WHERE target=?"
            args.append(target)
        rows = self._x(sql + " ORDER BY at DESC, id DESC LIMIT ?", [*args, limit]).fetchall()
        return [AuditRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    @locked
    def ping(self) -> None:
        self._x("SELECT 1").fetchone()


class PgKeyStore(KeyStore):
    """The same tables in PostgreSQL (``store.url``), in the job store's schema."""

    shared = True

    def __init__(self, url: str, schema: str) -> None:
        self.url, self.schema = url, schema
        self._lock = threading.RLock()
        self._sql: dict[str, str] = {}
        self._conn = self._connect(create=True)

    def _connect(self, create: bool = False) -> Any:
        from psycopg import sql

        from multiplexer.jobs.pg_connect import connect

        conn = connect(self.url)
        name = sql.Identifier(self.schema)
        with conn.transaction():
            if create:
                conn.execute("SELECT pg_advisory_xact_lock(7338)")  # one replica creates the tables
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(name))
            conn.execute(sql.SQL("SET search_path TO {}").format(name))
            if create:
                conn.execute(TABLES)
        return conn

    def _x(self, sql: str, args: Sequence[Any] = ()) -> Any:
        if self._conn.closed:  # the server went away and came back: a new connection
            self._conn = self._connect()
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = sql.replace("?", "%s")
        return self._conn.execute(out, args)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        with self._conn.transaction():
            yield

    def _merged(self, column: str, change: Change) -> tuple[str, list[Any]]:
        """The column holds JSON as text: merged as ``jsonb`` (``||`` replaces the top-level fields
        it names, ``-`` drops fields) and stored back as text."""
        expr, args = f"{column}::jsonb", list[Any]()
        if change.settings:
            expr = f"({expr} || ?::jsonb)"
            args.append(json.dumps(change.settings))
        if change.cleared:
            expr = f"({expr} - ?::text[])"
            args.append(list(change.cleared))
        return f"{expr}::text", args

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_store(path: str | Path, url: str | None, schema: str) -> KeyStore:
    return PgKeyStore(url, schema) if url else KeyStore(path)
