"""A gateway killed with SIGKILL while Gemini batches run: the restart resumes, nothing twice.

The gateway is a real subprocess; the fake Gemini API lives in this test process, so its state
(every batch and file ever created) survives the kill and shows what the gateway submitted. One
batch is inline (its results come back by position, matched through the job store after the
restart), one went up as a file (results by key, shuffled).
"""

from __future__ import annotations

import signal
from typing import Any

import anyio
import pytest
import yaml

from multiplexer.sdk.client import Client
from multiplexer.sdk.jobs import job_results, submit_job, wait_job
from tests.gemini_helpers import gemini_config, gemini_fake, gemini_text, native
from tests.test_batch_restart import batches_recorded, free_port, gateway_process

pytestmark = pytest.mark.anyio


async def test_sigkill_mid_batch_then_restart_loses_nothing_and_submits_nothing_twice(tmp_path):
    async with gemini_fake(polls_to_complete=10**9) as (fake, fake_url):
        data = gemini_config(fake_url, tmp_path)
        data["server"] = {"port": 0, "grace_period_s": 1}
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump(data))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        calls = [("gbatch_file", native(f"f{i}")) for i in range(10)]
        routed: list[Any] = []

        async with Client(url) as client, anyio.create_task_group() as tg:
            async def route_calls() -> None:
                routed.extend(await client.call_many([("gbatch", native(f"i{i}")) for i in range(4)]))

            sdk: list[Any] = []
            sdk_done = anyio.Event()

            async def sdk_wait(job_id: str) -> None:
                await wait_job(client, job_id, poll_interval=0.05, max_poll_interval=0.2)
                sdk.extend(await job_results(client, job_id, len(calls)))
                sdk_done.set()

            async with gateway_process(config, port) as first:
                job_id = await submit_job(client, calls)
                tg.start_soon(route_calls)
                with anyio.fail_after(30):  # both batches created upstream and recorded
                    while True:
                        ids = [j["job_id"] for j in (await client.call("jobs.list", {}))["jobs"]]
                        if len(ids) == 2 and await batches_recorded(client, ids, 2):
                            break
                        await anyio.sleep(0.02)
                tg.start_soon(sdk_wait, job_id)
                first.send_signal(signal.SIGKILL)
                await first.wait()
            assert first.returncode == -signal.SIGKILL
            before = (len(fake.batches), len(fake.uploads), fake.requests["/upload/v1beta/files"])
            assert before == (2, 1, 2)

            fake.polls_to_complete = 1  # the batches may finish now
            async with gateway_process(config, port) as second:
                with anyio.fail_after(60):
                    await sdk_done.wait()
                route_job = next(j for j in (await client.call("jobs.list", {}))["jobs"]
                                 if j["source"] == "route")
                with anyio.fail_after(30):
                    await wait_job(client, route_job["job_id"], poll_interval=0.05)
                inline = await job_results(client, route_job["job_id"], 4)
                second.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    await second.wait()
            assert second.returncode == 0
            assert "resuming" in "".join(second.log)  # type: ignore[attr-defined]

    assert [gemini_text(r) for r in sdk] == [f"echo: f{i}" for i in range(10)]  # file: by key
    assert [gemini_text(r) for r in inline] == [f"echo: i{i}" for i in range(4)]  # inline: by position
    assert all(isinstance(r, Exception) for r in routed)  # their connection went with the gateway
    assert (len(fake.batches), len(fake.uploads), fake.requests["/upload/v1beta/files"]) == before
