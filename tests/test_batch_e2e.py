"""Batch jobs end to end: gateway over HTTP, fake OpenAI / Anthropic batch APIs, every ending."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from multiplexer.core.errors import Code, RpcError
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.remote_helpers import Events, fakes, remote_config_data, reply_text, user

pytestmark = pytest.mark.anyio



def batch_calls(route: str, prompts: list[str]) -> list[tuple[str, Any]]:
    return [(route, user(p)) for p in prompts]


@dataclass
class TwoKeys:
    fakes: Any
    gateway: Gateway
    events: Events
    alice: Client
    bob: Client


@asynccontextmanager
async def alice_and_bob(tmp_path: Any, **server: Any) -> AsyncIterator[TwoKeys]:
    """The fake batch APIs behind a gateway with two keys, a client on each, events recorded."""
    async with fakes() as f:
        data = remote_config_data(f, tmp_path)
        data["server"] = {"api_keys": {"alice": "key-a", "bob": "key-b"}, **server}
        events = Events()
        async with running(parse_config(data), port=0) as (gateway, url):
            gateway.listeners.append(events)
            async with Client(url, api_key="key-a") as alice, Client(url, api_key="key-b") as bob:
                yield TwoKeys(f, gateway, events, alice, bob)


async def test_route_mode_gathers_calls_into_one_job_and_routes_error_lines(tmp_path):
    prompts = [f"p{i}" for i in range(30)] + ["this one should FAIL"]
    async with fakes() as f:
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (_, url), Client(url) as client:
            results = await client.call_many(batch_calls("chat_batch", prompts))
            claude = await client.call_many(batch_calls("claude_batch", ["c1", "c2 FAIL", "c3"]))
    assert [reply_text(r) for r in results[:30]] == [f"echo: p{i}" for i in range(30)]
    failed = results[30]
    assert isinstance(failed, RpcError) and failed.data["upstream_status"] == 400
    assert "FAIL" in failed.data["detail"]
    assert len(f.openai.batches) == 1 and f.openai.requests["/v1/files"] == 1
    assert f.openai.requests["/v1/chat/completions"] == 0
    assert reply_text(claude[0]) == "echo: c1" and reply_text(claude[2]) == "echo: c3"
    assert claude[1].code == Code.UPSTREAM_ERROR and "FAIL" in claude[1].data["detail"]
    assert len(f.anthropic.batches) == 1


@pytest.mark.parametrize("style", ["response", "error"])
async def test_both_error_file_styles(tmp_path, style):
    async with fakes(item_error_style=style) as f:
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (_, url), Client(url) as client:
            results = await client.call_many(batch_calls("chat_batch", ["ok", "FAIL me"]))
    assert reply_text(results[0]) == "echo: ok"
    assert isinstance(results[1], RpcError) and "FAIL" in results[1].data["detail"]


@pytest.mark.parametrize("in_error_file", [False, True])
async def test_expiry_delivers_partial_results_and_resubmits_once(tmp_path, in_error_file):
    """6 calls; each batch finishes only 2 before it expires: 2 + 2 done, the last 2 fail clearly."""
    async with fakes(force_status="expired", expire_after_items=2,
                     expired_in_error_file=in_error_file) as f:
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (_, url), Client(url) as client:
            results = await client.call_many(batch_calls("chat_batch", [f"e{i}" for i in range(6)]))
    assert [reply_text(r) for r in results[:4]] == [f"echo: e{i}" for i in range(4)]
    for r in results[4:]:
        assert isinstance(r, RpcError) and r.data["expired"] is True
        assert "resubmission" in r.data["detail"]
    assert len(f.openai.batches) == 2


async def test_anthropic_expiry_resubmits_unfinished(tmp_path):
    async with fakes() as f:
        f.anthropic.force_status = "expired"
        f.anthropic.expire_after_items = 2
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (_, url), Client(url) as client:
            results = await client.call_many(batch_calls("claude_batch", ["a", "b", "c", "d"]))
    assert [reply_text(r) for r in results] == ["echo: a", "echo: b", "echo: c", "echo: d"]
    assert len(f.anthropic.batches) == 2


async def test_a_failed_batch_fails_its_calls_with_the_reason(tmp_path):
    async with fakes(force_status="failed") as f:
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (_, url), Client(url) as client:
            results = await client.call_many(batch_calls("chat_batch", ["a", "b"]))
    for r in results:
        assert isinstance(r, RpcError) and r.data["batch_status"] == "failed"
        assert "forced" in r.data["detail"]


async def test_sdk_batch_mode_mixes_providers_and_keeps_input_order(tmp_path):
    calls = ([("chat", {"model": "gpt-test", **user(f"o{i}")}) for i in range(5)]
             + [("claude", user(f"a{i}")) for i in range(3)]
             + [("no_such_method", {}), ("chat", user("no model")), ("chat_batch", user("routed"))])
    async with fakes() as f:
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (gateway, url), Client(url) as client:
            results = await client.call_many(calls, mode="batch", progress=True)
            names = {t.name for t in await gateway.list_tools()}
    assert [reply_text(r) for r in results[:8]] == [f"echo: o{i}" for i in range(5)] + [
        f"echo: a{i}" for i in range(3)]
    assert results[8].code == Code.METHOD_NOT_FOUND
    assert results[9].code == Code.INVALID_PARAMS
    assert reply_text(results[10]) == "echo: routed"
    assert len(f.openai.batches) == 1 and len(f.anthropic.batches) == 1
    assert {"jobs.submit", "jobs.status", "jobs.results", "jobs.cancel", "jobs.list"} <= names


async def test_job_methods_page_split_and_list(tmp_path):
    async with fakes() as f:
        data = remote_config_data(f, tmp_path)
        data["providers"]["oai"]["batch_max_requests"] = 10
        events = Events()
        async with running(parse_config(data), port=0) as (gateway, url), Client(url) as client:
            gateway.listeners.append(events)
            first = await client.call("jobs.submit", {"calls": [
                {"method": "chat", "params": {"model": "gpt-test", **user(f"x{i}")}}
                for i in range(15)], "more": True})
            assert first["state"] == "open" and first["total"] == 15
            status = await client.call("jobs.status", {"job_id": first["job_id"]})
            assert status["counts"]["queued"] == 15 and not status["batches"]
            second = await client.call("jobs.submit", {"job_id": first["job_id"], "calls": [
                {"method": "chat", "params": {"model": "other-model", **user(f"y{i}")}}
                for i in range(10)]})
            assert second["total"] == 25 and second["state"] == "running"
            job_id = first["job_id"]
            await events.wait("batch_job_ended")
            status = await client.call("jobs.status", {"job_id": job_id})
            assert status["done"] and status["counts"]["succeeded"] == 25
            assert len(status["batches"]) == 3  # 10 + 5 of one model, 10 of the other
            pages, cursor = [], 0
            while cursor is not None:
                page = await client.call("jobs.results", {"job_id": job_id, "cursor": cursor,
                                                          "limit": 7})
                pages.append(page)
                cursor = page["next_cursor"]
            rows = [r for p in pages for r in p["results"]]
            assert [len(p["results"]) for p in pages] == [7, 7, 7, 4]
            assert [r["index"] for r in rows] == list(range(25))
            assert reply_text(rows[16]["result"]) == "echo: y1"
            listed = await client.call("jobs.list", {})
            assert listed["jobs"][0]["job_id"] == job_id
            with pytest.raises(RpcError) as e:
                await client.call("jobs.submit", {"job_id": job_id, "calls": [{"method": "chat"}]})
            assert e.value.code == Code.INVALID_PARAMS
            with pytest.raises(RpcError) as e:
                await client.call("jobs.status", {"job_id": "job_nope"})
            assert e.value.code == Code.NOT_FOUND
    models = sorted({line["body"]["model"] for b in f.openai.batches.values() for line in b.items})
    assert models == ["gpt-test", "other-model"]


async def test_cancel_keeps_finished_results(tmp_path):
    async with fakes(polls_to_complete=10**9, cancel_after_items=1) as f:
        events = Events()
        async with running(parse_config(remote_config_data(f, tmp_path)), port=0) as (gateway, url):
            gateway.listeners.append(events)
            async with Client(url) as client:
                job = await client.call("jobs.submit", {"calls": [
                    {"method": "chat", "params": {"model": "gpt-test", **user(f"k{i}")}}
                    for i in range(3)]})
                await events.wait("batch_submitted")
                await client.call("jobs.cancel", {"job_id": job["job_id"]})
                await events.wait("batch_job_ended")
                status = await client.call("jobs.status", {"job_id": job["job_id"]})
                page = await client.call("jobs.results", {"job_id": job["job_id"]})
    assert status["state"] == "cancelled"
    assert status["counts"] == {"queued": 0, "running": 0, "succeeded": 1, "failed": 2, "finished": 3}
    assert reply_text(page["results"][0]["result"]) == "echo: k0"
    assert [r["error"]["code"] for r in page["results"][1:]] == [Code.CANCELLED] * 2
    assert f.openai.requests["/v1/batches/{batch_id}/cancel"] == 1


async def test_sync_fallback_without_a_batch_api(tmp_path):
    async with fakes() as f:
        data = remote_config_data(f, tmp_path)
        data["providers"]["oai"]["batch_api"] = False
        data["providers"]["oai"]["limits"] = {"concurrency": 3}
        async with running(parse_config(data), port=0) as (_, url), Client(url) as client:
            results = await client.call_many(batch_calls("chat_batch", [f"s{i}" for i in range(12)]))
            sdk = await client.call_many(
                [("embed", {"input": ["one", "two"]}), ("chat", user("no model"))], mode="batch")
    assert [reply_text(r) for r in results] == [f"echo: s{i}" for i in range(12)]
    assert f.openai.requests["/v1/batches"] == 0 and f.openai.requests["/v1/files"] == 0
    assert f.openai.requests["/v1/chat/completions"] == 12
    assert len(sdk[0]["data"]) == 2 and sdk[1].code == Code.INVALID_PARAMS


async def test_jobs_belong_to_their_identity(tmp_path):
    async with alice_and_bob(tmp_path) as k:
        job = await k.alice.call("jobs.submit", {"calls": [
            {"method": "claude", "params": user("mine")}]})
        with pytest.raises(RpcError) as e:
            await k.bob.call("jobs.results", {"job_id": job["job_id"]})
        assert e.value.code == Code.NOT_FOUND
        assert (await k.bob.call("jobs.list", {}))["jobs"] == []
        await k.events.wait("batch_job_ended")
        page = await k.alice.call("jobs.results", {"job_id": job["job_id"]})
    assert reply_text(page["results"][0]["result"]) == "echo: mine"


async def test_a_batch_route_makes_one_job_per_key_each_owner_can_see(tmp_path):
    import anyio

    async with alice_and_bob(tmp_path) as k:
        alice, bob = k.alice, k.bob
        results: dict[str, list[Any]] = {}

        async def send(name: str, client: Client) -> None:
            prompts = [f"{name}{i}" for i in range(3)]
            results[name] = await client.call_many(batch_calls("chat_batch", prompts))

        async with anyio.create_task_group() as tg:  # inside one batch window
            tg.start_soon(send, "a", alice)
            tg.start_soon(send, "b", bob)
        jobs = {name: (await c.call("jobs.list", {}))["jobs"] for name, c in (("a", alice), ("b", bob))}
    assert {n: [reply_text(r) for r in rs] for n, rs in results.items()} == {
        n: [f"echo: {n}{i}" for i in range(3)] for n in "ab"}
    assert [(j["source"], j["total"]) for j in jobs["a"]] == [("route", 3)]
    assert [(j["source"], j["total"]) for j in jobs["b"]] == [("route", 3)]
    assert jobs["a"][0]["job_id"] != jobs["b"][0]["job_id"] and len(k.fakes.openai.batches) == 2


async def test_job_methods_are_mcp_tools(tmp_path):
    import httpx2
    from mcp import Client as McpClient
    from mcp.client.streamable_http import streamable_http_client

    async with fakes() as f:
        events = Events()
        async with running(parse_config(remote_config_data(f, tmp_path)), port=0) as (gateway, url):
            gateway.listeners.append(events)
            async with httpx2.AsyncClient(timeout=httpx2.Timeout(30)) as http, \
                    McpClient(streamable_http_client(url + "/mcp", http_client=http)) as mcp:
                tools = {t.name: t for t in (await mcp.list_tools()).tools}
                assert {"calls", "job_id", "more"} == set(tools["jobs.submit"].input_schema["properties"])
                submitted = await mcp.call_tool("jobs.submit", {"calls": [
                    {"method": "claude", "params": user("via mcp")}]})
                job_id = submitted.structured_content["job_id"]
                await events.wait("batch_job_ended")
                page = await mcp.call_tool("jobs.results", {"job_id": job_id})
    assert reply_text(page.structured_content["results"][0]["result"]) == "echo: via mcp"


async def test_an_open_job_closes_by_a_last_submit_or_when_left_idle(tmp_path):
    import time

    calls = [{"method": "chat", "params": {"model": "gpt-test", **user(f"o{i}")}} for i in range(3)]
    async with fakes() as f:
        events = Events()
        async with running(parse_config(remote_config_data(f, tmp_path)), port=0) as (gateway, url):
            gateway.listeners.append(events)
            async with Client(url) as client:
                closed = await client.call("jobs.submit", {"calls": calls, "more": True})
                sealed = await client.call("jobs.submit", {"job_id": closed["job_id"]})  # no calls: close
                assert sealed["state"] == "running" and sealed["total"] == 3
                forgotten = await client.call("jobs.submit", {"calls": calls[:2], "more": True})
                face = gateway.faces["jobs"]
                assert await face.close_idle(3600, now=time.time()) == []  # not idle yet
                assert await face.close_idle(3600, now=time.time() + 3601) == [forgotten["job_id"]]
                assert [d for e, d in events.seen if e == "batch_job_closed_idle"] == [
                    {"job_id": forgotten["job_id"]}]
                await events.wait("batch_job_ended", count=2)
                for job in (closed, forgotten):
                    assert (await client.call("jobs.status", {"job_id": job["job_id"]}))["done"]
                page = await client.call("jobs.results", {"job_id": forgotten["job_id"]})
                with pytest.raises(RpcError) as e:
                    await client.call("jobs.submit", {"calls": []})
    assert [reply_text(r["result"]) for r in page["results"]] == ["echo: o0", "echo: o1"]
    assert e.value.code == Code.INVALID_PARAMS
    assert len(f.openai.batches) == 2


def junk(rng: Any, depth: int = 0) -> Any:
    """A random JSON value, biased toward the shapes jobs.* parameters take and their edges."""
    kinds = ["int", "str", "none", "bool", "float", "big"] + (["list", "dict", "call"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 10_000, 100_001, 2**62, -(2**63)])
    if kind == "str":
        return rng.choice(["", "job_nope", "chat", "claude", "jobs.submit", "\ud800", "x" * 300, "job_"])
    if kind == "float":
        return rng.choice([0.5, -1.5, 1e308])
    if kind == "big":
        return 10**30
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "call":
        return {"method": rng.choice(["chat", "claude", "jobs.list", "nope", 5, "\ud800"]),
                "params": junk(rng, depth + 1)}
    keys = ["calls", "job_id", "more", "cursor", "limit", "method", "params", "extra"]
    return {rng.choice(keys): junk(rng, depth + 1) for _ in range(rng.randrange(5))}


async def test_fuzzed_job_method_params_get_precise_errors_never_internal_ones(tmp_path):
    import random

    from multiplexer.core.call import Call

    rng = random.Random(11)
    methods = ["jobs.submit", "jobs.status", "jobs.results", "jobs.cancel", "jobs.list", "jobs.delete"]
    codes: dict[int | str, int] = {}
    async with fakes() as f, running(parse_config(remote_config_data(f, tmp_path)), port=0) as (gateway, _):
        real = (await gateway.submit(Call("jobs.submit", {"calls": [
            {"method": "chat", "params": {"model": "gpt-test", **user("seed")}}]}))).result["job_id"]
        for _ in range(1500):
            params = junk(rng)
            if isinstance(params, dict) and rng.random() < 0.3:
                params["job_id"] = real  # reach past the lookup into the parameter checks
            outcome = await gateway.submit(Call(rng.choice(methods), params))
            key = "ok" if outcome.ok else outcome.error.code
            codes[key] = codes.get(key, 0) + 1
    assert set(codes) <= {"ok", Code.INVALID_PARAMS, Code.NOT_FOUND}, codes
    assert codes.get(Code.INVALID_PARAMS, 0) > 100 and codes.get("ok", 0) > 50  # both paths were reached


async def test_jobs_methods_count_against_the_keys_quotas(tmp_path):
    """jobs.* are calls like any other (rpm, concurrency), and the calls a job carries count
    against batch_calls_per_day, all or none, for jobs.submit and for mode: batch routes alike."""
    async with alice_and_bob(tmp_path, quotas={"alice": {"rpm": 3, "batch_calls_per_day": 5}}) as k:
        alice, bob = k.alice, k.bob
        calls = [{"method": "claude", "params": user(f"c{i}")} for i in range(4)]
        job = await alice.call("jobs.submit", {"calls": calls})  # 4 of 5 used, 1 of 3 requests
        with pytest.raises(RpcError) as over:
            await alice.call("jobs.submit", {"calls": calls[:2]})  # 2 > 1 left: nothing stored
        assert over.value.code == Code.RATE_LIMITED
        assert over.value.data["limit"] == "batch_calls_per_day"
        assert over.value.data["remaining"] == 1 and over.value.data["retry_after"] > 0
        assert [r.code for r in await alice.call_many(batch_calls("chat_batch", ["x"]))
                if isinstance(r, RpcError)] == []  # the fifth call, through a batch route
        with pytest.raises(RpcError) as rpm:
            await alice.call("jobs.status", {"job_id": job["job_id"]})  # request 4 of 3
        assert rpm.value.code == Code.RATE_LIMITED and rpm.value.data["limit"] == "rpm"
        assert len((await bob.call("jobs.list", {}))["jobs"]) == 0  # bob has no quota set
    assert k.fakes.openai.requests["/v1/files"] == 1


async def test_jobs_delete_owner_only_and_retention_purges_ended_jobs(tmp_path):
    import time

    async with alice_and_bob(tmp_path) as k:
        gateway, events, alice, bob = k.gateway, k.events, k.alice, k.bob
        kept = await alice.call("jobs.submit", {"calls": [{"method": "claude", "params": user("a")}]})
        gone = await alice.call("jobs.submit", {"calls": [{"method": "claude", "params": user("b")}]})
        opened = await alice.call("jobs.submit", {"calls": [{"method": "claude",
                                                             "params": user("c")}], "more": True})
        await events.wait("batch_job_ended", count=2)
        with pytest.raises(RpcError) as other:
            await bob.call("jobs.delete", {"job_id": gone["job_id"]})
        with pytest.raises(RpcError) as running_job:
            await alice.call("jobs.delete", {"job_id": opened["job_id"]})
        assert await alice.call("jobs.delete", {"job_id": gone["job_id"]}) == {
            "job_id": gone["job_id"], "deleted": True}
        with pytest.raises(RpcError) as again:
            await alice.call("jobs.results", {"job_id": gone["job_id"]})
        face = gateway.faces["jobs"]
        retention = gateway.config.store.retention_s
        managers = list(face.managers.values())
        for m in managers:
            m.watch(kept["job_id"])  # a watch on an ended job: its event would never fire
        assert await face.purge(retention, now=time.time()) == []  # ended just now
        assert await face.purge(retention, now=time.time() + retention + 1) == [kept["job_id"]]
        listed = (await alice.call("jobs.list", {}))["jobs"]
        st = face.store()
        leftover = st._db.execute("SELECT COUNT(*) FROM items WHERE job_id IN (?,?)",
                                  (kept["job_id"], gone["job_id"])).fetchone()[0]
    assert other.value.code == Code.NOT_FOUND and again.value.code == Code.NOT_FOUND
    assert running_job.value.code == Code.INVALID_PARAMS
    assert running_job.value.data["state"] == "open"
    assert [j["job_id"] for j in listed] == [opened["job_id"]]  # the open job is never purged
    assert leftover == 0
    assert all(kept["job_id"] not in m._done for m in managers)  # purge forgets it in memory too


async def test_a_refused_append_charges_no_batch_calls(tmp_path):
    """jobs.submit to a closed job, or to another key's, stores nothing: the calls it carried
    must not count against the key's batch_calls_per_day either."""
    async with alice_and_bob(tmp_path, quotas={"alice": {"batch_calls_per_day": 5}}) as k:
        calls = [{"method": "claude", "params": user(f"c{i}")} for i in range(2)]
        closed = await k.alice.call("jobs.submit", {"calls": calls})
        theirs = await k.bob.call("jobs.submit", {"calls": calls, "more": True})
        for job_id, code in ((closed["job_id"], Code.INVALID_PARAMS),
                             (theirs["job_id"], Code.NOT_FOUND)):
            with pytest.raises(RpcError) as refused:
                await k.alice.call("jobs.submit", {"job_id": job_id, "calls": calls})
            assert refused.value.code == code
        last = await k.alice.call("jobs.submit", {"calls": calls + calls[:1]})  # 5 of 5
        assert last["accepted"] == 3


async def test_a_more_flag_that_is_not_a_boolean_is_refused_not_taken_as_true(tmp_path):
    """``more: "false"`` must not leave the job open for store.open_job_idle_s: -32602."""
    async with alice_and_bob(tmp_path) as k:
        calls = [{"method": "claude", "params": user("c")}]
        for more in ("false", 0, [False]):
            with pytest.raises(RpcError) as bad:
                await k.alice.call("jobs.submit", {"calls": calls, "more": more})
            assert bad.value.code == Code.INVALID_PARAMS and "more" in bad.value.data["detail"]
        assert (await k.alice.call("jobs.list", {}))["jobs"] == []  # nothing was stored
