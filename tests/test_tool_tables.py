"""MCP tools' pins, their changes and the tool-call audit in the job store's database: the same
answers from SQLite and from PostgreSQL (a schema of the test's own), and the audit's retention."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from multiplexer.jobs.tool_tables import AuditRow, Pin, ToolTables, open_tool_tables
from tests.pg_helpers import throwaway_schema


@pytest.fixture(params=["sqlite", "postgres"])
def tables(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ToolTables]:
    if request.param == "sqlite":
        made = open_tool_tables(tmp_path / "store.db", None, "")
        try:
            yield made
        finally:
            made.close()
        return
    with throwaway_schema() as (url, schema, conn):
        made = open_tool_tables(tmp_path / "unused.db", url, schema)
        try:
            yield made
        finally:
            made.close()
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def row(at: float, tool: str = "t", status: str = "ok", identity: str = "alice", **kw: Any) -> AuditRow:
    return AuditRow(at, identity, kw.get("server", ""), tool, status, kw.get("code"), 1.5, "h" * 64,
                    kw.get("arguments"))


def test_pins_are_replaced_whole_and_their_changes_kept_in_order(tables: ToolTables) -> None:
    first = Pin("p", "t", "a", '{"description":"x"}', "a", '{"description":"x"}', 1.0)
    tables.save([(first, False)], [(1.0, "p", "t", "pinned", "", "a")])
    changed = Pin("p", "t", "a", '{"description":"x"}', "b", '{"description":"y"}', 2.0)
    tables.save([(changed, False)], [(2.0, "p", "t", "changed", "a", "b")])
    (stored,) = tables.pins("p")
    assert stored == changed and stored.quarantined
    assert stored.diff() == {"description": {"approved": "x", "now": "y"}}
    assert tables.pins("other") == []
    approved = Pin("p", "t", "b", '{"description":"y"}', "b", '{"description":"y"}', 3.0)
    tables.save([(approved, True)], [(3.0, "p", "t", "approved", "a", "b")])
    # another replica's late write of the change it saw keeps the approval it never knew of
    tables.save([(changed, False)], [(2.5, "p", "t", "changed", "a", "b")])
    (stored,) = tables.pins("p")
    assert not stored.quarantined and stored.approved_hash == "b"
    assert [c[1] for c in tables.changes("p", "t")] == ["approved", "changed", "changed", "pinned"]


def test_audit_filters_cursor_and_retention(tables: ToolTables) -> None:
    now = time.time()
    tables.add_audit([row(now - 100 * 86400), row(now - 10, tool="a", status="refused", code=-32003),
                      row(now - 5, identity="bob"), row(now, arguments='{"w":1}')])
    newest = tables.audit(limit=10)
    assert len(newest) == 4 and newest[0][-1] == '{"w":1}' and newest[0][0] > newest[1][0]
    assert [r[4] for r in tables.audit(status="refused")] == ["a"]
    assert [r[2] for r in tables.audit(identity="bob")] == ["bob"]
    assert len(tables.audit(since=now - 60)) == 3 and len(tables.audit(until=now - 60)) == 1
    page = tables.audit(limit=2)
    rest = tables.audit(limit=2, before_id=page[-1][0])
    assert [r[0] for r in page + rest] == [r[0] for r in newest]
    tables.prune_audit(now - 90 * 86400)
    assert len(tables.audit(limit=10)) == 3
