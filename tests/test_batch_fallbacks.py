"""A remote batch that fails whole goes, once, to the fallback route; two fake OpenAI batch APIs.

Items that succeeded, or failed on their own line, are never sent again; each item is answered
once under its own id, naming the route that served it; the move survives a restart.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.fakes.openai_fake import FakeOpenAIState
from tests.fakes.openai_fake import create_app as openai_app
from tests.fakes.serve import serve_app
from tests.remote_helpers import Events, reply_text, user

pytestmark = pytest.mark.anyio
FAST = {"batch_poll_interval_s": 0.01, "retry": {"attempts": 2, "base_wait_ms": 1, "max_wait_ms": 5}}


@dataclass
class Two:
    a: FakeOpenAIState
    b: FakeOpenAIState
    a_url: str
    b_url: str

    def batch_lines(self, state: FakeOpenAIState) -> list[dict[str, Any]]:
        """Every request line the gateway put in ``state``'s batches."""
        return [line for job in state.batches.values() for line in job.items]


@asynccontextmanager
async def two_apis(**a_knobs: Any) -> AsyncIterator[Two]:
    a, b = FakeOpenAIState(**a_knobs), FakeOpenAIState()
    async with serve_app(openai_app(a)) as a_url, serve_app(openai_app(b)) as b_url:
        yield Two(a, b, a_url + "/v1", b_url + "/v1")


def config(f: Two, tmp_path: Path, b_mode: str = "batch", **chat_a: Any) -> dict[str, Any]:
    """chat_a (provider a) falls back to chat_b (provider b, ``b_mode``)."""
    return {
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"a": {"kind": "openai", "base_url": f.a_url, "api_key": "ka", **FAST},
                      "b": {"kind": "openai", "base_url": f.b_url, "api_key": "kb", **FAST}},
        "routes": {
            "chat_a": {"provider": "a", "operation": "chat", "params": {"model": "gpt-a"},
                       "fallbacks": ["chat_b"], **chat_a},
            "chat_b": {"provider": "b", "operation": "chat", "params": {"model": "gpt-b"},
                       "mode": b_mode},
        },
    }


@asynccontextmanager
async def gateway(data: dict[str, Any]) -> AsyncIterator[tuple[Gateway, Events]]:
    events = Events()
    async with running(parse_config(data), port=0) as (gw, _):
        gw.listeners.append(events)
        yield gw, events


async def run_job(gw: Gateway, events: Events, route: str, prompts: list[str]) -> list[dict[str, Any]]:
    """Submit one job of ``prompts`` on ``route``; its results once it ended."""
    submitted = await gw.submit(Call("jobs.submit", {"calls": [
        {"method": route, "params": user(p)} for p in prompts]}))
    assert submitted.error is None, submitted.error
    await events.wait("batch_job_ended")
    page = await gw.submit(Call("jobs.results", {"job_id": submitted.result["job_id"]}))
    return page.result["results"]


def answers(results: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(r["route"], reply_text(r["result"]) if r["status"] == "succeeded" else r["error"]["code"])
            for r in results]


def gw_metrics(gw: Gateway) -> str:
    from prometheus_client import generate_latest

    return generate_latest(gw.metrics.registry).decode()


@pytest.mark.parametrize("ending", ["failed", "cancelled"])
async def test_a_job_whose_batch_fails_whole_is_answered_by_the_fallback_batch(tmp_path, ending):
    prompts = ["p0", "p1", "p2"]
    async with two_apis(force_status=ending) as f:
        data = config(f, tmp_path)
        data["routes"]["chat_a"]["params"]["max_tokens"] = 5
        data["routes"]["chat_b"]["params"]["max_tokens"] = 7
        async with gateway(data) as (gw, events):
            results = await run_job(gw, events, "chat_a", prompts)
            text = gw_metrics(gw)
    assert answers(results) == [("chat_b", f"echo: {p}") for p in prompts]
    assert len(f.a.batches) == 1 and len(f.b.batches) == 1  # resubmitted once, as one batch
    assert f.a.requests["/v1/files"] == 1 and f.b.requests["/v1/files"] == 1  # one upload each
    sent = f.batch_lines(f.b)
    assert sorted(x["body"]["messages"][0]["content"] for x in sent) == prompts
    assert {(x["body"]["model"], x["body"]["max_tokens"]) for x in sent} == {("gpt-b", 7)}  # chat_b's own
    assert f.b.requests["/v1/chat/completions"] == 0
    assert ('multiplexer_fallbacks_total{from_route="chat_a",reason="batch_failed",to_route="chat_b"} 3.0'
            in text)


async def test_a_live_fallback_route_answers_each_item_once_on_its_live_endpoint(tmp_path):
    prompts = [f"p{i}" for i in range(4)]
    async with two_apis(force_status="failed") as f, \
            gateway(config(f, tmp_path, b_mode="sync")) as (gw, events):
        results = await run_job(gw, events, "chat_a", prompts)
    assert answers(results) == [("chat_b", f"echo: {p}") for p in prompts]
    assert len(f.a.batches) == 1 and f.b.batches == {}
    assert f.b.requests["/v1/chat/completions"] == len(prompts)  # one request per item, no more


