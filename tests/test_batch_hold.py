"""One gateway at a time runs a batch's lane lines, on the real stores: a hold that lapsed is not
renewed, a runner's rows land only while it holds the batch, and a replica whose store
connection broke stops its page before another replica takes the batch over."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import MonotonicClock
from multiplexer.faces.v1.store import BatchRecord, V1Store
from multiplexer.jobs.line_runner import HoldLost, LineRunner
from multiplexer.jobs.store import JobStore
from tests.pg_helpers import admin, throwaway_db, throwaway_schema

pytestmark = pytest.mark.anyio
BATCH = "batch_" + "d" * 24
ROW = [(0, "a", 200, {"x": 1})]


@contextlib.contextmanager
def two_replicas(kind: str, tmp_path: Path) -> Iterator[tuple[JobStore, JobStore]]:
    """Two connections to one store that several gateways share: PostgreSQL (replicas) or one
    SQLite file (the workers of ``serve --workers N``)."""
    if kind == "postgresql":
        from multiplexer.jobs.pg_store import PgJobStore

        with throwaway_schema() as (url, schema, _):
            a, b = PgJobStore(url, schema=schema), PgJobStore(url, schema=schema)
            try:
                yield a, b
            finally:
                a.close()
                b.close()
    else:
        from multiplexer.jobs.sqlite_shared import SharedSqliteStore

        a, b = SharedSqliteStore(tmp_path / "jobs.db"), SharedSqliteStore(tmp_path / "jobs.db")
        try:
            yield a, b
        finally:
            a.close()
            b.close()


def new_batch(st: JobStore) -> None:
    record = {"id": BATCH, "owner": "alice", "kind": "openai", "endpoint": "/v1/embeddings",
              "input_file_id": "file-x", "completion_window": "24h", "created": 1, "metadata": None,
              "total": 2, "own_total": 2, "job_id": None, "errors": None, "cancelled_at": None,
              "ended": {}, "counts": None, "runner_until": None}
    st.create_batch(record, {"custom_ids": ["a", "b"], "job_lines": [], "lane_lines": [0, 1]}, None, [])


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_rows_land_only_while_their_runner_holds_the_batch(kind: str, tmp_path: Path) -> None:
    with two_replicas(kind, tmp_path) as (a, b):
        new_batch(a)
        assert a.hold_batch(BATCH, "A", 100.0, 130.0)
        assert not b.hold_batch(BATCH, "B", 110.0, 140.0)  # A's, and live
        assert a.add_results(BATCH, ROW, "A", 129.0) == 1
        with pytest.raises(HoldLost):  # A's hold ran out at 130: its page is refused
            a.add_results(BATCH, [(1, "b", 200, {"x": 2})], "A", 131.0)
        assert not a.hold_batch(BATCH, "A", 131.0, 161.0, renew=True)  # nor renewed
        assert b.hold_batch(BATCH, "B", 131.0, 161.0)  # another gateway takes it over
        with pytest.raises(HoldLost):
            b.add_results(BATCH, [(1, "b", 200, {"x": 2})], "A", 132.0)
        assert b.add_results(BATCH, [(1, "b", 200, {"x": 3})], "B", 132.0) == 1
        b.release_batch(BATCH, "B")  # B is done and lets go: the batch is nobody's
        assert not a.hold_batch(BATCH, "A", 133.0, 163.0, renew=True)  # A's lapsed hold stays lost
        with pytest.raises(HoldLost):
            a.add_results(BATCH, ROW, "A", 133.0)
        assert a.results(BATCH, bodies=False) == {0: {"status": 200}, 1: {"status": 200}}
        assert a.results(BATCH)[1]["raw"] == '{"x":3}'  # B's row, never A's late one


def test_one_gateways_own_hold_has_no_lapse(tmp_path: Path) -> None:
    """On one gateway's SQLite file there is no other gateway: its hold is its own however late
    a renewal comes, and a previous process's hold is void."""
    st = JobStore(tmp_path / "jobs.db")
    try:
        new_batch(st)
        assert st.hold_batch(BATCH, "old", 100.0, 130.0)
        assert st.hold_batch(BATCH, "A", 101.0, 131.0)  # a restart: the old process's hold is void
        assert st.hold_batch(BATCH, "A", 500.0, 530.0, renew=True)
        assert st.add_results(BATCH, ROW, "A", 500.0) == 1
        with pytest.raises(HoldLost):
            st.add_results(BATCH, ROW, "old", 500.0)
    finally:
        st.close()


