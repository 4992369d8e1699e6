"""Three gateways share Gemini batch jobs through one PostgreSQL job store: any replica answers
for a job, one drives each batch, and a replica that dies mid-batch has it taken over (polled,
never created again), its inline results matched by position from the shared store."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.gemini_helpers import gemini_config, gemini_fake, gemini_text, native
from tests.pg_helpers import throwaway_db
from tests.remote_helpers import Events

pytestmark = pytest.mark.anyio


def replica(url: str, tmp_path: Path, db: str, n: int, lease_s: float = 30.0) -> Any:
    data = gemini_config(url, tmp_path / f"r{n}")
    # the same database, on connections of their own (one process would share one otherwise)
    data["store"] = {"url": f"{db}?application_name=replica{n}", "lease_s": lease_s}
    return parse_config(data)


async def test_three_replicas_share_one_gemini_batch_job(tmp_path):
    with throwaway_db() as db:
        async with gemini_fake() as (fake, url), AsyncExitStack() as stack:
            events = Events()
            urls = []
            for n in range(3):
                gw, gw_url = await stack.enter_async_context(running(replica(url, tmp_path, db, n), port=0))
                gw.listeners.append(events)
                urls.append(gw_url)
            c1, c2, c3 = [await stack.enter_async_context(Client(u)) for u in urls]
            job = await c1.call("jobs.submit", {"calls": [
                {"method": "gbatch", "params": native(f"q{i}")} for i in range(5)]
                + [{"method": "gbatch_file", "params": native(f"r{i}")} for i in range(3)]})
            seen = await c2.call("jobs.status", {"job_id": job["job_id"]})
            await events.wait("batch_job_ended")
            page = await c3.call("jobs.results", {"job_id": job["job_id"]})
            listed = await c2.call("jobs.list", {})
    assert seen["total"] == 8
    assert [gemini_text(r["result"]) for r in page["results"]] == (
        [f"echo: q{i}" for i in range(5)] + [f"echo: r{i}" for i in range(3)])
    assert [j["job_id"] for j in listed["jobs"]] == [job["job_id"]]
    assert len(fake.batches) == 2  # one inline, one file: each driven by one replica, created once
    assert sum(1 for e, _ in events.seen if e == "batch_submitted") == 2


async def test_a_replica_that_dies_mid_batch_has_it_taken_over(tmp_path):
    with throwaway_db() as db:
        async with gemini_fake(polls_to_complete=10**9) as (fake, url):
            first, others = Events(), Events()
            async with AsyncExitStack() as stack:
                urls = []
                for n in (2, 3):
                    # the live replicas' leases outlast a starved loop under the full suite; only
                    # the one that dies needs a short lease, for the takeover to come soon
                    gw, gw_url = await stack.enter_async_context(
                        running(replica(url, tmp_path, db, n, lease_s=2.0), port=0))
                    gw.listeners.append(others)
                    urls.append(gw_url)
                async with running(replica(url, tmp_path, db, 1, lease_s=0.6), port=0) as (g1, url1):
                    g1.listeners.append(first)
                    async with Client(url1) as c1:
                        job = await c1.call("jobs.submit", {"calls": [
                            {"method": "gbatch", "params": native(f"d{i}")} for i in range(3)]})
                        await first.wait("batch_submitted")
                # the first replica is gone; the fake may finish the batch now
                fake.polls_to_complete = 1
                await others.wait("batch_job_ended")
                async with Client(urls[1]) as c3:
                    page = await c3.call("jobs.results", {"job_id": job["job_id"]})
    assert [gemini_text(r["result"]) for r in page["results"]] == ["echo: d0", "echo: d1", "echo: d2"]
    assert len(fake.batches) == 1  # taken over where it stopped: polled, never created again
    assert not any(e == "batch_submitted" for e, _ in others.seen)
