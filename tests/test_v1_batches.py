"""OpenAI's Files and Batch API on the gateway, driven by the ``openai`` SDK: lines for a
provider with a batch API ride its batch API (the fake's), other lines run through their lanes;
output and error files in OpenAI's format, one line per custom_id."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from providers.mock import unit_vector
from tests.quota_helpers import Claims, batch_claim, frozen, request_claim
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, ask, v1_config

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio


def config(f: Any, tmp_path: Path, **server: Any) -> dict[str, Any]:
    data = v1_config(f, tmp_path, **server)
    # no batch API: its lines use the lanes
    data["providers"]["builtin"] = {"kind": "mock", "dimensions": 4}
    data["routes"]["mock_embed"] = {"provider": "builtin", "operation": "embeddings",
                                    "models": ["mock-embed"]}
    return data


def mock_embedding(text: str) -> dict[str, Any]:
    """The mock provider's answer to one line of ``text`` (vectors are a hash of the text)."""
    return {"object": "list", "model": "mock-embed",
            "data": [{"object": "embedding", "index": 0, "embedding": unit_vector(text, 4)}],
            "usage": {"prompt_tokens": len(text.split()), "total_tokens": len(text.split())}}


@asynccontextmanager
async def gateway(tmp_path: Path, **server: Any):
    async with (
        fakes() as f,
        running(parse_config(config(f, tmp_path, **server)), port=0) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client,
    ):
        yield f, gw, client


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def line(cid: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


async def until_ended(client: Any, batch_id: str) -> Any:
    with anyio.fail_after(20):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                return batch
            await anyio.sleep(0.02)  # polling, as an SDK user does; the end is asserted, not timed


def parse(content: bytes) -> dict[str, dict[str, Any]]:
    rows = [json.loads(x) for x in content.splitlines()]
    return {r["custom_id"]: r for r in rows}


async def test_chat_batch_through_the_providers_batch_api(tmp_path):
    async with gateway(tmp_path) as (f, _, client):
        rows = [line(f"q{i}", {"model": "gpt-4o-mini", "messages": ask(f"question {i}")})
                for i in range(6)]
        rows.append(line("bad", {"model": "gpt-4o-mini", "messages": ask("please FAIL")}))
        rows.append(line("nomodel", {"model": "gpt-unknown", "messages": ask("x")}))
        upload = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        assert upload.purpose == "batch" and upload.bytes == len(jsonl(rows))
        assert (await client.files.retrieve(upload.id)).id == upload.id
        batch = await client.batches.create(input_file_id=upload.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"run": "1"})
        assert batch.status in ("in_progress", "completed") and batch.metadata == {"run": "1"}
        done = await until_ended(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed,
                done.request_counts.failed) == (8, 6, 2)
        assert len(f.openai.batches) == 1  # the 7 routable lines went up as one remote batch

        out = parse((await client.files.content(done.output_file_id)).content)
        assert sorted(out) == [f"q{i}" for i in range(6)]
        for i in range(6):
            response = out[f"q{i}"]["response"]
            assert response["status_code"] == 200
            assert response["body"]["choices"][0]["message"]["content"] == f"echo: question {i}"
        errors = parse((await client.files.content(done.error_file_id)).content)
        assert errors["bad"]["response"]["status_code"] == 400
        assert "FAIL" in errors["bad"]["response"]["body"]["error"]["message"]
        assert errors["nomodel"]["response"]["status_code"] == 404
        assert errors["nomodel"]["response"]["body"]["error"]["code"] == "model_not_found"


async def create(client: Any, rows: list[dict[str, Any]]) -> Any:
    upload = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    return await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")


def chats(*cids: str) -> list[dict[str, Any]]:
    return [line(cid, {"model": "gpt-4o-mini", "messages": ask(f"question {cid}")}) for cid in cids]


