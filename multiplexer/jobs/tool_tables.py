"""MCP tools' pins and the audit of their calls, in the job store's database.

``mcp_tool_pins``: one row per (provider, tool): the definition an admin approved (or the first one
seen) and its hash, the one the upstream serves now when it differs (the tool is then quarantined).
``mcp_tool_changes``: every pin, change, approval and return to the approved definition, in order.
``mcp_tool_audit``: one row per ``tools/call`` (written in batches by the audit's record sink),
read newest first with a cursor (the row's id). SQLite (``store.path``) for one gateway,
PostgreSQL (``store.url``, schema ``store.schema``) shared by replicas.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multiplexer.jobs.sqlite_connect import connect as connect_sqlite

PINS = """CREATE TABLE IF NOT EXISTS {t}mcp_tool_pins (
  provider TEXT NOT NULL, tool TEXT NOT NULL, approved_hash TEXT NOT NULL, approved_def TEXT NOT NULL,
  seen_hash TEXT NOT NULL, seen_def TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
  PRIMARY KEY (provider, tool))"""
CHANGES = """CREATE TABLE IF NOT EXISTS {t}mcp_tool_changes (
  at DOUBLE PRECISION NOT NULL, provider TEXT NOT NULL, tool TEXT NOT NULL, action TEXT NOT NULL,
  old_hash TEXT NOT NULL, new_hash TEXT NOT NULL)"""
AUDIT_SQLITE = """CREATE TABLE IF NOT EXISTS {t}mcp_tool_audit (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at DOUBLE PRECISION NOT NULL, identity TEXT NOT NULL,
  server TEXT NOT NULL, tool TEXT NOT NULL, status TEXT NOT NULL, code INTEGER,
  duration_ms DOUBLE PRECISION NOT NULL, args_hash TEXT NOT NULL, arguments TEXT)"""
AUDIT_PG = AUDIT_SQLITE.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
AUDIT_INDEX = "CREATE INDEX IF NOT EXISTS mcp_tool_audit_at ON {t}mcp_tool_audit (at)"
AUDIT_COLUMNS = ("at", "identity", "server", "tool", "status", "code", "duration_ms", "args_hash",
                 "arguments")


FIELDS = ("name", "description", "inputSchema", "outputSchema", "annotations")  # what a pin covers


def changed_fields(approved: str, seen: str) -> list[str]:
    """Which of ``FIELDS`` differ between two canonical definitions."""
    a, b = json.loads(approved), json.loads(seen)
    return [f for f in FIELDS if a.get(f) != b.get(f)]


@dataclass(slots=True)
class Pin:
    provider: str
    tool: str
    approved_hash: str
    approved_def: str  # canonical JSON
    seen_hash: str
    seen_def: str
    updated_at: float

    @property
    def quarantined(self) -> bool:
        return self.seen_hash != self.approved_hash

    def diff(self) -> dict[str, Any]:
        """What an admin reads before approving: each changed field, approved and now."""
        a, b = json.loads(self.approved_def), json.loads(self.seen_def)
        return {f: {"approved": a.get(f), "now": b.get(f)}
                for f in changed_fields(self.approved_def, self.seen_def)}


@dataclass(slots=True)
class AuditRow:
    at: float  # Unix seconds
    identity: str  # the key's name or id, the OAuth subject; '' for a keyless caller
    server: str  # the virtual server ('' for the gateway's own /mcp)
    tool: str
    status: str  # ok, error, refused
    code: int | None  # the error's JSON-RPC code
    duration_ms: float
    args_hash: str
    arguments: str | None = None  # redacted JSON, only with audit.arguments

    def values(self) -> tuple[Any, ...]:
        return (self.at, self.identity, self.server, self.tool, self.status, self.code,
                self.duration_ms, self.args_hash, self.arguments)


class ToolTables:
    """The three tables in SQLite, on a connection of their own to the job store's file."""

    mark = "?"
    prefix = ""

    def __init__(self, path: str | Path) -> None:
        self._lock = threading.Lock()
        self.conn: Any = connect_sqlite(path)
        for table in (PINS, CHANGES, AUDIT_SQLITE, AUDIT_INDEX):
            self.conn.execute(table.format(t=self.prefix))

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return [tuple(r) for r in self.conn.execute(sql.replace("?", self.mark), tuple(args))]

    def _many(self, statements: Sequence[tuple[str, Sequence[Sequence[Any]]]]) -> None:
        with self._lock:
            self.conn.execute("BEGIN")
            try:
                for sql, rows in statements:
                    self.conn.executemany(sql.replace("?", self.mark), [tuple(r) for r in rows])
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    # -- pins ------------------------------------------------------------------------
    def pins(self, provider: str | None = None) -> list[Pin]:
        sql = (f"SELECT provider, tool, approved_hash, approved_def, seen_hash, seen_def, updated_at "
               f"FROM {self.prefix}mcp_tool_pins")
        rows = self._rows(sql + (" WHERE provider = ?" if provider else "") + " ORDER BY provider, tool",
                          (provider,) if provider else ())
        return [Pin(*r) for r in rows]

    def save(self, pins: Sequence[tuple[Pin, bool]],
             changes: Sequence[tuple[float, str, str, str, str, str]]) -> None:
        """Pins and their change rows, in one transaction. A pin saved with ``True`` was approved
        here (its row replaced whole); with ``False`` only what the upstream serves now is written
        (a new row takes its approved definition too), so a replica that saw a change never
        writes back an approved definition another replica has replaced since."""
        cols = ("provider, tool, approved_hash, approved_def, seen_hash, seen_def, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (provider, tool) DO UPDATE SET ")
        approved = (f"INSERT INTO {self.prefix}mcp_tool_pins ({cols}approved_hash = "
                    "excluded.approved_hash, approved_def = excluded.approved_def, seen_hash = "
                    "excluded.seen_hash, seen_def = excluded.seen_def, updated_at = excluded.updated_at")
        seen = (f"INSERT INTO {self.prefix}mcp_tool_pins ({cols}seen_hash = excluded.seen_hash, "
                "seen_def = excluded.seen_def, updated_at = excluded.updated_at")
        log = (f"INSERT INTO {self.prefix}mcp_tool_changes (at, provider, tool, action, old_hash, new_hash)"
               " VALUES (?, ?, ?, ?, ?, ?)")
        ordered = sorted(pins, key=lambda p: (p[0].provider, p[0].tool))
        rows = {flag: [(p.provider, p.tool, p.approved_hash, p.approved_def, p.seen_hash, p.seen_def,
                        p.updated_at) for p, was in ordered if was == flag] for flag in (True, False)}
        self._many([(approved, rows[True]), (seen, rows[False]), (log, changes)])

    def changes(self, provider: str, tool: str, limit: int = 20) -> list[tuple[Any, ...]]:
        """(at, action, old_hash, new_hash), newest first."""
        return self._rows(f"SELECT at, action, old_hash, new_hash FROM {self.prefix}mcp_tool_changes "
                          f"WHERE provider = ? AND tool = ? ORDER BY at DESC LIMIT {int(limit)}",
                          (provider, tool))

    # -- audit -----------------------------------------------------------------------
    def add_audit(self, rows: Sequence[AuditRow]) -> None:
        cols = ", ".join(AUDIT_COLUMNS)
        marks = ", ".join("?" for _ in AUDIT_COLUMNS)
        self._many([(f"INSERT INTO {self.prefix}mcp_tool_audit ({cols}) VALUES ({marks})",
                     [r.values() for r in rows])])

    def audit(self, *, identity: str | None = None, tool: str | None = None, status: str | None = None,
              since: float | None = None, until: float | None = None, before_id: int | None = None,
              limit: int = 100) -> list[tuple[Any, ...]]:
        """(id, *AUDIT_COLUMNS) newest first; ``before_id``: the page after that row (the cursor)."""
        where: list[str] = []
        args: list[Any] = []
        for column, value, op in (("identity", identity, "="), ("tool", tool, "="),
                                  ("status", status, "="), ("at", since, ">="), ("at", until, "<"),
                                  ("id", before_id, "<")):
            if value is not None:
                where.append(f"{column} {op} ?")
                args.append(value)
        sql = f"SELECT id, {', '.join(AUDIT_COLUMNS)} FROM {self.prefix}mcp_tool_audit"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return self._rows(sql + f" ORDER BY id DESC LIMIT {int(limit)}", args)

    def prune_audit(self, before: float) -> None:
        self._many([(f"DELETE FROM {self.prefix}mcp_tool_audit WHERE at < ?", [(before,)])])

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class PgToolTables(ToolTables):
    """The same tables in PostgreSQL, in the job store's schema: every replica reads and writes them."""

    mark = "%s"

    def __init__(self, url: str, schema: str) -> None:
        from multiplexer.jobs.pg_connect import connect

        self.prefix = f"{schema}."
        self._lock = threading.Lock()
        self.conn = connect(url)
        with self.conn.transaction():  # two replicas starting at once: one creates the tables
            self.conn.execute("SELECT pg_advisory_xact_lock(7345)")  # this room's own lock number
            self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            for table in (PINS, CHANGES, AUDIT_PG, AUDIT_INDEX):
                self.conn.execute(table.format(t=self.prefix))

    def _many(self, statements: Sequence[tuple[str, Sequence[Sequence[Any]]]]) -> None:
        with self._lock, self.conn.transaction(), self.conn.cursor() as cur:
            for sql, rows in statements:
                if rows:
                    cur.executemany(sql.replace("?", self.mark), [tuple(r) for r in rows])


def open_tool_tables(path: str | Path, url: str | None, schema: str) -> ToolTables:
    """A connection to this store's tables (PostgreSQL with ``url``, else the SQLite file at
    ``path``); its owner closes it."""
    if url:
        return PgToolTables(url, schema)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return ToolTables(path)