@pytest.mark.parametrize("refusals", [[400], [500] * 200], ids=["rejected", "after_retries"])
async def test_a_refused_submission_falls_back(tmp_path, refusals):
    async with two_apis() as f, gateway(config(f, tmp_path)) as (gw, events):
        f.a.fail_next = list(refusals)  # a's upload is refused outright, or every time
        results = await run_job(gw, events, "chat_a", ["x", "y"])
    assert answers(results) == [("chat_b", "echo: x"), ("chat_b", "echo: y")]
    assert f.a.batches == {} and len(f.b.batches) == 1


async def test_lines_with_their_own_errors_keep_them_and_nothing_falls_back(tmp_path):
    async with two_apis() as f, gateway(config(f, tmp_path)) as (gw, events):
        results = await run_job(gw, events, "chat_a", ["ok", "please FAIL", "fine"])
    assert answers(results)[0] == ("chat_a", "echo: ok") and answers(results)[2] == ("chat_a", "echo: fine")
    assert results[1]["status"] == "failed" and results[1]["error"]["data"]["upstream_status"] == 400
    assert "batch_failed" not in results[1]["error"]["data"]
    assert f.b.batches == {} and f.b.requests["/v1/chat/completions"] == 0


async def test_an_expired_batch_sends_only_what_did_not_succeed(tmp_path):
    """The first half ran (one line failed on its own); the unfinished half goes to chat_b."""
    prompts = ["bad FAIL", "p1", "p2", "p3", "p4", "p5"]
    async with two_apis(force_status="expired") as f:
        data = config(f, tmp_path)
        data["providers"]["a"]["batch_resubmit_expired"] = False
        async with gateway(data) as (gw, events):
            results = await run_job(gw, events, "chat_a", prompts)
    got = answers(results)
    assert got[0][0] == "chat_a" and results[0]["error"]["data"]["upstream_status"] == 400
    assert got[1:3] == [("chat_a", "echo: p1"), ("chat_a", "echo: p2")]
    assert got[3:] == [("chat_b", f"echo: {p}") for p in prompts[3:]]
    assert sorted(x["body"]["messages"][0]["content"] for x in f.batch_lines(f.b)) == prompts[3:]


async def test_a_fallback_batch_that_fails_too_is_not_resubmitted_again(tmp_path):
    async with two_apis(force_status="failed") as f:
        f.b.force_status = "failed"
        data = config(f, tmp_path)
        data["providers"]["c"] = {"kind": "openai", "base_url": f.a_url, "api_key": "kc", **FAST}
        data["routes"]["chat_b"]["fallbacks"] = ["chat_c"]  # chat_a's chain: chat_b, then chat_c
        data["routes"]["chat_c"] = {"provider": "c", "operation": "chat", "params": {"model": "gpt-c"}}
        async with gateway(data) as (gw, events):
            results = await run_job(gw, events, "chat_a", ["x", "y"])
    assert [r["status"] for r in results] == ["failed", "failed"]
    assert [r["route"] for r in results] == ["chat_b", "chat_b"]
    assert results[0]["error"]["data"]["batch_status"] == "failed"
    assert results[0]["error"]["data"]["batch_failed"] is True
    assert len(f.a.batches) == 1 and len(f.b.batches) == 1  # chat_c (on a's API) never got them


@pytest.mark.parametrize("chat_a", [{"max_attempts": 1}, {"on": ["server_error"]}])
async def test_max_attempts_1_or_an_on_without_batch_failed_keeps_the_failure(tmp_path, chat_a):
    async with two_apis(force_status="failed") as f, gateway(config(f, tmp_path, **chat_a)) as (gw, events):
        results = await run_job(gw, events, "chat_a", ["x"])
    assert results[0]["status"] == "failed" and results[0]["route"] == "chat_a"
    assert f.b.batches == {} and f.b.requests["/v1/chat/completions"] == 0


async def test_a_batch_mode_call_whose_batch_fails_whole_is_answered_by_the_fallback(tmp_path):
    """A ``mode: batch`` route's live callers: each answered once, by the fallback, which says so."""
    prompts = ["p0", "p1", "p2"]
    async with two_apis(force_status="failed") as f:
        data = config(f, tmp_path, b_mode="sync", mode="batch", batch={"max_items": 10, "max_wait_ms": 20})
        async with gateway(data) as (gw, _):
            calls = [Call("chat_a", user(p)) for p in prompts]
            outcomes = await gw.submit_many(calls)
    assert [reply_text(o.result) for o in outcomes] == [f"echo: {p}" for p in prompts]
    assert [c.route for c in calls] == ["chat_b"] * 3
    assert len(f.a.batches) == 1 and f.a.requests["/v1/chat/completions"] == 0
    assert f.b.requests["/v1/chat/completions"] == 3 and f.b.batches == {}


