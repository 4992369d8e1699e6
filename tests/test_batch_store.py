"""The SQLite job store and part planning: what a restart relies on."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from multiplexer.core.jobrows import NewItem
from multiplexer.jobs.store import JobStore
from multiplexer.jobs.stores import acquire, release
from providers.batch.backend import Planned, plan_parts
from tests.pg_helpers import throwaway_db, throwaway_schema

if TYPE_CHECKING:
    from multiplexer.jobs.pg_store import PgJobStore


def new(idx, provider="p", state="queued", error=None):
    return NewItem(idx, provider, "r", "chat", "m", {"model": "x", "n": idx}, {"mode": "batch"}, 3,
                   f"job-{idx}", state, error, split='["x"]')


def test_plan_parts_splits_by_key_count_and_bytes():
    items = [Planned(i, "a" if i < 7 else "b", 10) for i in range(10)]
    assert plan_parts(items, max_requests=3, max_bytes=1000) == [[0, 1, 2], [3, 4, 5], [6], [7, 8, 9]]
    assert plan_parts(items, max_requests=100, max_bytes=25) == [[0, 1], [2, 3], [4, 5], [6], [7, 8], [9]]
    assert plan_parts([Planned(0, None, 5000)], 10, 100) == [[0]]  # an oversize line still goes


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request, tmp_path):
    if request.param == "sqlite":
        yield JobStore(tmp_path / "j.db")
        return
    from multiplexer.jobs.pg_store import PgJobStore

    with throwaway_db() as url:
        st = PgJobStore(url)
        yield st
        st.close()


def test_job_life_cycle(any_store):
    st = any_store
    st.create_job("job", "alice", "client", "open")
    assert st.add_items("job", [new(i) for i in range(4)] + [new(4, None, "failed", {"code": 1})]) == 5
    assert st.job("job").total == 5
    assert [idx for idx, _, _ in st.unplanned("job", "p")] == [0, 1, 2, 3]
    st.set_job_state("job", "running", ("open",))
    assert st.jobs_with_unplanned("p") == ["job"]
    st.create_parts("job", "p", 0, [("part1", [0, 1]), ("part2", [2, 3])])
    assert st.jobs_with_unplanned("p") == []
    assert [p.id for p in st.open_parts("p")] == ["part1", "part2"]

    st.mark_submitting("part1", 123.0)
    part = st.part("part1")
    assert part.state == "submitting" and part.intent_wall == 123.0 and part.remote_id is None
    st.mark_submitted("part1", "batch_1")
    assert st.part("part1").remote_id == "batch_1"
    assert st.claimed_remote_ids("p") == {"batch_1"}
    assert st.counts("job") == {"queued": 2, "submitted": 2, "succeeded": 0, "failed": 1}
    st.ping()
    assert st.gauges() == (1, {"queued": 2, "submitted": 2, "failed": 1})  # /metrics: open jobs' items

    assert st.record("job", [(0, "succeeded", {"ok": 0}, None), (1, "failed", None, {"code": -1})]) == 2
    # a late duplicate never overwrites a finished item
    assert st.record("job", [(0, "failed", None, {"code": -2})]) == 0
    assert st.page("job", 0, 2) == [(0, "succeeded", {"ok": 0}, None, "r"),
                                    (1, "failed", None, {"code": -1}, "r")]
    assert st.finish_job_if_done("job") is None
    st.finish_part("part1", "completed", None)
    assert st.fail_open("job", {"code": -3}, "part2") == 2
    assert st.finish_job_if_done("job") == "done"
    assert st.job("job").state == "done"
    assert st.gauges() == (0, {})
    assert sorted(st.tally("job"), key=str) == [("r", -1, 1), ("r", -3, 2), ("r", 1, 1), ("r", None, 1)]
    assert [s for s, _, _ in st.outcomes("job", 5)] == ["succeeded", "failed", "failed", "failed",
                                                         "failed"]
    assert st.list_jobs("alice", 10)[0].id == "job" and st.list_jobs(None, 10) == []
    assert st.purge(st.wall() + 1) == ["job"] and st.job("job") is None


def test_state_survives_reopening(tmp_path):
    st = JobStore(tmp_path / "j.db")
    st.create_job("job", None, "route", "running")
    st.add_items("job", [new(0)])
    st.create_parts("job", "p", 0, [("part", [0])])
    st.mark_submitting("part", 1.0)
    st.close()
    again = JobStore(tmp_path / "j.db")
    assert again.part("part").state == "submitting"
    assert [i.custom_id for i in again.part_items("part")] == ["job-0"]
    again.close()


def test_cancel_fails_only_unplanned_items_of_one_provider(tmp_path):
    st = JobStore(tmp_path / "j.db")
    st.create_job("job", None, "client", "running")
    st.add_items("job", [new(0, "a"), new(1, "a"), new(2, "b")])
    st.create_parts("job", "a", 0, [("pa", [0])])
    assert st.fail_open("job", {"code": -32004}, None, "a", True) == 1
    assert st.counts("job") == {"queued": 2, "submitted": 0, "succeeded": 0, "failed": 1}
    st.close()


def test_acquire_shares_one_connection_per_file(tmp_path):
    a = acquire(tmp_path / "s.db")
    b = acquire(tmp_path / "s.db")
    assert a is b
    release(a)
    a.create_job("still-open", None, "client", "open")  # still held by b
    release(b)
    c = acquire(tmp_path / "s.db")
    assert c is not a and c.job("still-open") is not None
    release(c)


def tables_in(conn, schema: str) -> list[str]:
    return sorted(r[0] for r in conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema=%s", (schema,)))


def test_postgres_tables_live_in_the_configured_schema_created_if_missing():
    from multiplexer.jobs.pg_store import PgJobStore

    with throwaway_schema() as (url, schema, admin):
        public = tables_in(admin, "public")
        st = PgJobStore(url, schema=schema)
        try:
            st.create_job("job", None, "client", "open")
            assert tables_in(admin, schema) == ["items", "jobs", "parts", "v1_batch_results",
                                                "v1_batches", "v1_file_chunks", "v1_file_locks",
                                                "v1_files"]
            assert tables_in(admin, "public") == public  # nothing landed in public
            assert admin.execute(f"SELECT id FROM {schema}.jobs").fetchall() == [("job",)]
        finally:
            st.close()


def test_the_default_schema_is_multiplexer():
    from multiplexer.jobs.pg_store import PgJobStore

    with throwaway_db() as url:
        st = PgJobStore(url)
        try:
            assert st._x("SELECT current_schema()").fetchone() == ("multiplexer",)
            assert st._x("SELECT to_regclass('public.jobs')").fetchone() == (None,)
        finally:
            st.close()


@pytest.mark.anyio
async def test_the_gateway_opens_its_store_in_store_schema(tmp_path):
    from multiplexer.gateway.config import parse_config
    from multiplexer.gateway.gateway import Gateway

    with throwaway_schema() as (url, schema, admin):
        config = parse_config({
            "store": {"url": url, "schema": schema, "path": str(tmp_path / "unused.db")},
            "providers": {"oai": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}},
            "routes": {"chat": {"provider": "oai", "operation": "chat"}}})
        async with Gateway(config):
            assert tables_in(admin, schema) == ["items", "jobs", "parts", "v1_batch_results",
                                                "v1_batches", "v1_file_chunks", "v1_file_locks",
                                                "v1_files"]


def test_stores_in_two_schemas_of_one_database_keep_their_jobs_apart(tmp_path):
    with throwaway_schema() as (url, one, _), throwaway_schema() as (_, two, _):
        a = acquire(tmp_path / "unused.db", url, schema=one)
        assert acquire(tmp_path / "unused.db", url, schema=one) is a  # one connection per schema
        b = acquire(tmp_path / "unused.db", url, schema=two)
        try:
            assert b is not a
            a.create_job("job", None, "client", "open")
            assert a.job("job") is not None and b.job("job") is None
        finally:
            release(a)
            release(a)
            release(b)


def test_unplanned_reports_split_key_and_size_and_many_results_decode_together(tmp_path):
    st = JobStore(tmp_path / "j.db")
    st.create_job("job", None, "route", "running")
    st.add_items("job", [new(0), new(1)])
    assert st.unplanned("job", "p") == [(0, '["x"]', len('{"model":"x","n":0}')),
                                        (1, '["x"]', len('{"model":"x","n":1}'))]
    st.record("job", [(1, "succeeded", {"k": [1, "é"]}, None)])
    assert st.outcomes("job", 2) == [("queued", None, None), ("succeeded", {"k": [1, "é"]}, None)]
    st.close()


def test_text_a_lone_surrogate_cannot_hold_is_stored_escaped() -> None:
    from multiplexer.core.jobrows import dumps
    from multiplexer.core.jsonrpc import is_unicode

    assert dumps({"q": "é"}) == '{"q":"é"}'  # readable where it can be
    escaped = dumps({"q": "\ud800é"})
    assert is_unicode(escaped) and json.loads(escaped) == {"q": "\ud800é"}
    assert not is_unicode("\ud800")


def test_retention_soak_keeps_the_database_flat(tmp_path):
    from benchmarks.soak_retention import soak

    r = soak(hours=30, retention_h=10, jobs_per_hour=4, items=20, tmp=tmp_path)
    assert r["jobs_left"] == 4 * 10  # exactly the jobs inside the retention window
    at_retention = r["sizes"][10]
    # past one retention period the file stops growing: freed pages are reused
    assert r["after_retention_max"] <= at_retention * 1.05
    assert r["sizes"][-1] <= r["sizes"][15] * 1.02


def test_delete_and_purge_take_items_and_parts_along(tmp_path):
    st = JobStore(tmp_path / "j.db", wall=lambda: 100.0)
    for job in ("a", "b", "c"):
        st.create_job(job, None, "client", "running")
        st.add_items(job, [new(0)])
        st.create_parts(job, "p", 0, [(f"{job}.1", [0])])
    st.set_job_state("a", "done")
    st.set_job_state("b", "cancelled")
    assert st.purge(before=100.0) == []  # ended exactly at 'before': not older
    assert sorted(st.purge(before=101.0)) == ["a", "b"]  # c is running: kept
    assert st.delete_job("c") and not st.delete_job("c")
    assert [st._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("jobs", "items", "parts")] \
        == [0, 0, 0]


class Wall:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def two_replicas_on_one_part(url: str, wall: Wall) -> tuple[PgJobStore, PgJobStore]:
    """Replicas ``a`` and ``b`` on one PostgreSQL store, a job of one item in one part, "part"."""
    from multiplexer.jobs.pg_store import PgJobStore

    a = PgJobStore(url, lease_s=30, wall=wall, owner="a")
    b = PgJobStore(url, lease_s=30, wall=wall, owner="b")
    a.create_job("job", None, "client", "running")
    a.add_items("job", [new(0)])
    a.create_parts("job", "p", 0, [("part", [0])])
    return a, b


def test_one_replica_drives_each_part_and_a_stale_one_is_fenced_off():
    from multiplexer.jobs.store import LeaseLost

    wall = Wall()
    with throwaway_db() as url:
        a, b = two_replicas_on_one_part(url, wall)
        assert a.claim_part("part") and not b.claim_part("part")  # a drives it; b keeps off
        assert b.unclaimed_parts("p") == []
        a.mark_submitting("part", 1.0)
        wall.t += 20
        assert a.renew_claims() == []  # a is alive: lease extended to +30 from now
        wall.t += 25
        assert not b.claim_part("part")
        wall.t += 10  # a paused past its lease: b takes the part over
        assert b.unclaimed_parts("p") == ["part"] and b.claim_part("part")
        b.mark_submitted("part", "batch_b")
        with pytest.raises(LeaseLost):
            a.mark_submitted("part", "batch_a")  # a wakes up: its stale write cannot land
        assert not a.claim_part("part")  # b holds it, alive
        assert b.part("part").remote_id == "batch_b"
        a.close()
        b.close()


def test_a_handed_back_claim_is_taken_at_once_and_a_taken_over_one_is_left_alone():
    from multiplexer.jobs.pg_store import PgJobStore

    wall = Wall()
    with throwaway_db() as url:
        a = PgJobStore(url, lease_s=30, wall=wall, owner="a")
        b = PgJobStore(url, lease_s=30, wall=wall, owner="b")
        a.create_job("job", None, "client", "running")
        a.add_items("job", [new(0), new(1)])
        a.create_parts("job", "p", 0, [("one", [0]), ("two", [1])])
        assert a.claim_part("one") and a.claim_part("two")
        wall.t += 31  # a paused past its lease on "two": b takes it over
        assert b.claim_part("two")
        wall.t -= 31  # back to when a's lease on "one" still holds for another 30 s
        assert not b.claim_part("one")

        assert a.release_claims(["one", "two", "never-claimed"]) == ["one"]
        assert b.unclaimed_parts("p") == ["one"] and b.claim_part("one")  # no wait for the lease
        rows = {r[0]: r[1:] for r in a._x("SELECT id, owner, epoch FROM parts").fetchall()}
        assert rows == {"one": ("b", 2), "two": ("b", 2)}  # b's claims, untouched by a's hand-back
        assert b.renew_claims() == []
        assert a.release_claims(["one", "two"]) == []  # a holds nothing any more
        a.close()
        b.close()


def test_the_sqlite_store_has_no_claims_to_hand_back(tmp_path):
    st = JobStore(tmp_path / "j.db")
    assert st.claim_part("any") and st.release_claims(["any"]) == []  # one gateway drives all
    st.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_two_stores_appending_to_one_open_job_get_disjoint_numbers(kind, tmp_path):
    """Two replicas appending to one open job at once: every item lands, numbered 0..n-1 once;
    a job sealed meanwhile takes no more."""
    import threading
    from contextlib import ExitStack

    with ExitStack() as stack:
        if kind == "sqlite":
            a, b = JobStore(tmp_path / "j.db"), JobStore(tmp_path / "j.db")
        else:
            from multiplexer.jobs.pg_store import PgJobStore

            url = stack.enter_context(throwaway_db())
            a, b = PgJobStore(url), PgJobStore(url)
        stack.callback(a.close)
        stack.callback(b.close)
        a.create_job("job", "alice", "client", "open")
        bases: list[int | None] = []

        def append(st: JobStore) -> None:
            for _ in range(10):
                bases.append(st.append_items("job", [new(i) for i in range(7)]))

        threads = [threading.Thread(target=append, args=(st,)) for st in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(bases) == list(range(0, 140, 7))
        assert a.job("job").total == 140
        assert [idx for idx, *_ in a.page("job", 0, 1000)] == list(range(140))
        assert b.set_job_state("job", "running", ("open",))
        assert a.append_items("job", [new(0)]) is None and a.job("job").total == 140


def test_a_stale_replica_stays_fenced_off_after_the_new_owner_hands_the_part_back():
    """a was paused past its lease; b took the part over, submitted it and stopped cleanly (its
    claim handed back). a wakes: its epoch is stale, so its write must not land on b's work."""
    from multiplexer.jobs.store import LeaseLost

    wall = Wall()
    with throwaway_db() as url:
        a, b = two_replicas_on_one_part(url, wall)
        assert a.claim_part("part")
        a.mark_submitting("part", 1.0)
        wall.t += 31
        assert b.claim_part("part")
        b.mark_submitted("part", "batch_b")
        assert b.release_claims(["part"]) == ["part"]
        with pytest.raises(LeaseLost):
            a.mark_submitted("part", "batch_a")
        assert b.part("part").remote_id == "batch_b"
        a.close()
        b.close()