class Upstream:
    """The gateway as the runner sees it: each call's line is noted; ``stuck`` pages run until
    cancelled (a long page upstream)."""

    def __init__(self, name: str, events: list[tuple[str, str, list[int]]], stuck: bool) -> None:
        self.clock = MonotonicClock()
        self.name, self.events, self.stuck = name, events, stuck
        self.running, self.cancelled = anyio.Event(), anyio.Event()

    async def submit_many(self, calls: Sequence[Call]) -> list[Outcome]:
        lines = [c.params["n"] for c in calls]
        self.events.append((self.name, "sent", lines))
        self.running.set()
        if self.stuck:
            try:
                await anyio.sleep_forever()
            finally:
                self.events.append((self.name, "cancelled", lines))
                self.cancelled.set()
        return [Outcome(result={"by": self.name, "n": n}) for n in lines]

    def start_background(self, fn: Any, *args: Any) -> None:
        raise AssertionError("not used here")


def plan(record: Any, body: dict[str, Any]) -> tuple[Call, Any]:
    return Call("embed", {"n": body["n"]}), None


def answer(record: Any, outcome: Outcome, how: Any) -> tuple[int, Any]:
    return 200, outcome.result


async def test_a_replica_whose_store_connection_breaks_stops_before_another_takes_its_batch(
        tmp_path: Path) -> None:
    """Replica A's connection to PostgreSQL is cut while the server stays up for B: A cannot renew
    its hold, so at its deadline it calls off its running page; B takes the batch once the hold
    has run out and runs every line once. No line runs on both at the same time."""
    lease = 0.5
    events: list[tuple[str, str, list[int]]] = []
    bodies = [{"n": n} for n in range(4)]
    with throwaway_db() as db:
        a = V1Store(tmp_path / "a.db", f"{db}?application_name=replica_a", lease_s=lease)
        b = V1Store(tmp_path / "b.db", f"{db}?application_name=replica_b", lease_s=lease)
        try:
            record = BatchRecord(BATCH, "alice", "/v1/embeddings", "file-x", "24h", 1,
                                 custom_ids=["a", "b", "c", "d"], lane_lines=[0, 1, 2, 3])
            await a.create_batch(record)
            up_a, up_b = Upstream("a", events, stuck=True), Upstream("b", events, stuck=False)

            async def gone(_: Any) -> None:
                return None

            runner_a = LineRunner(up_a, a, plan, answer, gone)
            runner_b = LineRunner(up_b, b, plan, answer, gone)
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(runner_a.run_lines, record, bodies, runner_a.reserve(record))
                    await up_a.running.wait()
                    with admin() as conn:  # the server goes on; only A's connection ends
                        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     "WHERE application_name = 'replica_a'")
                    await up_a.cancelled.wait()  # A's renewals fail: its page is called off
                while BATCH not in await b.owed():  # the hold runs out (wall time)
                    await anyio.sleep(0.05)
                again = await b.batch(BATCH, None, everyone=True)
                assert again is not None
                await runner_b.run_lines(again, bodies, runner_b.reserve(again))
            results = await b.results(BATCH)
        finally:
            a.close()
            b.close()
    assert events == [("a", "sent", [0, 1, 2, 3]), ("a", "cancelled", [0, 1, 2, 3]),
                      ("b", "sent", [0, 1, 2, 3])]
    assert {n: r["raw"] for n, r in results.items()} == {
        n: f'{{"by":"b","n":{n}}}' for n in range(4)}
