"""Anthropic's Message Batches on the gateway, driven by the ``anthropic`` SDK: requests for an
``anthropic`` route ride that provider's batch API (the fake's) as one batch, others run through
their lanes; results per custom_id, cancel, another key, bad input, paging."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.quota_helpers import Claims, batch_claim, frozen, request_claim
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, ask, v1_config

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio
MODEL = "claude-sonnet-4-5"
BOB = "sk-gateway-bob"


def config(f: Any, tmp_path: Path, **server: Any) -> dict[str, Any]:
    data = v1_config(f, tmp_path, api_keys={"alice": KEY, "bob": BOB}, **server)
    data["providers"]["builtin"] = {"kind": "echo"}  # no batch API: its requests use the lanes
    data["routes"]["echo"] = {"provider": "builtin", "operation": "messages",
                              "models": ["echo-claude"]}
    return data


@asynccontextmanager
async def gateway(tmp_path: Path, **server: Any):
    async with (
        fakes() as f,
        running(parse_config(config(f, tmp_path, **server)), port=0) as (gw, url),
        anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as alice,
        anthropic.AsyncAnthropic(base_url=url, api_key=BOB, max_retries=0) as bob,
    ):
        yield f, gw, url, alice, bob


def request(cid: str, text: str, model: str = MODEL, max_tokens: int = 32) -> dict[str, Any]:
    return {"custom_id": cid,
            "params": {"model": model, "max_tokens": max_tokens, "messages": ask(text)}}


async def until_ended(client: Any, batch_id: str) -> Any:
    with anyio.fail_after(20):
        while True:
            batch = await client.messages.batches.retrieve(batch_id)
            if batch.processing_status == "ended":
                return batch
            await anyio.sleep(0.02)  # polling, as an SDK user does; the end is asserted, not timed


async def results(client: Any, batch_id: str) -> dict[str, Any]:
    return {r.custom_id: r.result async for r in await client.messages.batches.results(batch_id)}


async def test_results_per_custom_id_through_the_providers_batch_api_and_the_lanes(tmp_path):
    async with gateway(tmp_path) as (f, gw, _, alice, _):
        requests = [request(f"q{i}", f"question {i}") for i in range(3)]
        requests += [request("bad", "please FAIL"), request("nomodel", "x", model="claude-nope"),
                     request("zero", "x", max_tokens=0),
                     request("lane", "by the lanes", model="echo-claude")]
        batch = await alice.messages.batches.create(requests=requests)
        assert batch.type == "message_batch" and batch.id.startswith("msgbatch_")
        assert sum(batch.request_counts.model_dump().values()) == 7
        assert batch.expires_at - batch.created_at == timedelta(days=1)
        done = await until_ended(alice, batch.id)
        assert done.request_counts.model_dump() == {
            "processing": 0, "succeeded": 4, "errored": 3, "canceled": 0, "expired": 0}
        assert done.ended_at is not None and done.cancel_initiated_at is None
        assert done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
        [remote] = f.anthropic.batches.values()  # the 4 valid claude requests, as one batch
        assert len(remote.requests) == 4

        got = await results(alice, batch.id)
        assert sorted(got) == sorted(r["custom_id"] for r in requests)
        for i in range(3):
            assert got[f"q{i}"].type == "succeeded"
            assert got[f"q{i}"].message.content[0].text == f"echo: question {i}"
        assert got["bad"].type == "errored"
        assert got["bad"].error.error.type == "invalid_request_error"
        assert "FAIL" in got["bad"].error.error.message
        assert got["nomodel"].error.error.type == "not_found_error"
        assert "max_tokens" in got["zero"].error.error.message
        assert got["lane"].type == "succeeded" and got["lane"].message.model == "echo-claude"

        listed = await alice.messages.batches.list()
        assert [b.id for b in listed.data] == [batch.id]
        record = await gw.faces["v1_batches"].store.batch(batch.id, "alice")
        deleted = await alice.messages.batches.delete(batch.id)
        assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
        with pytest.raises(anthropic.NotFoundError):
            await alice.messages.batches.retrieve(batch.id)
        job = await gw.submit(Call("jobs.status", {"job_id": record.job_id}, identity="alice"))
        assert job.error is not None and job.error.data["job_id"] == record.job_id  # gone too


async def test_cancel_a_running_batch(tmp_path):
    async with gateway(tmp_path) as (f, _, _, alice, _):
        f.anthropic.polls_to_complete = 10_000  # the remote batch never finishes on its own
        batch = await alice.messages.batches.create(
            requests=[request(f"q{i}", f"q {i}") for i in range(3)])
        canceled = await alice.messages.batches.cancel(batch.id)
        assert canceled.processing_status in ("canceling", "ended")
        assert canceled.cancel_initiated_at is not None
        done = await until_ended(alice, batch.id)
        assert done.request_counts.canceled == 3 and done.request_counts.processing == 0
        assert {r.type for r in (await results(alice, batch.id)).values()} == {"canceled"}
        again = await alice.messages.batches.cancel(batch.id)  # already canceled: as it is
        assert again.processing_status == "ended" and again.request_counts.canceled == 3


async def test_a_concurrency_1_key_runs_its_message_batches_each_request_charged_once(tmp_path):
    """A message batch request is its key's one charge: the job behind it is no second call of
    the key (a concurrency 1 key was refused its own batch, and a lone retrieve of it); a
    create charges its requests to batch_calls_per_day, once."""
    quota = {"concurrency": 1, "batch_calls_per_day": 3}
    async with gateway(tmp_path, quotas={"alice": quota}) as (f, gw, _, alice, _):
        claims, one = Claims(gw.quotas), [request_claim("alice")]
        batch, asked = await claims.of(alice.messages.batches.create(
            requests=[request("q0", "question 0"), request("q1", "question 1")]))
        assert asked == [*one, batch_claim("alice", 2)]
        got, asked = await claims.of(alice.messages.batches.retrieve(batch.id))
        assert got.id == batch.id and asked == one
        assert (await until_ended(alice, batch.id)).request_counts.succeeded == 2
        got, asked = await claims.of(results(alice, batch.id))  # the job's results
        assert [r.type for r in got.values()] == ["succeeded", "succeeded"]
        assert asked == one * 2  # the SDK's retrieve for the results url, then the results
        listed, asked = await claims.of(alice.messages.batches.list())
        assert [b.id for b in listed.data] == [batch.id] and asked == one
        deleted, asked = await claims.of(alice.messages.batches.delete(batch.id))
        assert deleted.id == batch.id and asked == one

        f.anthropic.polls_to_complete = 10_000  # the next remote batch runs until canceled
        running_batch = await alice.messages.batches.create(requests=[request("r", "x")])
        canceled, asked = await claims.of(alice.messages.batches.cancel(running_batch.id))
        assert canceled.cancel_initiated_at is not None and asked == one

        with pytest.raises(anthropic.RateLimitError) as refused:  # 2 + 1 of the day's 3: charged once each
            await alice.messages.batches.create(requests=[request("s", "x")])
        assert refused.value.body["error"]["type"] == "rate_limit_error"
        assert "batch_calls_per_day" in refused.value.body["error"]["message"]


async def test_an_rpm_key_gets_exactly_its_rpm_of_message_batch_requests(tmp_path):
    """With the quota's time held still, rpm 3 is three requests: a create, a retrieve and a
    cancel; the fourth is refused in Anthropic's shape."""
    async with gateway(tmp_path, quotas={"alice": {"rpm": 3}}) as (f, gw, _, alice, _):
        frozen(gw.quotas)
        f.anthropic.polls_to_complete = 10_000
        batch = await alice.messages.batches.create(requests=[request("q", "question")])
        assert (await alice.messages.batches.retrieve(batch.id)).processing_status == "in_progress"
        assert (await alice.messages.batches.cancel(batch.id)).cancel_initiated_at is not None
        with pytest.raises(anthropic.RateLimitError) as refused:
            await alice.messages.batches.retrieve(batch.id)
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "rate_limit_error"