def test_enqueued_counts_the_providers_unended_batches_and_their_tokens(any_store):
    """What the vendors' quotas see (max_active_batches, max_enqueued_tokens per model)."""
    st = any_store
    st.create_job("job", None, "client", "running")
    other_model = NewItem(5, "p", "r", "chat", "m", {"model": "y"}, {"mode": "batch"}, 4, "job-5",
                          "queued", None, split='["y"]')
    st.add_items("job", [new(i) for i in range(5)] + [other_model, new(6)])
    st.create_parts("job", "p", 0, [("a", [0, 1]), ("b", [2, 3]), ("c", [4]), ("d", [5])])
    for part in ("a", "b", "c", "d"):
        assert st.claim_part(part)
    st.mark_submitting("a", 1.0)
    st.mark_submitted("a", "r1")
    st.mark_submitting("d", 1.0)
    assert st.enqueued("p", "b") == (2, 6, 6)  # a and d not ended; a's 6 tokens share b's model
    assert st.enqueued("p", "a") == (1, 0, 6)
    assert st.enqueued("q", "b") == (0, 0, 6)
    st.finish_part("a", "completed", None)
    assert st.enqueued("p", "b") == (1, 0, 6)
    assert st.unplanned_tokens("job", "p") == {6: 3}
    assert st.part_operation("c") == "chat" and st.part_operation("nope") is None


