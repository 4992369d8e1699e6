"""The spend table, in SQLite and PostgreSQL: batches add up, reports group and filter by day
and key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from multiplexer.money.spend_store import PgSpendStore, SpendStore
from tests.pg_helpers import throwaway_schema

ROW = ("2026-12-01", "alice", "research", "chat", "gpt-4o", 2, 5000, 1000, 0, 0, 1000, 0, 0, 1000, 300, 100,
       40, 1, 7, 3)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpendStore]:
    if request.param == "sqlite":
        s = SpendStore(tmp_path / "jobs.db")
        yield s
        s.close()
        return
    with throwaway_schema() as (url, schema, _):
        s = PgSpendStore(url, schema)
        yield s
        s.close()


def test_batches_add_up_and_reports_group_by_day(store: SpendStore) -> None:
    other = ("2026-12-02", "bob", "", "embed", "text-embedding-3-small", 1, 20, 0, 1, 0, 0, 0, 0, 500, 8, 0,
             0, 0, 0, 9)
    store.add([ROW, other])
    store.add([ROW])  # the same group again: summed, not a second row
    assert store.query(["key"], "2026-12-01", "2026-12-02") == [
        ("alice", 4, 10000, 2000, 0, 0, 2000, 0, 0, 2000, 600, 200, 80, 2, 14, 6),
        ("bob", 1, 20, 0, 1, 0, 0, 0, 0, 500, 8, 0, 0, 0, 0, 9)]
    assert store.query(["team", "route"], "2026-12-02", "2026-12-02") == [
        ("", "embed", 1, 20, 0, 1, 0, 0, 0, 0, 500, 8, 0, 0, 0, 0, 9)]
    assert store.query([], "2026-11-01", "2026-11-30") == [(None,) * 15]
    # one key's own rows (a caller's dashboard view): never another key's
    assert store.query(["route"], "2026-12-01", "2026-12-02", key="bob") == [
        ("embed", 1, 20, 0, 1, 0, 0, 0, 0, 500, 8, 0, 0, 0, 0, 9)]
    assert store.query([], "2026-12-01", "2026-12-02", key="carol") == [(None,) * 15]
    store.prune("2026-12-02")
    assert [r[0] for r in store.query(["day"], "2026-01-01", "2026-12-31")] == ["2026-12-02"]