async def test_another_key_sees_nothing(tmp_path):
    async with gateway(tmp_path) as (_, _, url, alice, bob):
        batch = await alice.messages.batches.create(requests=[request("a", "mine", "echo-claude")])
        for attempt in (bob.messages.batches.retrieve, bob.messages.batches.cancel,
                        bob.messages.batches.delete, bob.messages.batches.results):
            with pytest.raises(anthropic.NotFoundError) as e:
                await attempt(batch.id)
            assert e.value.body["error"]["type"] == "not_found_error"
        assert (await bob.messages.batches.list()).data == []
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as oai:
            with pytest.raises(openai.NotFoundError):  # not an OpenAI batch either
                await oai.batches.retrieve(batch.id)
            assert (await oai.batches.list()).data == []
        assert (await until_ended(alice, batch.id)).request_counts.succeeded == 1


async def test_bad_input_is_400_in_anthropics_shape(tmp_path):
    async with gateway(tmp_path) as (f, _, url, alice, _):
        for requests, says in (
            ([], "requests: must be a non-empty array"),
            ([request("a", "x"), request("a", "y")], "requests.1.custom_id: 'a' appears"),
            ([request("has space", "x")], "requests.0.custom_id: must be 1 to 64"),
            ([{"custom_id": "p"}], "requests.0.params: must be an object"),
        ):
            with pytest.raises(anthropic.BadRequestError) as e:
                await alice.messages.batches.create(requests=requests)
            assert e.value.body["type"] == "error"
            assert e.value.body["error"]["type"] == "invalid_request_error"
            assert says in e.value.body["error"]["message"]
        assert (await alice.messages.batches.list()).data == []  # nothing was created
        with pytest.raises(anthropic.BadRequestError):
            await alice.messages.batches.list(limit=0)

        f.anthropic.polls_to_complete = 10_000
        running_batch = await alice.messages.batches.create(requests=[request("r", "x")])
        with pytest.raises(anthropic.BadRequestError, match="cancel it"):
            await alice.messages.batches.delete(running_batch.id)
        async with httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}) as http:
            early = await http.get(f"/v1/messages/batches/{running_batch.id}/results")
            assert early.status_code == 400 and early.headers["request-id"].startswith("req_")
            assert early.json()["error"]["type"] == "invalid_request_error"
            garbled = await http.post("/v1/messages/batches", content=b"{not json")
            assert garbled.status_code == 400 and garbled.json()["type"] == "error"
        ended = await alice.messages.batches.create(requests=[request("e", "x", "echo-claude")])
        await until_ended(alice, ended.id)
        with pytest.raises(anthropic.BadRequestError, match="has ended"):
            await alice.messages.batches.cancel(ended.id)