async def test_a_concurrency_1_key_runs_its_batches_each_request_charged_once(tmp_path):
    """A batch request is its key's one charge: the job it submits, polls, pages or cancels is
    no second call of the key (a concurrency 1 key was refused its own batch, and a lone poll
    of it); a submit charges its lines to batch_calls_per_day, once."""
    quota = {"concurrency": 1, "batch_calls_per_day": 3}
    async with gateway(tmp_path, quotas={"alice": quota}) as (f, gw, client):
        claims, one = Claims(gw.quotas), [request_claim("alice")]
        batch, asked = await claims.of(create(client, chats("q0", "q1")))
        assert asked[-2:] == [*one, batch_claim("alice", 2)]  # the upload's, then the create's
        got, asked = await claims.of(client.batches.retrieve(batch.id))
        assert got.id == batch.id and asked == one
        done = await until_ended(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 2
        out, asked = await claims.of(client.files.content(done.output_file_id))  # the job's results
        assert sorted(parse(out.content)) == ["q0", "q1"] and asked == one

        f.openai.polls_to_complete = 10_000  # the next remote batch runs until cancelled
        running = await create(client, chats("r0"))
        cancelled, asked = await claims.of(client.batches.cancel(running.id))
        assert cancelled.status in ("cancelling", "cancelled") and asked == one
        listed, asked = await claims.of(client.batches.list())
        assert {b.id for b in listed.data} == {batch.id, running.id} and asked == one

        with pytest.raises(openai.RateLimitError) as refused:  # 2 + 1 of the day's 3: charged once each
            await create(client, chats("s0"))
        error = refused.value.response.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "batch_calls_per_day" in error["message"]


async def test_an_rpm_key_gets_exactly_its_rpm_of_batch_requests(tmp_path):
    """With the quota's time held still, rpm 4 is four requests: the upload, the create, a poll and
    a cancel; the fifth is refused in OpenAI's shape."""
    async with gateway(tmp_path, quotas={"alice": {"rpm": 4}}) as (f, gw, client):
        frozen(gw.quotas)
        f.openai.polls_to_complete = 10_000
        batch = await create(client, chats("q0", "q1"))
        assert (await client.batches.retrieve(batch.id)).status == "in_progress"
        assert (await client.batches.cancel(batch.id)).status in ("cancelling", "cancelled")
        with pytest.raises(openai.RateLimitError) as refused:
            await client.batches.retrieve(batch.id)
        assert "rpm" in refused.value.response.json()["error"]["message"]


async def test_lines_without_a_batch_api_run_through_the_lanes(tmp_path):
    async with gateway(tmp_path) as (_, _, client):
        rows = [line(f"e{i}", {"model": "mock-embed", "input": f"text {i}"}, "/v1/embeddings")
                for i in range(5)]
        rows.append(line("up", {"model": "text-embedding-3-small", "input": "remote"},
                         "/v1/embeddings"))
        upload = await client.files.create(file=("e.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        done = await until_ended(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 6
        assert done.error_file_id is None
        out = parse((await client.files.content(done.output_file_id)).content)
        assert out["e3"]["response"]["body"] == mock_embedding("text 3")
        assert len(out["up"]["response"]["body"]["data"]) == 1
        listed = await client.batches.list()
        assert [b.id for b in listed.data] == [batch.id]
        assert [x.id async for x in client.files.list(purpose="batch")] == [upload.id]
        assert (await client.files.delete(upload.id)).deleted
        assert [x.id async for x in client.files.list()] == []
        with pytest.raises(openai.NotFoundError):
            await client.files.content(upload.id)


async def test_invalid_file_fails_the_batch_and_others_see_nothing(tmp_path):
    async with gateway(tmp_path) as (_, _, client):
        bad = b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\nnot json\n'
        upload = await client.files.create(file=("bad.jsonl", bad), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        assert batch.status == "failed" and batch.errors.data[0].line == 2
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_doesnotexist")
        with pytest.raises(openai.NotFoundError):
            await client.files.content("file-nope")
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-nope",
                                        endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(input_file_id=upload.id, endpoint="/v1/nope",
                                        completion_window="24h")  # type: ignore[arg-type]
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(batch.id)


async def test_cancel_a_running_batch(tmp_path):
    async with gateway(tmp_path) as (f, _, client):
        f.openai.polls_to_complete = 10_000  # the remote batch never finishes on its own
        rows = [line(f"q{i}", {"model": "gpt-4o-mini", "messages": ask(f"q {i}")}) for i in range(3)]
        upload = await client.files.create(file=("c.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        cancelled = await client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        done = await until_ended(client, batch.id)
        assert done.status == "cancelled" and done.cancelling_at is not None
        errors = parse((await client.files.content(done.error_file_id)).content)
        assert {r["error"]["code"] for r in errors.values()} == {"batch_cancelled"}
        assert sorted(errors) == ["q0", "q1", "q2"]


async def test_lane_lines_left_unfinished_run_after_a_restart(tmp_path):
    """A gateway stopped mid-batch left lines 1 and 2 without results: the next one runs them."""
    from multiplexer.faces.v1.store import BatchRecord, V1Store

    store = V1Store(tmp_path / "jobs.db")  # the job store the gateway opens
    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(3)]
    upload = await store.put_file("alice", "in.jsonl", "batch", jsonl(rows))
    record = BatchRecord("batch_" + "a" * 24, "alice", "/v1/embeddings", upload.id, "24h", 1,
                         custom_ids=["e0", "e1", "e2"], lane_lines=[0, 1, 2])
    await store.create_batch(record)
    await store.add_results(record.id, [(0, "e0", 200, {"saved": True})])
    store.close()
    async with gateway(tmp_path) as (_, _, client):
        done = await until_ended(client, record.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        out = parse((await client.files.content(done.output_file_id)).content)
        assert out["e0"]["response"]["body"] == {"saved": True}  # not run twice
        assert out["e2"]["response"]["body"] == mock_embedding("t2")


async def test_lane_lines_wait_for_the_owners_quota_instead_of_failing(tmp_path):
    async with gateway(tmp_path, quotas={"alice": {"concurrency": 2}}) as (_, _, client):
        rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
                for i in range(7)]
        upload = await client.files.create(file=("q.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        # the poll competes with the lane lines for the key's two slots: a refused one asks again
        patient = client.with_options(max_retries=5)
        done = await until_ended(patient, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 7


async def test_ended_batches_are_forgotten_after_the_retention_period(tmp_path):
    import time

    async with gateway(tmp_path) as (_, gw, client):
        rows = [line("e0", {"model": "mock-embed", "input": "t"}, "/v1/embeddings")]
        upload = await client.files.create(file=("r.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        await until_ended(client, batch.id)
        batches = gw.faces["v1_batches"]
        retention = gw.config.store.retention_s
        assert await batches.purge(retention) == []  # ended just now: kept
        assert await batches.purge(retention, at=time.time() + retention + 5) == [batch.id]
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve(batch.id)
        assert (await client.files.retrieve(upload.id)).id == upload.id  # the upload stays


async def test_responses_batch_rides_the_providers_batch_api_as_responses_lines(tmp_path):
    async with gateway(tmp_path) as (f, _, client):
        rows = [line(f"r{i}", {"model": "gpt-4o-mini", "input": f"question {i}"}, "/v1/responses")
                for i in range(4)]
        rows.append(line("embed", {"model": "text-embedding-3-small", "input": "x"}, "/v1/responses"))
        upload = await client.files.create(file=("r.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/responses",
                                            completion_window="24h")
        done = await until_ended(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
        [remote] = f.openai.batches.values()  # the four responses went up as one remote batch
        assert remote.endpoint == "/v1/responses"
        out = parse((await client.files.content(done.output_file_id)).content)
        for i in range(4):
            body = out[f"r{i}"]["response"]["body"]
            assert body["object"] == "response"
            assert body["output"][0]["content"][0]["text"] == f"echo: question {i}"
        errors = parse((await client.files.content(done.error_file_id)).content)
        assert errors["embed"]["response"]["status_code"] == 400


async def test_deleting_the_input_file_of_a_running_batch_loses_no_lane_line_on_restart(tmp_path):
    """Lines 1 and 2 had not run when the owner deleted the input file (OpenAI lets a batch
    outlive it) and the gateway stopped: the next gateway still runs them."""
    from multiplexer.faces.v1.store import BatchRecord

    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(3)]
    async with gateway(tmp_path) as (_, gw, client):
        upload = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        record = BatchRecord("batch_" + "b" * 24, "alice", "/v1/embeddings", upload.id, "24h", 1,
                             custom_ids=["e0", "e1", "e2"], lane_lines=[0, 1, 2])
        store = gw.faces["v1_batches"].store  # as a stopping gateway left it:
        await store.create_batch(record)
        await store.add_results(record.id, [(0, "e0", 200, {"saved": True})])
        assert (await client.files.delete(upload.id)).deleted
    async with gateway(tmp_path) as (_, _, client):
        done = await until_ended(client, record.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        out = parse((await client.files.content(done.output_file_id)).content)
        assert out["e2"]["response"]["body"] == mock_embedding("t2")


async def test_a_resume_pass_leaves_a_batch_already_running_to_its_one_runner(tmp_path):
    """A batch created while the start-up resume pass scans the store is running already: the
    pass must not start a second runner over the same lines (each would run twice)."""
    async with gateway(tmp_path, quotas={"alice": {"rpm": 2}}) as (_, gw, client):
        rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
                for i in range(3)]
        upload = await client.files.create(file=("w.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        batches = gw.faces["v1_batches"]
        runner = batches.live[batch.id]  # the upload and the create took its 2 rpm: its lines wait
        await batches.resume()
        assert batches.live[batch.id] is runner


async def test_a_page_of_results_is_inserted_beside_the_record_not_written_over_it(tmp_path):
    """A cancel and a page of lane results at once: both land; a line's first result stays."""
    from multiplexer.faces.v1.store import BatchRecord, V1Store

    store = V1Store(tmp_path / "jobs.db")
    record = BatchRecord("batch_" + "c" * 24, "alice", "/v1/embeddings", "file-x", "24h", 1,
                         custom_ids=["a", "b"], lane_lines=[0, 1])
    await store.create_batch(record)
    record.cancelled_at = 5
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.update, record, "cancelled_at")
        tg.start_soon(store.add_results, record.id, [(0, "a", 200, {"x": 1})])
    await store.add_results(record.id, [(0, "a", 500, {"x": 2}), (1, "b", 400, {"y": 1})])
    again = await store.batch(record.id, "alice")
    assert again is not None and again.cancelled_at == 5 and again.custom_ids == ["a", "b"]
    assert await store.results(record.id) == {0: {"status": 200, "raw": '{"x":1}'},
                                              1: {"status": 400, "raw": '{"y":1}'}}
    assert await store.results(record.id, 1, 2, bodies=False) == {1: {"status": 400}}
    assert await store.result_counts(record.id) == (2, 1)
    assert await store.batch(record.id, "bob") is None  # another key's: not found
    store.close()


async def test_lane_lines_refused_by_a_stopping_gateway_run_after_the_restart(tmp_path):
    """Lines a stopping gateway's lanes no longer admit did not run: they are not ended with its
    "Shutting down" error but left for the next gateway, which runs them."""
    from multiplexer.faces.v1.store import BatchRecord

    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(3)]
    async with gateway(tmp_path) as (_, gw, client):
        upload = await client.files.create(file=("s.jsonl", jsonl(rows)), purpose="batch")
        record = BatchRecord("batch_" + "d" * 24, "alice", "/v1/embeddings", upload.id, "24h", 1,
                             custom_ids=["e0", "e1", "e2"], lane_lines=[0, 1, 2])
        for lane in gw.lanes.values():
            lane.close()  # as the gateway's own close does first
        batches = gw.faces["v1_batches"]
        await batches.store.create_batch(record)
        await batches._run_lanes(record, [r["body"] for r in rows], anyio.CancelScope())
        assert await batches.store.results(record.id) == {}
    async with gateway(tmp_path) as (_, _, client):
        done = await until_ended(client, record.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        out = parse((await client.files.content(done.output_file_id)).content)
        assert out["e1"]["response"]["body"] == mock_embedding("t1")


async def test_a_store_that_fails_under_running_lane_lines_leaves_the_gateway_serving(tmp_path):
    """Results that cannot be stored end the runner, not the gateway; the next resume pass
    (every store.lease_s) runs the lines once the store answers again."""
    rows = [line(f"e{i}", {"model": "mock-embed", "input": f"t{i}"}, "/v1/embeddings")
            for i in range(3)]
    async with fakes() as f:
        data = config(f, tmp_path)
        data["store"]["lease_s"] = 0.5
        async with (
            running(parse_config(data), port=0) as (gw, url),
            openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client,
        ):
            await fails_then_resumes(gw, client, rows)


async def fails_then_resumes(gw: Any, client: Any, rows: list[dict[str, Any]]) -> None:
    batches = gw.faces["v1_batches"]
    store_results = batches.store.add_results

    async def away(*args: Any) -> None:
        raise RuntimeError("the database is away")

    batches.store.add_results = away
    upload = await client.files.create(file=("f.jsonl", jsonl(rows)), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                        completion_window="24h")
    with anyio.fail_after(10):
        while batch.id in batches.live:
            await anyio.sleep(0.01)
    assert (await client.batches.retrieve(batch.id)).status == "in_progress"
    batches.store.add_results = store_results
    done = await until_ended(client, batch.id)  # resumed by the gateway's own pass
    assert done.status == "completed" and done.request_counts.completed == 3


async def test_batch_lines_are_priced_at_the_batch_price(tmp_path):
    from decimal import Decimal

    async with gateway(tmp_path) as (_, gw, client):
        rows = [line(f"q{i}", {"model": "gpt-4o-mini", "messages": ask("hello there")}) for i in range(4)]
        upload = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        assert (await until_ended(client, batch.id)).status == "completed"
        await gw.money.flush()
        report = await gw.money.report(["key", "route", "model"], None, None)
        (row,) = report["rows"]
        # 2 words in, 3 out at gpt-4o-mini's $0.15 / $0.60 per million, half price, 4 lines
        one = (2 * Decimal("0.15") + 3 * Decimal("0.6")) / 1_000_000
        assert (row["key"], row["route"], row["model"], row["calls"]) == ("alice", "chat", "gpt-4o-mini", 4)
        assert row["cost_usd"] == pytest.approx(float(4 * one / 2))
        assert row["saved_by"]["batch"] == pytest.approx(float(4 * one / 2))


def test_a_file_split_into_lines_a_piece_at_a_time_has_the_lines_of_splitlines(monkeypatch):
    """The input is split a piece at a time (the GIL is let go between pieces); a piece ends
    after a newline, so a CR LF, other line breaks and empty lines come out as ``splitlines``'s."""
    from multiplexer.faces.v1 import batch_run

    breaks = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "x", "yz", " "]
    texts = ["", "\n", "\r\n", "a\r\nb", "\n\nq\r", "".join(breaks * 3), "".join(reversed(breaks * 3))]
    for text in texts:
        for piece in (1, 2, 3, 5, 64):
            assert list(batch_run.split_lines(text, piece)) == text.splitlines(), (text, piece)
    line = json.dumps({"custom_id": "c{}", "url": "/v1/embeddings", "body": {"input": "a\u2028b"}},
                      ensure_ascii=False)
    content = "\r\n".join([line.replace("{}", str(i)) for i in range(40)] + ["", "{", "[]"]).encode()
    whole = batch_run.parse_lines(content, "/v1/embeddings")  # one piece: splitlines itself
    assert whole[1] and whole[1][0]["line"] == 1  # a raw U+2028 breaks a line, as before
    for piece in (7, 100):
        monkeypatch.setattr(batch_run, "PIECE", piece)
        assert batch_run.parse_lines(content, "/v1/embeddings") == whole
