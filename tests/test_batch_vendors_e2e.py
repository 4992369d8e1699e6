"""Azure OpenAI, Mistral, Groq and Together end to end: a gateway over HTTP in front of each
vendor's fake on 127.0.0.1 (tests/fakes/vendor_fakes.py, mistral_fake.py): sync calls, streams,
embeddings, and mode: batch routes with shuffled output and failed lines."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from multiplexer.core.errors import RpcError
from multiplexer.gateway.config import parse_config
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.fakes.openai_fake import embed_text
from tests.remote_helpers import Events, reply_text, user
from tests.vendor_helpers import vendor_config_data, vendor_fakes

pytestmark = pytest.mark.anyio
VENDORS = ["az", "az1", "mis", "groq", "tog"]


def fake_of(v: Any, name: str) -> Any:
    return {"az": v.azure, "az1": v.azure, "mis": v.mistral, "groq": v.groq, "tog": v.together}[name]


async def test_sync_chat_and_embeddings_on_every_vendor(tmp_path):
    async with vendor_fakes() as v, running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (
            _, url), Client(url) as client:
        for name in VENDORS:
            chats = await client.call_many([(f"{name}_chat", user(f"hi {name} {i}")) for i in range(3)])
            assert [reply_text(r) for r in chats] == [f"echo: hi {name} {i}" for i in range(3)]
            vectors = await client.call_many([(f"{name}_embed", {"input": t}) for t in ("a b", "c")])
            assert [r["data"][0]["embedding"] for r in vectors] == [embed_text("a b"), embed_text("c")]
    # Azure: the deployment in the classic path, the v1 API's in the body; the key in api-key
    assert len(v.azure.bodies["/openai/deployments/{deployment}/chat/completions"]) == 3
    assert [b["model"] for b in v.azure.bodies["/openai/v1/chat/completions"]] == ["gpt-4o"] * 3
    assert v.azure.requests["/openai/deployments/{deployment}/embeddings"] >= 1
    assert v.mistral.requests["/v1/chat/completions"] == 3


@pytest.mark.parametrize("name", ["az", "az1", "mis"])
async def test_streams_through_the_v1_face(tmp_path, name):
    async with vendor_fakes() as v, running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (
            _, url), httpx.AsyncClient() as http, http.stream("POST", url + "/v1/chat/completions", json={
            "model": f"{name}-chat", "messages": [{"role": "user", "content": "one two three"}],
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "echo: one two three"
    assert any(c.get("usage") for c in chunks)
    if name != "mis":  # the deployment the route names, not the caller's model name
        assert fake_of(v, name).bodies and all(
            b["model"] == "gpt-4o" for bodies in fake_of(v, name).bodies.values() for b in bodies)
    else:  # no stream_options upstream: Mistral's API has none
        assert all("stream_options" not in b for b in v.mistral.bodies["/v1/chat/completions"])


@pytest.mark.parametrize("name", VENDORS)
async def test_batch_route_correlates_shuffled_output_and_failed_lines(tmp_path, name):
    prompts = [f"p{i}" for i in range(12)] + ["this one should FAIL"]
    async with vendor_fakes() as v:
        fake = fake_of(v, name)
        fake.fail_custom_ids = set()
        async with running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (_, url), \
                Client(url) as client:
            results = await client.call_many([(f"{name}_batch", user(p)) for p in prompts])
    assert [reply_text(r) for r in results[:12]] == [f"echo: p{i}" for i in range(12)]
    assert isinstance(results[12], RpcError) and "FAIL" in results[12].data["detail"]
    assert results[12].data["upstream_status"] == 400
    remote = fake.jobs if name == "mis" else fake.batches
    assert len(remote) == 1
    job = next(iter(remote.values()))
    assert len(job.items) == 13
    if name in ("az", "az1"):  # the deployment in every line, Azure's create endpoint
        assert {row["body"]["model"] for row in job.items} == {"gpt-4o-batch"}
        assert job.endpoint == "/v1/chat/completions"
    chat_path = {"az": "/openai/deployments/{deployment}/chat/completions",
                 "az1": "/openai/v1/chat/completions", "mis": "/v1/chat/completions",
                 "groq": "/openai/v1/chat/completions", "tog": "/v1/chat/completions"}[name]
    assert fake.requests[chat_path] == 0  # all of it went through the batch API


async def test_azure_full_quota_waits_and_submits_once(tmp_path):
    """Two creates refused with token_limit_exceeded: the part waits, uploads once, creates once."""
    events = Events()
    async with vendor_fakes() as v:
        v.azure.quota_full_creates = 2
        async with running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (gw, url), \
                Client(url) as client:
            gw.listeners.append(events)
            results = await client.call_many([("az_batch", user(f"q{i}")) for i in range(4)])
    assert [reply_text(r) for r in results] == [f"echo: q{i}" for i in range(4)]
    # three creates, and before each retry a listing (was the refused create made after all?)
    assert v.azure.requests["/openai/batches"] == 3 + 2 and v.azure.statuses[400] == 2
    assert sum(1 for name, _ in events.seen if name == "batch_submitted") == 1
    assert v.azure.requests["/openai/files"] == 1 and len(v.azure.batches) == 1


async def test_mistral_timeout_delivers_partial_results_and_resubmits_once(tmp_path):
    async with vendor_fakes() as v:
        v.mistral.force_status = "expired"
        v.mistral.expire_after_items = 2
        async with running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (_, url), \
                Client(url) as client:
            results = await client.call_many([("mis_batch", user(f"t{i}")) for i in range(6)])
    assert [reply_text(r) for r in results[:4]] == [f"echo: t{i}" for i in range(4)]
    assert all(isinstance(r, RpcError) and r.data["expired"] for r in results[4:])
    assert len(v.mistral.jobs) == 2
    assert [j.status for j in v.mistral.jobs.values()] == ["TIMEOUT_EXCEEDED"] * 2


async def test_embeddings_batches_on_mistral_and_sync_fallback_on_azure(tmp_path):
    """Mistral's batch jobs take embeddings; Azure's embeddings batch is unverified, so an
    embeddings mode: batch route there runs as sync calls (no batch created)."""
    async with vendor_fakes() as v, running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (
            _, url), Client(url) as client:
        mis = await client.call_many([("mis_embed_batch", {"input": t}) for t in ("x", "y z")])
        az = await client.call_many([("az_embed_batch", {"input": t}) for t in ("x", "y z")])
    for results in (mis, az):
        assert [r["data"][0]["embedding"] for r in results] == [embed_text("x"), embed_text("y z")]
    assert len(v.mistral.jobs) == 1 and next(iter(v.mistral.jobs.values())).endpoint == "/v1/embeddings"
    assert not v.azure.batches and v.azure.requests["/openai/deployments/{deployment}/embeddings"] >= 1


async def test_cancel_a_mistral_job(tmp_path):
    async with vendor_fakes() as v:
        v.mistral.polls_to_complete = 10**9
        async with running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (gw, url), \
                Client(url) as client:
            events = Events()
            gw.listeners.append(events)
            submitted = await client.call("jobs.submit", {"calls": [
                {"method": "mis_chat", "params": user(f"c{i}")} for i in range(3)]})
            await events.wait("batch_submitted")
            await client.call("jobs.cancel", {"job_id": submitted["job_id"]})
            await events.wait("batch_job_ended")
            status = await client.call("jobs.status", {"job_id": submitted["job_id"]})
    assert status["state"] == "cancelled"
    assert [j.status for j in v.mistral.jobs.values()] == ["CANCELLED"]


async def test_three_replicas_share_azure_and_mistral_batches_through_postgres(tmp_path):
    """One job on the shared store: any replica answers for it, one drives each remote batch."""
    from tests.pg_helpers import throwaway_db

    with throwaway_db() as db:
        async with vendor_fakes() as v:
            data = vendor_config_data(v, tmp_path)
            data["store"] = {"url": db}
            config = parse_config(data)
            events = Events()
            async with running(config, port=0) as (g1, url1), running(config, port=0) as (g2, url2), \
                    running(config, port=0) as (g3, url3):
                for g in (g1, g2, g3):
                    g.listeners.append(events)
                async with Client(url1) as c1, Client(url2) as c2, Client(url3) as c3:
                    job = await c1.call("jobs.submit", {"calls": [
                        {"method": route, "params": user(f"{route} {i}")}
                        for route in ("az_chat", "mis_chat") for i in range(3)]})
                    seen = await c2.call("jobs.status", {"job_id": job["job_id"]})
                    await events.wait("batch_job_ended")
                    page = await c3.call("jobs.results", {"job_id": job["job_id"]})
    assert seen["total"] == 6
    assert [reply_text(r["result"]) for r in page["results"]] == [
        f"echo: {route} {i}" for route in ("az_chat", "mis_chat") for i in range(3)]
    assert len(v.azure.batches) == 1 and len(v.mistral.jobs) == 1  # each submitted once
    assert sum(1 for e, _ in events.seen if e == "batch_submitted") == 2


async def test_the_gateways_own_batch_api_rides_azure_and_mistral_batches(tmp_path):
    """/v1/files + /v1/batches on the gateway (the openai SDK): lines whose model names an Azure
    or a Mistral route go up as one remote batch on each vendor, answered per custom_id."""
    openai = pytest.importorskip("openai")
    from tests.test_v1_batches import jsonl, line, parse, until_ended

    async with vendor_fakes() as v, running(parse_config(vendor_config_data(v, tmp_path)), port=0) as (
            _, url), openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        rows = [line(f"{m}{i}", {"model": f"{m}-chat", "messages": [
            {"role": "user", "content": f"{m} {i}"}]}) for m in ("az", "mis") for i in range(3)]
        rows.append(line("bad", {"model": "az-chat", "messages": [{"role": "user", "content": "FAIL"}]}))
        upload = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await until_ended(client, batch.id)
        out = parse((await client.files.content(done.output_file_id)).content)
        errors = parse((await client.files.content(done.error_file_id)).content)
    counts = done.request_counts
    assert done.status == "completed" and (counts.completed, counts.failed) == (6, 1)
    answers = {cid: r["response"]["body"]["choices"][0]["message"]["content"] for cid, r in out.items()}
    assert answers == {f"{m}{i}": f"echo: {m} {i}" for m in ("az", "mis") for i in range(3)}
    assert errors["bad"]["response"]["status_code"] == 400
    assert len(v.azure.batches) == 1 and len(v.mistral.jobs) == 1
    assert {row["body"]["model"] for row in next(iter(v.azure.batches.values())).items} == {"gpt-4o"}