def test_reroute_moves_only_unfinished_items_of_the_part_and_only_once(any_store):
    """A part whose batch failed whole: its unfinished items go, unplanned, to the fallback's
    provider in one write; the succeeded one stays; a second move finds nothing."""
    st = any_store
    st.create_job("job", None, "client", "running")
    st.add_items("job", [new(i, "a") for i in range(3)])
    st.create_parts("job", "a", 0, [("p1", [0, 1, 2])])
    st.record("job", [(0, "succeeded", {"ok": 1}, None)])
    moves = [NewItem(i, "b", "chat_b", "chat", "m", {"n": i, "model": "gpt-b"}, {"live": True}, 1,
                     f"job-{i}", split='"live"') for i in range(3)]
    assert st.reroute("p1", "job", moves) == 2
    assert st.reroute("p1", "job", moves) == 0  # out of the part now: never moved twice
    assert st.jobs_with_unplanned("b") == ["job"] and st.jobs_with_unplanned("a") == []
    assert [r[0] for r in st.unplanned("job", "b")] == [1, 2]
    st.create_parts("job", "b", 0, [("p2", [1, 2])])
    assert st.part_live("p2") and not st.part_live("p1")
    assert [(i, route) for i, *_, route in st.page("job", 0, 3)] == [(0, "r"), (1, "chat_b"), (2, "chat_b")]
    assert json.loads(st.part_items("p2")[0].params) == {"n": 1, "model": "gpt-b"}


def test_a_stale_replica_cannot_move_a_parts_items():
    from multiplexer.jobs.store import LeaseLost

    wall = Wall()
    with throwaway_db() as url:
        a, b = two_replicas_on_one_part(url, wall)
        assert a.claim_part("part")
        wall.t += 31  # a paused past its lease: b took the part over
        assert b.claim_part("part")
        moved = NewItem(0, "q", "r2", "chat", "m", {}, {}, 1, "job-0")
        with pytest.raises(LeaseLost):
            a.reroute("part", "job", [moved])
        assert b.part_items("part")[0].route == "r"  # nothing moved
        assert b.reroute("part", "job", [moved]) == 1
        a.close()
        b.close()
