"""A gateway that stops cleanly hands its batch claims back: the next one resumes them at once.

On PostgreSQL a replica drives a part under a lease (``store.lease_s``, 30 s by
default); a crash leaves the claim to lapse, a clean stop (leaving the gateway's
context, or SIGTERM) clears it. The proof is in the store's rows, not in wall
time: the part's owner is cleared when the first gateway stops, and the second
gateway's claim is taken before the first one's lease would have run out. On
SQLite one gateway owns the file and there are no claims: a restart drives its
parts at once all the same.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.pg_helpers import throwaway_db
from tests.remote_helpers import Events, fakes, remote_config_data, reply_text, user
from tests.test_batch_restart import batches_recorded, free_port, gateway_process

pytestmark = pytest.mark.anyio

LEASE_S = 30.0  # store.lease_s's default, which this test leaves as it is
CALLS = [{"method": "chat", "params": {"model": "gpt-test", **user(f"c{i}")}} for i in range(3)]


@contextmanager
def store_for(kind: str, tmp_path: Path) -> Iterator[str | None]:
    """A throwaway PostgreSQL database (its URL), or None: SQLite at the config's path."""
    with ExitStack() as stack:
        yield stack.enter_context(throwaway_db()) if kind == "postgres" else None


def part_rows(db: str | None) -> list[tuple[Any, ...]]:
    """(state, remote_id, owner, lease_until, epoch) of every part; [] on SQLite (no claims)."""
    if db is None:
        return []
    import psycopg

    with psycopg.connect(db) as conn:
        return conn.execute("SELECT state, remote_id, owner, lease_until, epoch"
                            " FROM multiplexer.parts ORDER BY id").fetchall()


async def first_gateway_in_process(config_data: dict[str, Any], tmp_path: Path) -> tuple[str, list[Any]]:
    """Submit a job, let its batch be created upstream, read the claim, leave the context."""
    events = Events()
    gateway = Gateway(parse_config(config_data))
    gateway.listeners.append(events)
    async with running(gateway.config, port=0, gateway=gateway) as (_, url):
        async with Client(url) as client:
            job = await client.call("jobs.submit", {"calls": CALLS})
        with anyio.fail_after(30):
            await events.wait("batch_submitted")
        held = part_rows(config_data["store"].get("url"))
    return job["job_id"], held


async def first_gateway_process(config_data: dict[str, Any], tmp_path: Path) -> tuple[str, list[Any]]:
    """The same with ``multiplexer serve`` in a subprocess, stopped by SIGTERM."""
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({**config_data, "server": {"port": 0, "grace_period_s": 1}}))
    port = free_port()
    async with Client(f"http://127.0.0.1:{port}") as client, \
            gateway_process(config, port) as process:
        job = await client.call("jobs.submit", {"calls": CALLS})
        with anyio.fail_after(30):
            while not await batches_recorded(client, [job["job_id"]], 1):
                await anyio.sleep(0.02)  # across processes there is no event to wait on
        held = part_rows(config_data["store"].get("url"))
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            await process.wait()
    assert process.returncode == 0
    return job["job_id"], held


@pytest.mark.parametrize(("kind", "stop"), [("sqlite", "context"), ("postgres", "context"),
                                            ("postgres", "sigterm")])
async def test_a_clean_stop_hands_the_batch_back_and_the_next_gateway_resumes_it_at_once(
        kind: str, stop: str, tmp_path: Path) -> None:
    with store_for(kind, tmp_path) as db:
        async with fakes(polls_to_complete=10**9) as f:  # never done while the first gateway runs
            data = remote_config_data(f, tmp_path)
            if db is not None:
                data["store"] = {"url": db}  # lease_s left at its default
            first = first_gateway_in_process if stop == "context" else first_gateway_process
            job_id, held = await first(data, tmp_path)
            if db is not None:  # the clean stop cleared the claim, and only the claim
                ((state, remote_id, owner, lease_until, epoch),) = held
                assert state == "submitted" and remote_id in f.openai.batches
                assert owner and epoch == 1
                assert part_rows(db) == [("submitted", remote_id, None, None, 1)]

            f.openai.polls_to_complete = 1  # the batch may finish now
            events = Events()
            gateway = Gateway(parse_config(data))
            gateway.listeners.append(events)  # before it starts: resuming begins in __aenter__
            async with running(gateway.config, port=0, gateway=gateway) as (_, url):
                with anyio.fail_after(30):  # a hang guard: resuming after the lease would take 30 s
                    await events.wait("batch_job_ended")
                async with Client(url) as client:
                    page = await client.call("jobs.results", {"job_id": job_id})
            resumed = part_rows(db)

    assert [reply_text(r["result"]) for r in page["results"]] == ["echo: c0", "echo: c1", "echo: c2"]
    assert len(f.openai.batches) == 1  # picked up where it stopped: polled, never resubmitted
    assert not any(name == "batch_submitted" for name, _ in events.seen)
    if db is None:
        return
    ((state2, remote2, owner2, lease_until2, epoch2),) = resumed
    assert (state2, remote2, epoch2) == ("done", remote_id, 2) and owner2 not in (None, owner)
    # claimed (lease_until - lease_s) while the first gateway's lease still had time to run
    assert lease_until2 - LEASE_S < lease_until
