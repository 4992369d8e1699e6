"""Batch jobs on the one SQLite file of ``serve --workers N``: each part driven by the one worker
that claims it (``multiplexer/jobs/sqlite_shared.py``), as replicas do on PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from multiplexer.jobs import stores
from multiplexer.jobs.sqlite_shared import SharedSqliteStore
from multiplexer.jobs.store import JobStore, LeaseLost
from tests.test_batch_store import Wall, new


def two_workers_on_one_part(db: Path, wall: Wall) -> tuple[SharedSqliteStore, SharedSqliteStore]:
    """Workers ``a`` and ``b`` (two connections, as two processes have) on one file, a job of one
    item in one part, "part"."""
    a = SharedSqliteStore(db, lease_s=30, wall=wall, owner="a")
    b = SharedSqliteStore(db, lease_s=30, wall=wall, owner="b")
    a.create_job("job", None, "client", "running")
    a.add_items("job", [new(0)])
    a.create_parts("job", "p", 0, [("part", [0])])
    return a, b


def test_one_worker_drives_each_part_and_a_stale_one_is_fenced_off(tmp_path: Path) -> None:
    wall = Wall()
    a, b = two_workers_on_one_part(tmp_path / "j.db", wall)
    assert a.claim_part("part") and not b.claim_part("part")  # a drives it; b keeps off
    assert b.unclaimed_parts("p") == []
    a.mark_submitting("part", 1.0)
    wall.t += 20
    assert a.renew_claims() == []  # a is alive: lease extended to +30 from now
    wall.t += 25
    assert not b.claim_part("part")
    wall.t += 10  # a's worker was killed (or paused past its lease): b takes the part over
    assert b.unclaimed_parts("p") == ["part"] and b.claim_part("part")
    b.mark_submitted("part", "batch_b")
    with pytest.raises(LeaseLost):
        a.mark_submitted("part", "batch_a")  # a stale write cannot land
    assert not a.claim_part("part")
    part = b.part("part")
    assert part is not None and part.remote_id == "batch_b"
    assert a.renew_claims() == []  # a holds nothing
    a.close()
    b.close()


def test_a_handed_back_claim_is_taken_at_once_and_a_taken_over_one_is_left_alone(tmp_path: Path) -> None:
    wall = Wall()
    a = SharedSqliteStore(tmp_path / "j.db", lease_s=30, wall=wall, owner="a")
    b = SharedSqliteStore(tmp_path / "j.db", lease_s=30, wall=wall, owner="b")
    a.create_job("job", None, "client", "running")
    a.add_items("job", [new(0), new(1)])
    a.create_parts("job", "p", 0, [("one", [0]), ("two", [1])])
    assert a.claim_part("one") and a.claim_part("two")
    wall.t += 31
    assert b.claim_part("two")
    wall.t -= 31
    assert not b.claim_part("one")
    assert a.release_claims(["one", "two", "never-claimed"]) == ["one"]
    assert b.unclaimed_parts("p") == ["one"] and b.claim_part("one")  # no wait for the lease
    rows = {r[0]: r[1:] for r in a._x("SELECT part_id, owner, epoch FROM part_claims").fetchall()}
    assert rows == {"one": ("b", 2), "two": ("b", 2)}
    assert a.release_claims(["one", "two"]) == []
    a.close()
    b.close()


def test_a_done_part_is_never_claimed(tmp_path: Path) -> None:
    wall = Wall()
    a, b = two_workers_on_one_part(tmp_path / "j.db", wall)
    assert a.claim_part("part")
    a.finish_part("part", "completed", None)
    assert not b.claim_part("part") and b.unclaimed_parts("p") == []
    a.close()
    b.close()


def test_a_worker_opens_the_shared_store_and_a_lone_gateway_the_plain_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lone = stores.acquire(tmp_path / "lone.db")
    assert type(lone) is JobStore and not lone.shared
    stores.release(lone)
    monkeypatch.setenv(stores.WORKER_ENV, '{"index": 0, "count": 2, "folder": "/nowhere"}')
    worker = stores.acquire(tmp_path / "worker.db", lease_s=12)
    assert isinstance(worker, SharedSqliteStore) and worker.shared and worker.lease_s == 12
    stores.release(worker)


@pytest.mark.anyio
async def test_a_killed_workers_batch_part_is_adopted_and_submitted_once(tmp_path: Path) -> None:
    """Two workers on one SQLite file: the worker that took a job is killed with its batch
    upstream; the other adopts the part once its lease ran out, the job ends with every result,
    and the batch was created upstream once."""
    import signal

    import anyio
    import yaml

    from tests.remote_helpers import fakes, remote_config_data, reply_text, user
    from tests.test_workers import connections_to_both, supervised

    async with fakes(polls_to_complete=10**9) as f:
        data = remote_config_data(f, tmp_path)
        data["server"] = {"port": 0, "grace_period_s": 1, "access_log": False}
        data["store"]["lease_s"] = 2
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump(data))
        async with supervised(config) as (_, url, log):
            conns = await connections_to_both(url, 8)
            (client, victim), (other, _) = conns[0], next(c for c in conns if c[1] != conns[0][1])
            calls = [{"method": "chat", "params": {"model": "gpt-test", **user(f"j{i}")}} for i in range(6)]
            body = {"jsonrpc": "2.0", "method": "jobs.submit", "params": {"calls": calls}, "id": 1}
            job_id = (await client.post(f"{url}/rpc", json=body)).json()["result"]["job_id"]

            async def status() -> dict[str, object]:
                ask = {"jsonrpc": "2.0", "method": "jobs.status", "params": {"job_id": job_id}, "id": 2}
                return (await other.post(f"{url}/rpc", json=ask)).json()["result"]

            with anyio.fail_after(30):  # the batch is created upstream and recorded
                while not any(b["remote_id"] for b in (await status())["batches"]):  # type: ignore[attr-defined]
                    await anyio.sleep(0.02)
            os.kill(victim, signal.SIGKILL)
            await log.wait_for("exited with code -9: starting it again")
            f.openai.polls_to_complete = 1  # the batch may finish now
            with anyio.fail_after(60):
                while not (await status())["done"]:
                    await anyio.sleep(0.05)
            ask = {"jsonrpc": "2.0", "method": "jobs.results", "params": {"job_id": job_id}, "id": 3}
            results = (await other.post(f"{url}/rpc", json=ask)).json()["result"]["results"]
            for c, _ in conns:
                await c.aclose()
        assert f.openai.requests["/v1/batches"] == 1  # adopted, never submitted again
        assert sorted(reply_text(r["result"]) for r in results) == sorted(
            f"echo: j{i}" for i in range(6))
