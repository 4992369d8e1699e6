"""``kind: gemini`` end to end: the gateway over HTTP in front of the fake Gemini API on
127.0.0.1 (native bodies on /rpc; OpenAI and Anthropic callers through the official SDKs;
embeddings packed; batch routes on the Batch API, inline and through the resumable upload)."""

from __future__ import annotations

import base64
import json

import anyio
import pytest

from multiplexer.core.errors import Code, RpcError
from multiplexer.gateway.config import parse_config
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.gemini_helpers import gemini_config, gemini_fake, gemini_text, native
from tests.remote_helpers import Events

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio
PNG = base64.b64encode(b"\x89PNG fake").decode()


async def test_native_bodies_on_rpc_sync_and_embeddings_packed(tmp_path):
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw), Client(gw) as client:
            reply = await client.call("gchat", native("hello there"))
            embeds = await client.call_many(
                [("gembed", {"content": {"parts": [{"text": "a" * n}]}}) for n in (1, 2, 3)]
                + [("gembed", {"requests": [{"content": {"parts": [{"text": "xyzw"}]}}] * 2})])
            bad = await client.call_many([("gchat", native("please FAIL"))])
    assert gemini_text(reply) == "echo: hello there"
    assert reply["usageMetadata"] == {"promptTokenCount": 2, "candidatesTokenCount": 3, "totalTokenCount": 5}
    assert fake.generated[0] == native("hello there")  # model went into the URL, not the body
    assert [e["embedding"]["values"][0] for e in embeds[:3]] == [1.0, 2.0, 3.0]
    assert [v["values"][0] for v in embeds[3]["embeddings"]] == [4.0, 4.0]
    assert sum(fake.embed_sizes) == 5 and max(fake.embed_sizes) >= 3  # callers packed together
    assert isinstance(bad[0], RpcError) and bad[0].data["upstream_status"] == 400
    assert "FAIL" in bad[0].data["detail"]


async def test_openai_callers_chat_images_tools_and_streams(tmp_path):
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw):
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
            whole = await client.chat.completions.create(model="gemini-test", messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {
                    "type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}])
            tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
                "type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": False}}}]
            called = await client.chat.completions.create(model="gemini-test", tools=tools, messages=[
                {"role": "user", "content": "call the weather"}])
            call = called.choices[0].message.tool_calls[0]
            answered = await client.chat.completions.create(model="gemini-test", tools=tools, messages=[
                {"role": "user", "content": "call the weather"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "blue"}'}])
            chunks = [c async for c in await client.chat.completions.create(
                model="gemini-test", messages=[{"role": "user", "content": "one two three"}], stream=True,
                stream_options={"include_usage": True})]
            refused = None
            try:
                await client.chat.completions.create(model="gemini-test", logprobs=True, messages=[
                    {"role": "user", "content": "x"}])
            except openai.BadRequestError as e:
                refused = e
            await client.close()
    assert whole.choices[0].message.content == "echo: look [1 image(s): image/png]"
    assert whole.usage.prompt_tokens == 1 + 2 and whole.usage.completion_tokens == 5
    assert fake.generated[0]["systemInstruction"] == {"parts": [{"text": "be brief"}]}
    image = {"inlineData": {"mimeType": "image/png", "data": PNG}}
    assert fake.generated[0]["contents"][0]["parts"][1] == image
    assert called.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"q": "the weather"}
    assert "additionalProperties" not in json.dumps(fake.generated[1]["tools"])
    assert answered.choices[0].message.content == 'echo: tool said {"sky": "blue"}'
    assert fake.generated[2]["contents"][-1]["parts"][0]["functionResponse"]["name"] == "lookup"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: one two three"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.total_tokens == 3 + 4 and not chunks[-1].choices
    assert refused is not None and refused.status_code == 400 and "logprobs" in str(refused)


async def test_anthropic_callers_whole_tools_and_stream(tmp_path):
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw):
            client = anthropic.AsyncAnthropic(base_url=gw, api_key="x", max_retries=0)
            whole = await client.messages.create(model="gemini-test", max_tokens=64, system="terse",
                                                 messages=[{"role": "user", "content": [
                                                     {"type": "text", "text": "see"},
                                                     {"type": "image", "source": {
                                                         "type": "base64", "media_type": "image/jpeg",
                                                         "data": PNG}}]}])
            tools = [{"name": "lookup", "input_schema": {"type": "object", "properties": {
                "q": {"type": "string"}}}}]
            called = await client.messages.create(model="gemini-test", max_tokens=64, tools=tools,
                                                  messages=[{"role": "user", "content": "call it"}])
            use = called.content[0]
            result = {"type": "tool_result", "tool_use_id": use.id, "content": "42"}
            answered = await client.messages.create(
                model="gemini-test", max_tokens=64, tools=tools, messages=[
                    {"role": "user", "content": "call it"},
                    {"role": "assistant", "content": [use.model_dump()]},
                    {"role": "user", "content": [result]}])
            async with client.messages.stream(model="gemini-test", max_tokens=64,
                                              messages=[{"role": "user", "content": "a b c"}]) as stream:
                pieces = [t async for t in stream.text_stream]
                final = await stream.get_final_message()
            await client.close()
    assert whole.content[0].text == "echo: see [1 image(s): image/jpeg]"
    assert whole.stop_reason == "end_turn" and whole.usage.input_tokens == 2
    assert fake.generated[0]["systemInstruction"] == {"parts": [{"text": "terse"}]}
    assert called.stop_reason == "tool_use" and use.type == "tool_use" and use.input == {"q": "it"}
    assert answered.content[0].text == 'echo: tool said {"content": "42"}'
    assert "".join(pieces) == "echo: a b c" and len(pieces) == 4
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4