async def test_the_first_fallback_route_that_can_take_them_gets_them(tmp_path):
    """chat_b's breaker is open: the items skip it for chat_c (on b's API, its own model)."""
    async with two_apis(force_status="failed") as f:
        data = config(f, tmp_path)
        data["providers"]["b"]["breaker"] = {"allowed_fails": 1, "window_s": 60, "cooldown_s": 600}
        data["providers"]["c"] = {"kind": "openai", "base_url": f.b_url, "api_key": "kc", **FAST}
        data["routes"]["chat_a"]["fallbacks"] = ["chat_b", "chat_c"]
        data["routes"]["chat_c"] = {"provider": "c", "operation": "chat", "params": {"model": "gpt-c"},
                                    "mode": "batch"}
        async with gateway(data) as (gw, events):
            gw.fallbacks.breakers.get("b").failure()
            results = await run_job(gw, events, "chat_a", ["x", "y"])
    assert answers(results) == [("chat_c", "echo: x"), ("chat_c", "echo: y")]
    assert [x["body"]["model"] for x in f.batch_lines(f.b)] == ["gpt-c", "gpt-c"]


async def test_the_move_is_in_the_store_and_a_restart_finishes_on_the_fallback(tmp_path):
    """Stopped while the fallback's batch runs: the restarted gateway polls it, submits nothing
    again, and the items end on chat_b."""
    async with two_apis(force_status="failed") as f:
        f.b.polls_to_complete = 10**9  # b's batch runs until the restart
        data = config(f, tmp_path)
        async with gateway(data) as (gw, events):
            submitted = await gw.submit(Call("jobs.submit", {"calls": [
                {"method": "chat_a", "params": user(p)} for p in ("x", "y")]}))
            await events.wait("batch_submitted", 2)  # a's batch, then b's
            job_id = submitted.result["job_id"]
        f.b.polls_to_complete = 1
        async with gateway(data) as (gw, events):
            await events.wait("batch_job_ended")
            page = await gw.submit(Call("jobs.results", {"job_id": job_id}))
    assert answers(page.result["results"]) == [("chat_b", "echo: x"), ("chat_b", "echo: y")]
    assert len(f.a.batches) == 1 and len(f.b.batches) == 1


# -- model groups on /v1/batches ---------------------------------------------------------------
def group_config(f: Two, tmp_path: Path, **group: Any) -> dict[str, Any]:
    data = config(f, tmp_path)
    del data["routes"]["chat_a"]["fallbacks"]
    data["routes"]["chat_a"]["mode"] = "batch"  # a line moved to it goes to its batch API
    data["groups"] = {"gpt-x": {"routes": ["chat_a", "chat_b"], **group}}
    return data


async def batch_of(url: str, prompts: list[str]) -> dict[str, str]:
    """A /v1/batches batch of ``prompts`` on model gpt-x, to its end: custom_id -> answer text."""
    openai = pytest.importorskip("openai")
    import anyio

    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-x", "messages": [{"role": "user", "content": p}]}}
            for i, p in enumerate(prompts)]
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        upload = await client.files.create(
            file=("in.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        with anyio.fail_after(30):
            while batch.status not in ("completed", "failed", "cancelled", "expired"):
                await anyio.sleep(0.02)  # polled as an SDK user does; the end is asserted, not timed
                batch = await client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.output_file_id is not None
        content = (await client.files.content(batch.output_file_id)).content
    out = {}
    for raw in content.splitlines():
        row = json.loads(raw)
        out[row["custom_id"]] = reply_text(row["response"]["body"])
    return out


async def test_a_group_line_takes_the_strategys_route_and_the_groups_fallback(tmp_path):
    """least_busy picks chat_b (chat_a is busy); b's batch fails whole, so the group's other
    route answers every line, each under its own custom_id."""
    prompts = [f"q{i}" for i in range(5)]
    async with two_apis() as f:
        f.b.force_status = "failed"
        async with running(parse_config(group_config(f, tmp_path)), port=0) as (gw, url):
            gw.fallbacks.busy["chat_a"] = 1
            out = await batch_of(url, prompts)
    assert out == {f"c{i}": f"echo: {p}" for i, p in enumerate(prompts)}
    assert [x["body"]["model"] for x in f.batch_lines(f.b)] == ["gpt-b"] * 5  # the pick's own model
    assert [x["body"]["model"] for x in f.batch_lines(f.a)] == ["gpt-a"] * 5
    assert len(f.a.batches) == 1 and len(f.b.batches) == 1


async def test_a_weighted_group_splits_a_batchs_lines_over_its_routes(tmp_path):
    import random

    prompts = [f"q{i}" for i in range(20)]
    random.seed(39)
    async with two_apis() as f:
        data = group_config(f, tmp_path, strategy="weighted", weights={"chat_a": 1, "chat_b": 1})
        async with running(parse_config(data), port=0) as (_, url):
            out = await batch_of(url, prompts)
    assert out == {f"c{i}": f"echo: {p}" for i, p in enumerate(prompts)}
    on_a, on_b = f.batch_lines(f.a), f.batch_lines(f.b)
    assert on_a and on_b and len(on_a) + len(on_b) == len(prompts)  # each line sent once
    assert {x["body"]["model"] for x in on_a} == {"gpt-a"} and {x["body"]["model"] for x in on_b} == {"gpt-b"}
