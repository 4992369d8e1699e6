"""A gateway killed with SIGKILL while Azure OpenAI, Mistral and Together batches run: the
restart resumes them, loses nothing and submits nothing twice (the approach of
test_batch_restart.py: the gateway a real subprocess, the fakes in this process)."""

from __future__ import annotations

import signal
from typing import Any

import anyio
import pytest
import yaml

from multiplexer.sdk.client import Client
from multiplexer.sdk.jobs import job_results, submit_job, wait_job
from tests.remote_helpers import reply_text, user
from tests.test_batch_restart import batches_recorded, free_port, gateway_process
from tests.vendor_helpers import vendor_config_data, vendor_fakes

pytestmark = pytest.mark.anyio


def created(v: Any) -> tuple[int, ...]:
    """(batches, uploaded input files) of Azure, Mistral and Together."""
    def inputs(fake: Any) -> int:
        return sum(1 for f in fake.files.values() if f.purpose in ("batch", "batch-api"))
    return (len(v.azure.batches), inputs(v.azure), len(v.mistral.jobs), inputs(v.mistral),
            len(v.together.batches), inputs(v.together))


async def test_sigkill_mid_batch_then_restart_on_azure_mistral_and_together(tmp_path):
    async with vendor_fakes() as v:
        for fake in (v.azure, v.mistral, v.together):
            fake.polls_to_complete = 10**9
        data = vendor_config_data(v, tmp_path)
        data["server"] = {"port": 0, "grace_period_s": 1}
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump(data))
        port = free_port()
        calls = ([("az_chat", user(f"a{i}")) for i in range(8)]
                 + [("mis_chat", user(f"m{i}")) for i in range(5)]
                 + [("tog_chat", user(f"t{i}")) for i in range(3)])
        async with Client(f"http://127.0.0.1:{port}") as client:
            async with gateway_process(config, port) as first:
                job_id = await submit_job(client, calls)
                with anyio.fail_after(30):  # the three remote batches created and recorded
                    while not await batches_recorded(client, [job_id], 3):
                        await anyio.sleep(0.02)
                first.send_signal(signal.SIGKILL)
                await first.wait()
            assert first.returncode == -signal.SIGKILL
            before = created(v)
            assert before == (1, 1, 1, 1, 1, 1)

            for fake in (v.azure, v.mistral, v.together):
                fake.polls_to_complete = 1
            async with gateway_process(config, port) as second:
                with anyio.fail_after(60):
                    await wait_job(client, job_id, poll_interval=0.05, max_poll_interval=0.2)
                results = await job_results(client, job_id, len(calls))
                second.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    await second.wait()
            assert "resuming" in "".join(second.log)  # type: ignore[attr-defined]

    assert [reply_text(r) for r in results] == (
        [f"echo: a{i}" for i in range(8)] + [f"echo: m{i}" for i in range(5)]
        + [f"echo: t{i}" for i in range(3)])
    # nothing submitted twice: one batch (and one input file) per vendor, as before the kill
    assert created(v) == before
    assert [j.status for j in v.mistral.jobs.values()] == ["SUCCESS"]
    assert [b.status for b in v.azure.batches.values()] == ["completed"]  # sent as "Completed"