async def test_openai_embeddings_and_a_mid_stream_error(tmp_path):
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw):
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
            out = await client.embeddings.create(model="embed-test", input=["ab", "abcd"])
            fake.stream_error_after = 2
            with pytest.raises(openai.APIError, match="fake overload mid-stream"):
                async for _ in await client.chat.completions.create(
                        model="gemini-test", messages=[{"role": "user", "content": "x y z"}], stream=True):
                    pass
            await client.close()
    assert [d.embedding for d in out.data] == [[2.0, 0.0], [4.0, 1.0]]
    assert [d.index for d in out.data] == [0, 1]


@pytest.mark.parametrize("route", ["gbatch", "gbatch_file"])
@pytest.mark.parametrize("prefix", ["BATCH_STATE_", "JOB_STATE_"])
async def test_batch_routes_inline_and_file_with_failed_lines(tmp_path, route, prefix):
    prompts = [f"p{i}" for i in range(12)] + ["this one should FAIL"]
    async with gemini_fake(state_prefix=prefix, output_in="metadata" if route == "gbatch" else "response") \
            as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw), Client(gw) as client:
            results = await client.call_many([(route, native(p)) for p in prompts])
    assert [gemini_text(r) for r in results[:12]] == [f"echo: p{i}" for i in range(12)]
    failed = results[12]
    assert isinstance(failed, RpcError) and failed.code == Code.UPSTREAM_ERROR
    assert failed.data["upstream_status"] == 400 and "FAIL" in failed.data["detail"]
    assert len(fake.batches) == 1
    batch = next(iter(fake.batches.values()))
    assert batch["inline"] == (route == "gbatch")
    assert fake.requests["/upload/v1beta/files"] == (0 if route == "gbatch" else 2)  # start + finalize
    assert fake.requests["/v1beta/models/{name}"] == 1  # the create; no live generateContent


async def test_v1_batch_lines_reach_a_gemini_batch_route_translated(tmp_path):
    """/v1/chat/completions on a batch-mode Gemini route: the OpenAI body is translated, batched
    on Gemini's Batch API, and the answer comes back as a chat.completion."""
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        events = Events()
        async with running(config, port=0) as (g, gw):
            g.listeners.append(events)
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
            done = await client.chat.completions.create(model="gemini-batch", messages=[
                {"role": "user", "content": "later please"}])
            await client.close()
    assert done.choices[0].message.content == "echo: later please"
    assert len(fake.batches) == 1 and any(e == "batch_submitted" for e, _ in events.seen)


async def test_expired_batch_resubmits_once_then_fails_clearly(tmp_path):
    async with gemini_fake(force_state="EXPIRED") as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw), Client(gw) as client:
            results = await client.call_many([("gbatch", native(f"e{i}")) for i in range(3)])
    assert all(isinstance(r, RpcError) and r.data.get("expired") for r in results)
    assert len(fake.batches) == 2  # the original and one resubmission


async def test_a_job_mixing_chat_and_embeddings_sends_only_the_chat_calls_to_the_batch_api(tmp_path):
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        events = Events()
        async with running(config, port=0) as (g, gw), Client(gw) as client:
            g.listeners.append(events)
            job = await client.call("jobs.submit", {"calls": [
                {"method": "gbatch", "params": native("c0")},
                {"method": "gembed", "params": {"content": {"parts": [{"text": "abc"}]}}},
                {"method": "gbatch", "params": native("c1")}]})
            await events.wait("batch_job_ended")
            page = await client.call("jobs.results", {"job_id": job["job_id"]})
    results = [r["result"] for r in page["results"]]
    assert gemini_text(results[0]) == "echo: c0" and gemini_text(results[2]) == "echo: c1"
    assert results[1] == {"embedding": {"values": [3.0, 0.0]}}
    assert len(fake.batches) == 1 and sum(len(b["requests"]) for b in fake.batches.values()) == 2


