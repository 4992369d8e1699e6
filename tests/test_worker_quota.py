"""A key's daily batch allowance under ``serve --workers N`` without ``state.url``: whole on every
worker, decided in the job store's SQLite file they share, and a refusal's ``remaining`` is what
all the workers left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.metrics import Metrics
from multiplexer.core.quota import Claim, Grant, Quotas
from multiplexer.core.worker_quota import WorkerQuotas
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.replicas import quotas_for
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.remote_helpers import fakes, remote_config_data, user

pytestmark = pytest.mark.anyio


def workers(tmp_path: Path, quota: dict[str, Any], n: int = 2) -> tuple[list[Quotas], ManualClock]:
    """``n`` workers' quotas, as each worker's gateway builds them, on one store file."""
    config = parse_config({"server": {"workers": n, "quotas": {"alice": quota}},
                           "store": {"path": str(tmp_path / "jobs.db")}})
    clock = ManualClock(wall=1_700_000_000.0)
    return [quotas_for(config, clock, None, Metrics(), share=n) for _ in range(n)], clock


def refusal(grant: Grant) -> dict[str, Any]:
    assert grant.refusal is not None, "granted"
    return grant.refusal.data


async def test_a_submit_of_the_whole_allowance_fits_whichever_worker_gets_it(tmp_path: Path) -> None:
    (a, b), clock = workers(tmp_path, {"batch_calls_per_day": 10})
    assert isinstance(a, WorkerQuotas) and a.quotas["alice"].batch_calls_per_day == 10
    whole = await a.charge("alice", 10)  # each worker held 5 of the 10 before
    over = (await b.decide([Claim("alice", call=False, batch_calls=1)]))[0]
    assert refusal(over)["limit"] == "batch_calls_per_day"
    assert (refusal(over)["remaining"], refusal(over)["allowed"]) == (0, 10)
    a.refund(whole)  # its calls never ran
    await a.flush()
    four = await b.charge("alice", 4)
    assert four.batch is not None
    seven = (await a.decide([Claim("alice", call=False, batch_calls=7)]))[0]
    assert refusal(seven)["remaining"] == 6  # what both workers left, not this one's part
    await clock.advance(86_400)  # a new UTC day: the whole allowance again
    assert (await a.charge("alice", 10)).batch is not None


async def test_a_claim_refused_by_its_workers_rpm_part_takes_no_batch_calls(tmp_path: Path) -> None:
    """All or none: the batch calls are charged in the file first and given back when this
    worker's part of the key's rpm refuses the request."""
    (a, b), _ = workers(tmp_path, {"rpm": 2, "batch_calls_per_day": 10})
    assert a.quotas["alice"].rpm == 1  # each worker's part of the rpm
    first, second = await a.decide([Claim("alice", batch_calls=3), Claim("alice", batch_calls=3)])
    assert first.refusal is None and refusal(second)["limit"] == "rpm"
    ok, over = await b.decide([Claim("alice", batch_calls=7), Claim("alice", call=False, batch_calls=1)])
    assert ok.refusal is None and refusal(over)["remaining"] == 0  # 3 + 7: the second's 3 went back


async def test_a_single_process_keeps_its_allowance_in_memory(tmp_path: Path) -> None:
    [one], _ = workers(tmp_path, {"batch_calls_per_day": 10}, n=1)
    assert type(one) is Quotas
    assert (await one.charge("alice", 10)).batch is not None
    assert not (tmp_path / "jobs.db").exists()


async def test_jobs_submit_of_the_whole_allowance_on_one_worker_and_the_truth_on_another(
        tmp_path: Path) -> None:
    """Two workers' gateways on one store file: a jobs.submit of the key's whole daily allowance
    is accepted by the first, and the second refuses one more call with what truly is left."""
    async with fakes() as f:
        data = remote_config_data(f, tmp_path)
        data["server"] = {"api_keys": {"alice": "key-a"}, "workers": 2,
                          "quotas": {"alice": {"batch_calls_per_day": 10}}}
        config = parse_config(data)
        calls = [{"method": "claude", "params": user(f"c{i}")} for i in range(10)]
        async with (
            running(config, port=0) as (_, url1),
            running(config, port=0) as (_, url2),
            Client(url1, api_key="key-a") as one,
            Client(url2, api_key="key-a") as two,
        ):
            job = await one.call("jobs.submit", {"calls": calls, "more": True})  # left open
            assert job["accepted"] == 10
            with pytest.raises(RpcError) as over:
                await two.call("jobs.submit", {"calls": calls[:1], "more": True})
    assert over.value.code == Code.RATE_LIMITED
    assert over.value.data["limit"] == "batch_calls_per_day"
    assert (over.value.data["remaining"], over.value.data["allowed"]) == (0, 10)
