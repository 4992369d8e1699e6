"""A gateway killed with SIGKILL while batch jobs are pending: the restart resumes, nothing twice.

The gateway runs as a real subprocess (``python -m multiplexer serve``); the fake
OpenAI and Anthropic servers live in this test process, so their state (every
batch ever created) survives the kill and shows what the gateway submitted.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from multiplexer.sdk.client import Client
from multiplexer.sdk.jobs import job_results, submit_job, wait_job
from tests.remote_helpers import fakes, remote_config_data, reply_text, user

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def gateway_process(config: Path, port: int) -> AsyncIterator[anyio.abc.Process]:
    """Start ``multiplexer serve`` and yield once it listens; stderr is drained into a buffer."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "multiplexer", "serve", "--config", str(config), "--port", str(port)]
    process = await anyio.open_process(cmd, cwd=str(ROOT), env=env, stdout=None)
    ready = anyio.Event()
    log: list[str] = []

    async def drain() -> None:
        assert process.stderr is not None
        async for chunk in process.stderr:
            log.append(chunk.decode(errors="replace"))
            if "listening on" in "".join(log):
                ready.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            with anyio.fail_after(60):
                while not ready.is_set():
                    if process.returncode is not None:
                        raise RuntimeError("gateway exited early:\n" + "".join(log))
                    with anyio.move_on_after(0.1):
                        await ready.wait()
            process.log = log  # type: ignore[attr-defined]
            yield process
            tg.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()


async def batches_recorded(client: Client, job_ids: list[str], expected: int) -> bool:
    """True once the gateway's store holds a remote id for ``expected`` batches of these jobs."""
    recorded = 0
    for job_id in job_ids:
        status = await client.call("jobs.status", {"job_id": job_id})
        recorded += sum(1 for b in status["batches"] if b["remote_id"])
    return recorded >= expected


async def test_sigkill_with_jobs_pending_then_restart(tmp_path):
    async with fakes(polls_to_complete=10**9) as f:
        f.anthropic.polls_to_complete = 10**9
        data = remote_config_data(f, tmp_path)
        data["server"] = {"port": 0, "grace_period_s": 1}
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump(data))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        client_calls = ([("chat", {"model": "gpt-test", **user(f"j{i}")}) for i in range(20)]
                        + [("claude", user(f"k{i}")) for i in range(5)])
        routed: dict[str, list[Any]] = {}

        async with Client(url) as client, anyio.create_task_group() as tg:
            async def route_calls(route: str, prompts: list[str]) -> None:
                routed[route] = await client.call_many([(route, user(p)) for p in prompts])

            sdk: list[Any] = []
            sdk_done = anyio.Event()

            async def sdk_wait(job_id: str) -> None:
                await wait_job(client, job_id, poll_interval=0.05, max_poll_interval=0.2)
                sdk.extend(await job_results(client, job_id, len(client_calls)))
                sdk_done.set()

            async with gateway_process(config, port) as first:
                job_id = await submit_job(client, client_calls)
                tg.start_soon(route_calls, "chat_batch", [f"r{i}" for i in range(8)])
                tg.start_soon(route_calls, "claude_batch", [f"s{i}" for i in range(4)])
                with anyio.fail_after(30):  # every batch created upstream and recorded
                    while True:
                        listed = await client.call("jobs.list", {})
                        ids = [j["job_id"] for j in listed["jobs"]]
                        if len(ids) == 3 and await batches_recorded(client, ids, 4):
                            break
                        await anyio.sleep(0.02)
                tg.start_soon(sdk_wait, job_id)
                first.send_signal(signal.SIGKILL)
                await first.wait()
            assert first.returncode == -signal.SIGKILL
            created = (f.openai.requests["/v1/batches"], f.openai.requests["/v1/files"],
                       f.anthropic.requests["/v1/messages/batches"])
            assert created == (2, 2, 2)

            f.openai.polls_to_complete = 1  # the batches may finish now
            f.anthropic.polls_to_complete = 1
            async with gateway_process(config, port) as second:
                with anyio.fail_after(60):
                    await sdk_done.wait()
                route_jobs = [j for j in (await client.call("jobs.list", {}))["jobs"]
                              if j["source"] == "route"]
                with anyio.fail_after(30):
                    for job in route_jobs:
                        await wait_job(client, job["job_id"], poll_interval=0.05)
                by_total = {j["total"]: await job_results(client, j["job_id"], j["total"])
                            for j in route_jobs}
                second.send_signal(signal.SIGTERM)
                with anyio.fail_after(30):
                    await second.wait()
            assert second.returncode == 0
            assert "resuming" in "".join(second.log)  # type: ignore[attr-defined]

    # the SDK waited across the restart and got every result, in order
    assert [reply_text(r) for r in sdk] == [f"echo: j{i}" for i in range(20)] + [
        f"echo: k{i}" for i in range(5)]
    # the callers of batch-mode routes lost their connection, but the results were kept
    assert all(isinstance(r, Exception) for r in routed["chat_batch"] + routed["claude_batch"])
    assert [reply_text(r) for r in by_total[8]] == [f"echo: r{i}" for i in range(8)]
    assert [reply_text(r) for r in by_total[4]] == [f"echo: s{i}" for i in range(4)]
    # nothing was submitted twice
    assert (f.openai.requests["/v1/batches"], f.openai.requests["/v1/files"],
            f.anthropic.requests["/v1/messages/batches"]) == (2, 2, 2)
    assert len(f.openai.batches) == 2 and len(f.anthropic.batches) == 2
