"""A batch job's life in the log (submitted, remote batch id, progress, end) and in ``/metrics``
(open jobs, items by state, items in ``calls_total`` once)."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.remote_helpers import Events, fakes, remote_config_data, user
from tests.test_metrics import sample

pytestmark = pytest.mark.anyio


def chat(text: str) -> dict[str, object]:
    return {"method": "chat", "params": {"model": "gpt-test", **user(text)}}


async def test_a_jobs_life_is_logged_and_its_items_counted_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with fakes() as f:
        events = Events()
        async with running(parse_config(remote_config_data(f, tmp_path)), port=0) as (gw, url), \
                Client(url) as client, httpx.AsyncClient() as http:
            gw.listeners.append(events)
            job = await client.call("jobs.submit", {"calls": [chat("a"), chat("b FAIL")], "more": True})
            open_text = (await http.get(f"{url}/metrics")).text
            await client.call("jobs.submit", {"job_id": job["job_id"], "calls": [chat("c")]})
            await events.wait("batch_job_ended")
            routed = await client.call_many([("chat_batch", user(f"r{i}")) for i in range(3)])
            text = (await http.get(f"{url}/metrics")).text
    job_id = job["job_id"]
    assert sample(open_text, "multiplexer_batch_jobs_open") == 1
    assert sample(open_text, "multiplexer_batch_items", state="pending") == 2
    assert sample(text, "multiplexer_batch_jobs_open") == 0
    assert sample(text, "multiplexer_batch_items", state="pending") == 0
    assert sample(text, "multiplexer_calls_total", route="chat", outcome="ok") == 2
    assert sample(text, "multiplexer_calls_total", route="chat", outcome="-32000") == 1
    assert len(routed) == 3  # a batch route's calls: counted as the gateway answers them, not again
    assert sample(text, "multiplexer_calls_total", route="chat_batch", outcome="ok") == 3
    assert sample(text, "multiplexer_calls_total", route="jobs.submit", outcome="ok") == 2

    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if job_id in r.getMessage()]
    messages = [m for _, _, m in said]
    assert all(level == logging.INFO for _, level, _ in said)
    assert messages[0] == f"batch job {job_id}: 2 call(s) submitted (client) by key -; more to come"
    assert messages[1] == f"batch job {job_id}: 1 call(s) added by key -"
    remote = next(iter(f.openai.batches))
    assert any(m.startswith(f"oai: batch job {job_id}: part {job_id}.") and
               m.endswith(f" is remote batch {remote}") for m in messages)
    progress = [m for m in messages if f"remote batch {remote} is " in m]
    assert progress
    assert progress[-1].startswith(f"oai: batch job {job_id}: remote batch {remote} is completed")
    assert messages[-1] == f"batch job {job_id} done: 2 succeeded, 1 failed"


async def test_a_failed_remote_batch_is_logged_with_why_and_its_items_counted_as_errors(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with fakes(force_status="failed") as f:
        events = Events()
        async with running(parse_config(remote_config_data(f, tmp_path)), port=0) as (gw, url), \
                Client(url) as client:
            gw.listeners.append(events)
            job = await client.call("jobs.submit", {"calls": [chat("a"), chat("b")]})
            await events.wait("batch_job_ended")
            text = gw.metrics.render().decode()
    job_id = job["job_id"]
    messages = [r.getMessage() for r in caplog.records if job_id in r.getMessage()]
    failed = [m for m in messages if " failed (failed): " in m]
    assert len(failed) == 1 and failed[0].startswith(f"oai: batch job {job_id}: part {job_id}.")
    assert failed[0].endswith("failure forced by the test")
    assert messages[-1] == f"batch job {job_id} done: 0 succeeded, 2 failed"
    assert sample(text, "multiplexer_calls_total", route="chat", outcome="-32000") == 2
