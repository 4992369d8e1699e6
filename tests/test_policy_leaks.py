"""Policy on every path: each way a call could escape its key's access, quota or budget, tried
against a running gateway (real HTTP on 127.0.0.1, the fake upstreams), and shown closed."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.call import Call
from multiplexer.core.errors import RpcError
from multiplexer.core.jobs import FALLBACK_ROUTES
from multiplexer.gateway.admission import job_item
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import fakes

pytestmark = pytest.mark.anyio
KEY = "sk-policy-leak-0123456789"
ADMIN = "adm-policy-" + "x" * 24


def config(f: Any, tmp_path: Path, keys: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "server": {"api_keys": keys, "admin_key": ADMIN, **extra.pop("server", {})},
        "store": {"path": str(tmp_path / "jobs.db")},
        "spend": {"flush_interval_s": 0.05},
        "providers": {
            "oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up",
                    "retry": {"attempts": 1}, "batch_poll_interval_s": 0.01},
            "big": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up",
                    "retry": {"attempts": 1}},
        },
        "routes": {
            "chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"],
                     **extra.pop("chat", {})},
            "chat_big": {"provider": "big", "operation": "chat", "models": ["gpt-4o"],
                         "params": {"model": "gpt-4o"}},
        },
        **extra,
    }


@asynccontextmanager
async def gateway(tmp_path: Path, keys: dict[str, Any], **extra: Any):
    async with (
        fakes() as f,
        running(parse_config(config(f, tmp_path, keys, **extra)), port=0) as (gw, url),
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as client,
    ):
        yield f, gw, client


def chat(text: str, model: str = "gpt-4o-mini", **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **more}


async def spend_rows(gw: Any, client: httpx.AsyncClient) -> dict[str, Any]:
    reply = await client.get("/admin/spend", params={"group_by": "key,route,model"},
                             headers={"authorization": f"Bearer {ADMIN}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_an_abandoned_stream_is_booked_and_keeps_its_budget(tmp_path: Path) -> None:
    """A client that closes a stream while the upstream still streams used what it was sent: it is
    booked at the chunks it got over its input, and its budget is not refunded, so abandoned
    streams run out of budget like whole ones."""
    keys = {"alice": {"key": KEY, "budget_usd": {"daily": "0.00002"}}}
    async with gateway(tmp_path, keys) as (f, gw, client):
        f.openai.stream_gate = anyio.Event()  # the upstream holds each stream after its first event
        statuses = []
        for _ in range(30):
            cut = f.openai.stream_cut = anyio.Event()
            async with client.stream("POST", "/v1/chat/completions",
                                     json=chat("one two three four", stream=True, max_tokens=200)) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    break
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # one event seen: the client goes away
            with anyio.fail_after(10):
                await cut.wait()  # the gateway let go of the upstream stream too
        # gpt-4o-mini at $0.15 in / $0.60 out per million, each reservation ~200 output tokens:
        # $0.00002 a day is a handful of abandoned streams, never 30
        assert statuses[-1] == 429, statuses
        assert 2 <= statuses.count(200) <= 20, statuses
        report = await spend_rows(gw, client)
        total = report["total"]
        assert total["calls"] == statuses.count(200)
        assert Decimal(str(total["cost_usd"])) > 0  # booked, not refunded


async def test_a_fallback_is_checked_for_access_and_priced_as_itself(tmp_path: Path) -> None:
    """A key allowed only gpt-4o-mini is never served by a gpt-4o fallback; a key allowed both is,
    and the call is priced and booked at gpt-4o's rate on the route that served it."""
    keys = {"alice": {"key": KEY, "models": ["gpt-4o-mini"]},
            "bob": {"key": KEY + "-bob", "models": ["gpt-4o-mini", "gpt-4o"]}}
    async with gateway(tmp_path, keys, chat={"fallbacks": ["chat_big"]}) as (f, gw, client):
        r = await client.post("/v1/chat/completions", json=chat("hi", model="gpt-4o"))
        assert r.status_code == 403  # the model itself is refused
        before = f.openai.requests["/v1/chat/completions"]
        f.openai.fail_next = [500]  # mini's upstream fails: the fallback would be gpt-4o
        r = await client.post("/v1/chat/completions", json=chat("hello there"))
        assert r.status_code >= 500, r.text  # the upstream's failure, not another model's answer
        assert r.headers.get("x-multiplexer-route") != "chat_big"
        # one request, mini's: nothing went to the model the key may not use
        assert f.openai.requests["/v1/chat/completions"] == before + 1

        bob = {"authorization": f"Bearer {KEY}-bob"}
        f.openai.fail_next = [500]
        r = await client.post("/v1/chat/completions", json=chat("hello there"), headers=bob)
        assert r.status_code == 200, r.text
        assert r.headers["x-multiplexer-route"] == "chat_big"
        usage = r.json()["usage"]
        gpt_4o = (usage["prompt_tokens"] * Decimal("2.5") + usage["completion_tokens"] * 10) / Decimal(10**6)
        assert Decimal(r.headers["x-multiplexer-cost-usd"]) == gpt_4o
        report = await spend_rows(gw, client)
        rows = [row for row in report["rows"] if row["key"] == "bob"]
        assert [(row["route"], row["model"]) for row in rows] == [("chat_big", "gpt-4o")]
        assert Decimal(str(rows[0]["cost_usd"])) == gpt_4o