async def test_cancel_a_job_cancels_the_remote_batch_and_keeps_what_ran(tmp_path):
    async with gemini_fake(polls_to_complete=10**9, cancel_after_items=1) as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        events = Events()
        async with running(config, port=0) as (g, gw), Client(gw) as client:
            g.listeners.append(events)
            job = await client.call("jobs.submit", {"calls": [
                {"method": "gbatch", "params": native(f"c{i}")} for i in range(3)]})
            await events.wait("batch_submitted")
            await client.call("jobs.cancel", {"job_id": job["job_id"]})
            await events.wait("batch_job_ended")
            status = await client.call("jobs.status", {"job_id": job["job_id"]})
            page = await client.call("jobs.results", {"job_id": job["job_id"]})
    assert status["state"] == "cancelled"
    assert gemini_text(page["results"][0]["result"]) == "echo: c0"  # it ran before the cancel
    assert [r["status"] for r in page["results"]] == ["succeeded", "failed", "failed"]
    assert page["results"][1]["error"]["code"] == Code.CANCELLED
    assert next(iter(fake.batches.values()))["state"] == "CANCELLED"


def rows_of(file) -> list[dict]:
    return [json.loads(x) for x in file.content.splitlines()]


async def test_openai_batch_files_and_anthropic_message_batches_on_gemini_routes(tmp_path):
    """/v1/batches lines and /v1/messages/batches requests for Gemini models: translated per line,
    run through their routes (the batch route's on Gemini's Batch API), answered in the caller's
    API, failed lines in the error file."""
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gemini-batch", "messages": [{"role": "user", "content": f"question {i}"}]}}
            for i in range(4)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "gemini-batch", "messages": [{"role": "user", "content": "please FAIL"}]}})
    content = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    async with gemini_fake() as (fake, url):
        config = parse_config(gemini_config(url, tmp_path))
        async with running(config, port=0) as (_, gw):
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
            upload = await client.files.create(file=("in.jsonl", content), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            with anyio.fail_after(30):
                while (batch := await client.batches.retrieve(batch.id)).status not in (
                        "completed", "failed", "cancelled", "expired"):
                    await anyio.sleep(0.02)
            out = rows_of(await client.files.content(batch.output_file_id))
            errors = rows_of(await client.files.content(batch.error_file_id))
            await client.close()
            claude = anthropic.AsyncAnthropic(base_url=gw, api_key="x", max_retries=0)
            made = await claude.messages.batches.create(requests=[
                {"custom_id": f"m{i}", "params": {"model": "gemini-test", "max_tokens": 16,
                                                  "messages": [{"role": "user", "content": f"hi {i}"}]}}
                for i in range(2)])
            with anyio.fail_after(30):
                while (made := await claude.messages.batches.retrieve(made.id)).processing_status != "ended":
                    await anyio.sleep(0.02)
            results = {r.custom_id: r.result async for r in await claude.messages.batches.results(made.id)}
            await claude.close()
    assert batch.status == "completed" and batch.request_counts.completed == 4
    answers = {r["custom_id"]: r["response"]["body"] for r in out}
    assert {k: v["choices"][0]["message"]["content"] for k, v in answers.items()} == {
        f"q{i}": f"echo: question {i}" for i in range(4)}
    assert answers["q0"]["object"] == "chat.completion" and answers["q0"]["usage"]["total_tokens"] == 5
    assert errors[0]["custom_id"] == "bad" and errors[0]["response"]["status_code"] == 400
    texts = {k: r.message.content[0].text for k, r in results.items()}
    assert texts == {"m0": "echo: hi 0", "m1": "echo: hi 1"}
    assert len(fake.batches) == 1  # the batch route's lines went up as one Gemini batch


async def test_the_enqueued_token_limit_is_a_flushing_limit_not_a_429(tmp_path):
    """The fake refuses a create beyond 3 enqueued words per model; with the tier's limit set the
    gateway holds each part back until the one before has ended, so no create is refused (without
    it, this run meets nine 429s)."""
    async with gemini_fake(enqueued_token_limit=3) as (fake, url):
        data = gemini_config(url, tmp_path, batch_max_requests=3, batch_enqueued_tokens={"gemini-test": 100})
        async with running(parse_config(data), port=0) as (_, gw), Client(gw) as client:
            results = await client.call_many([("gbatch", native(f"p{i}")) for i in range(9)])
    assert [gemini_text(r) for r in results] == [f"echo: p{i}" for i in range(9)]
    assert len(fake.batches) == 3 and fake.statuses[429] == 0
