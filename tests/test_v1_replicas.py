"""The ``/v1`` face's files and batches in the job store's PostgreSQL database (``store.url``):
any replica serves any file or batch, whichever replica it was made on, and one replica runs a
batch's lane lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import fakes
from tests.test_v1_batches import config, jsonl, line, mock_embedding, parse, until_ended
from tests.test_v1_openai import KEY

BOB = "sk-bob-test"

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio


def replica(f: Any, tmp_path: Path, url: str, n: int, lease_s: float = 1.0,
            latency_ms: float = 0) -> Any:
    data = config(f, tmp_path / f"r{n}", api_keys={"alice": KEY, "bob": BOB})  # SQLite path unused
    # the same database, on connections of their own (one process would share one otherwise)
    data["store"] = {"url": f"{url}?application_name=replica{n}", "lease_s": lease_s}
    data["providers"]["builtin"]["latency_ms"] = latency_ms
    return parse_config(data)


async def test_a_file_uploaded_on_one_replica_feeds_a_batch_made_on_another(tmp_path):
    from tests.pg_helpers import throwaway_db

    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(600)]  # more than a page of lane lines
    with throwaway_db() as db:
        async with (
            fakes() as f,
            running(replica(f, tmp_path, db, 1), port=0) as (g1, url1),
            running(replica(f, tmp_path, db, 2), port=0) as (g2, url2),
            openai.AsyncOpenAI(base_url=url1 + "/v1", api_key=KEY, max_retries=0) as one,
            openai.AsyncOpenAI(base_url=url2 + "/v1", api_key=KEY, max_retries=0) as two,
        ):
            assert g1.faces["v1_batches"].store.store() is not g2.faces["v1_batches"].store.store()
            upload = await one.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
            assert (await two.files.retrieve(upload.id)).bytes == len(jsonl(rows))
            assert [x.id async for x in two.files.list()] == [upload.id]
            batch = await two.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                             completion_window="24h")
            done = await until_ended(one, batch.id)  # its status, read on the first
            assert done.status == "completed" and done.request_counts.completed == 600
            out = parse((await one.files.content(done.output_file_id)).content)
            assert out["e599"]["response"]["body"] == mock_embedding("t599")
            assert len(out) == 600
            assert [b.id async for b in one.batches.list()] == [batch.id]
            assert batch.id not in g1.faces["v1_batches"].live  # the second ran its lines
            async with openai.AsyncOpenAI(base_url=url1 + "/v1", api_key=BOB, max_retries=0) as bob:
                with pytest.raises(openai.NotFoundError):  # another key's: not found, anywhere
                    await bob.files.retrieve(upload.id)
                assert [b.id async for b in bob.batches.list()] == []


async def test_a_replica_that_stops_mid_batch_leaves_its_lane_lines_to_another(tmp_path):
    """A replica made a batch and held its lane lines, ran one and went away without letting go
    (as if killed): another takes them over once the hold has run out, and runs the rest once."""
    from multiplexer.faces.v1.store import BatchRecord, V1Store
    from tests.pg_helpers import throwaway_db

    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(3)]
    with throwaway_db() as db:
        gone = V1Store(tmp_path / "gone.db", f"{db}?application_name=gone", lease_s=1.0)
        upload = await gone.put_file("alice", "in.jsonl", "batch", jsonl(rows))
        record = BatchRecord("batch_" + "e" * 24, "alice", "/v1/embeddings", upload.id, "24h", 1,
                             custom_ids=["e0", "e1", "e2"], lane_lines=[0, 1, 2])
        await gone.create_batch(record)
        assert await gone.hold(record.id)
        await gone.add_results(record.id, [(0, "e0", 200, {"saved": True})])
        gone.close()  # its connection ends; its hold stays until it runs out
        async with (
            fakes() as f,
            running(replica(f, tmp_path, db, 2), port=0) as (g2, url2),
            openai.AsyncOpenAI(base_url=url2 + "/v1", api_key=KEY, max_retries=0) as two,
        ):
            assert record.id not in g2.faces["v1_batches"].live  # still held: not taken at start
            assert (await two.batches.retrieve(record.id)).status == "in_progress"
            done = await until_ended(two, record.id)
            out = parse((await two.files.content(done.output_file_id)).content)
    assert done.request_counts.completed == 3
    assert out["e0"]["response"]["body"] == {"saved": True}  # not run twice
    assert out["e2"]["response"]["body"] == mock_embedding("t2")


async def test_a_cancel_on_one_replica_stops_the_lane_lines_running_on_another(tmp_path):
    from tests.pg_helpers import throwaway_db

    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(400)]
    with throwaway_db() as db:
        async with fakes() as f:
            # each lane batch of the mock takes 50 ms (the lines run for seconds); the runner
            # renews its hold every lease_s / 3, and a 2 s lease outlasts a loop starved by the
            # full suite on two cores (the cancel, not the lease, ends the run)
            slow = [replica(f, tmp_path, db, n, lease_s=2.0, latency_ms=50) for n in (1, 2)]
            async with (
                running(slow[0], port=0) as (_, url1),
                running(slow[1], port=0) as (g2, url2),
                openai.AsyncOpenAI(base_url=url1 + "/v1", api_key=KEY, max_retries=0) as one,
                openai.AsyncOpenAI(base_url=url2 + "/v1", api_key=KEY, max_retries=0) as two,
            ):
                upload = await two.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
                batch = await two.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                                 completion_window="24h")
                assert batch.id in g2.faces["v1_batches"].live
                await one.batches.cancel(batch.id)  # on the replica not running it
                done = await until_ended(one, batch.id)
                assert done.status == "cancelled"
                assert batch.id not in g2.faces["v1_batches"].live  # its runner stopped
                ran = done.request_counts.completed
                await anyio.sleep(0.5)
                assert (await one.batches.retrieve(batch.id)).request_counts.completed == ran < 400