def rpc(method: str, params: Any, rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


async def wait_for_job(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    with anyio.fail_after(20):
        while True:
            r = await client.post("/rpc", json=rpc("jobs.status", {"job_id": job_id}))
            status = r.json()["result"]
            if status["done"]:
                return status
            await anyio.sleep(0.02)


async def test_a_batch_reserves_its_budget_at_submit_and_settles_line_by_line(tmp_path: Path) -> None:
    """A batch is admitted whole against the key's budget: over it, refused with the shortfall
    named and nothing stored or sent, on jobs.submit and on /v1/batches alike; within it, its
    lines settle to what they cost and the budget is free again for what they did not use."""
    keys = {"alice": {"key": KEY, "budget_usd": {"daily": "0.0002"}}}
    async with gateway(tmp_path, keys) as (f, gw, client):
        lines = [{"method": "chat", "params": chat(f"line {i}", max_tokens=100)} for i in range(100)]
        r = await client.post("/rpc", json=rpc("jobs.submit", {"calls": lines}))
        error = r.json()["error"]
        assert error["code"] == -32003 and error["data"]["limit"] == "budget_usd"
        # 100 lines of ~100 output tokens at half of $0.60 a million: ~$0.003, over $0.0002
        assert Decimal(error["data"]["needed"]) > Decimal("0.0025")
        assert Decimal(error["data"]["shortfall"]) == Decimal(error["data"]["needed"]) - Decimal("0.0002")
        assert f.openai.requests["/v1/batches"] == 0
        listed = await client.post("/rpc", json=rpc("jobs.list", {}))
        assert listed.json()["result"]["jobs"] == []  # refused whole: no job was stored

        # two lines fit: run through the batch API, booked, the reservation given back to cost
        small = lines[:2]
        r = await client.post("/rpc", json=rpc("jobs.submit", {"calls": small}))
        job_id = r.json()["result"]["job_id"]
        status = await wait_for_job(client, job_id)
        assert status["counts"]["succeeded"] == 2
        budgets = gw.money.budgets
        [counter] = budgets.counters_for(budgets.budgets_of("alice"), budgets.wall())
        spent = budgets.counters.spent[counter.key]
        # each line: 2 prompt words and "echo: line i" 3 words at half of $0.15 / $0.60 a million
        per_line = (2 * Decimal("0.15") + 3 * Decimal("0.6")) / 2 / Decimal(10**6)
        assert Decimal(spent) / Decimal(10**9) == pytest.approx(2 * per_line, rel=0.01)
        assert gw.money.jobs == {}  # the job ended: nothing held for it


async def test_a_v1_batch_over_the_budget_is_refused_whole(tmp_path: Path) -> None:
    keys = {"alice": {"key": KEY, "budget_usd": {"daily": "0.0002"}}}
    async with gateway(tmp_path, keys) as (f, _, client):
        body = {"model": "gpt-4o-mini", "max_tokens": 100, "messages": [{"role": "user", "content": "x"}]}
        content = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                        "url": "/v1/chat/completions", "body": body})
                            for i in range(100))
        up = await client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("in.jsonl", content.encode(), "application/jsonl")})
        assert up.status_code == 200, up.text
        r = await client.post("/v1/batches", json={"input_file_id": up.json()["id"],
                                                   "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "insufficient_quota"
        assert "shortfall" in r.json()["error"]["message"] or f.openai.requests["/v1/batches"] == 0



async def test_a_job_line_is_checked_and_resubmitted_only_where_its_key_may_go(tmp_path: Path) -> None:
    """A batch job's line is admitted as a live call: a model the key may not use is refused, and
    the routes its line would move to if its remote batch failed whole are only those it may use
    with their own models."""
    keys = {"alice": {"key": KEY, "models": ["gpt-4o-mini"]},
            "bob": {"key": KEY + "-bob", "models": ["gpt-4o-mini", "gpt-4o"]}}
    async with gateway(tmp_path, keys, chat={"fallbacks": ["chat_big"]}) as (_, gw, _client):
        managers = gw.faces["jobs"].managers
        line = Call("chat", chat("hi"), identity="alice", face="jobs")
        assert FALLBACK_ROUTES not in job_item(gw, line, managers).options
        bob = Call("chat", chat("hi"), identity="bob", face="jobs")
        assert job_item(gw, bob, managers).options[FALLBACK_ROUTES] == ["chat_big"]
        with pytest.raises(RpcError) as refused:
            job_item(gw, Call("chat", chat("hi", model="gpt-4o"), identity="alice", face="jobs"), managers)
        assert refused.value.data["reason"] == "permission_denied"


async def test_a_v1_batchs_lane_lines_reserve_at_submit_and_each_draws_its_own(tmp_path: Path) -> None:
    """Lines on a route without a batch API run through the lanes: they are reserved whole when
    the batch is made (refused whole over the budget, nothing run), each line then draws its own
    reservation from that and settles it to its cost, and what is left goes back at the end."""
    keys = {"alice": {"key": KEY, "budget_usd": {"daily": "0.001"}}}
    lane = {"providers": {"mock": {"kind": "mock", "price": {"input_per_mtok": 1, "output_per_mtok": 2}}},
            "routes": {"mock_chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]}}}
    async with fakes() as f:
        data = config(f, tmp_path, keys)
        data["providers"].update(lane["providers"])
        data["routes"].update(lane["routes"])
        async with (
            running(parse_config(data), port=0) as (gw, url),
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as client,
        ):
            async def batch_of(n: int, max_tokens: int) -> httpx.Response:
                body = {"model": "mock-gpt", "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": "one two"}]}
                content = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                                "url": "/v1/chat/completions", "body": body})
                                    for i in range(n))
                up = await client.post("/v1/files", data={"purpose": "batch"},
                                       files={"file": ("in.jsonl", content.encode(), "application/jsonl")})
                assert up.status_code == 200, up.text
                return await client.post("/v1/batches", json={
                    "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"})

            # 100 lines of 10,000 output tokens at $2 a million: $2, over $0.001
            r = await batch_of(100, 10_000)
            assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota", r.text
            assert "shortfall" in json.dumps(r.json()) or "Budget exceeded" in r.text
            budgets = gw.money.budgets
            [counter] = budgets.counters_for(budgets.budgets_of("alice"), budgets.wall())
            assert budgets.counters.spent.get(counter.key, 0) == 0  # refused whole: nothing held

            r = await batch_of(4, 100)  # fits: each line runs, settling to what it cost
            assert r.status_code == 200, r.text
            batch_id = r.json()["id"]
            with anyio.fail_after(20):
                while (await client.get(f"/v1/batches/{batch_id}")).json()["status"] != "completed":
                    await anyio.sleep(0.02)
            runs = gw.faces["v1_batches"]
            assert batch_id not in runs.holds  # what was left went back
            # the counter holds what the lines cost, as booked: no reservation left over
            booked = (await spend_rows(gw, client))["total"]
            assert booked["calls"] == 4 and booked["cost_usd"] > 0
            assert budgets.counters.spent[counter.key] == round(Decimal(str(booked["cost_usd"])) * 10**9)
            # ... and far below what was reserved: 4 x 100 output tokens at $2 a million
            assert budgets.counters.spent[counter.key] < 4 * 100 * 2000  # nano-dollars