async def test_list_pages_newest_first_with_after_and_before_ids(tmp_path):
    async with gateway(tmp_path) as (_, _, _, alice, _):
        made = [(await alice.messages.batches.create(
            requests=[request(f"b{i}", f"batch {i}", "echo-claude")])).id for i in range(3)]
        newest = made[::-1]
        page = await alice.messages.batches.list(limit=2)
        assert [b.id for b in page.data] == newest[:2] and page.has_more
        assert (page.first_id, page.last_id) == (newest[0], newest[1])
        assert [b.id async for b in alice.messages.batches.list(limit=2)] == newest
        after = await alice.messages.batches.list(after_id=newest[1], limit=2)
        assert [b.id for b in after.data] == [newest[2]] and not after.has_more
        before = [b.id async for b in alice.messages.batches.list(before_id=made[0], limit=1)]
        assert before == [made[1], made[2]]  # toward newer ones, a page at a time


async def test_lane_requests_left_unfinished_run_after_a_restart(tmp_path):
    """A gateway stopped mid-batch left requests 1 and 2 without results: the next one runs them."""
    from multiplexer.faces.v1.requests import MESSAGES
    from multiplexer.faces.v1.store import BatchRecord, V1Store

    store = V1Store(tmp_path / "jobs.db")  # the job store the gateway opens
    bodies = [request(f"r{i}", f"text {i}", "echo-claude")["params"] for i in range(3)]
    record = BatchRecord("msgbatch_" + "a" * 24, "alice", MESSAGES, "", "24h", 1,
                         custom_ids=["r0", "r1", "r2"], lane_lines=[0, 1, 2], kind="anthropic")
    await store.create_batch(record, requests=json.dumps(bodies).encode())
    await store.add_results(record.id, [(0, "r0", 200, {"saved": True})])
    store.close()
    async with gateway(tmp_path) as (_, _, _, alice, _):
        done = await until_ended(alice, record.id)
        assert done.request_counts.succeeded == 3
        got = await results(alice, record.id)
        assert got["r0"].message.model_dump(exclude_none=True) == {"saved": True}  # not run twice
        assert got["r2"].message.messages[0]["content"] == "text 2"
