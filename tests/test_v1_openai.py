"""The OpenAI-compatible surface driven by the official ``openai`` SDK against the fake upstreams:
chat (whole and streamed), embeddings (float and base64), models, keys, errors and headers."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.openai_fake import embed_text
from tests.remote_helpers import fakes

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio

KEY = "sk-gateway-test"


def v1_config(f: Any, tmp_path: Path, **server: Any) -> dict[str, Any]:
    """The issue's contract routes, pointed at the fakes."""
    fast = {"retry": {"attempts": 2, "base_wait_ms": 1, "max_wait_ms": 5}}
    return {
        "server": {"api_keys": {"alice": KEY}, **server},
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {
            "oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up",
                    "batch": {"max_items": 256, "max_wait_ms": 5}, "batch_poll_interval_s": 0.01,
                    **fast},
            "claude": {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "up",
                       "batch_poll_interval_s": 0.01, **fast},
        },
        "routes": {
            "chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"]},
            "embed": {"provider": "oai", "operation": "embeddings",
                      "models": ["text-embedding-3-small"]},
            "claude": {"provider": "claude", "operation": "messages",
                       "models": ["claude-sonnet-4-5"]},
        },
    }


@asynccontextmanager
async def gateway(tmp_path: Path, **server: Any):
    async with (
        fakes() as f,
        running(parse_config(v1_config(f, tmp_path, **server)), port=0) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client,
    ):
        yield f, gw, url, client


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_chat_completion_whole(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=ask("hello there"))
        reply = raw.parse()
        assert reply.choices[0].message.content == "echo: hello there"
        assert reply.model == "gpt-4o-mini" and reply.usage.total_tokens == 5
        assert raw.headers["x-request-id"].startswith("req_")
        assert f.openai.requests["/v1/chat/completions"] == 1
        again = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=ask("hello again"))
        ids = [raw.headers["x-request-id"], again.headers["x-request-id"]]
        assert ids[0] != ids[1] and all(len(i) == len("req_") + 32 for i in ids)


async def test_chat_stream_with_usage_and_done(tmp_path):
    async with gateway(tmp_path) as (_, _, _, client):
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=ask("one two three"), stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "echo: one two three"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=ask("no usage"), stream=True)
        chunks = [c async for c in stream]
        assert all(c.usage is None for c in chunks)  # usage was asked upstream, not passed on
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "echo: no usage"


async def test_stream_raw_format_ends_with_done(tmp_path):
    async with gateway(tmp_path) as (_, _, url, _), httpx.AsyncClient() as http, http.stream(
            "POST", url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
            json={"model": "gpt-4o-mini", "messages": ask("hi"), "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("req_")
        lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


async def test_failure_after_the_200_is_an_error_event(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        f.openai.stream_error_after = 2
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=ask("will break"), stream=True)
        got = []
        with pytest.raises(openai.APIError, match="fake failure mid-stream"):
            async for chunk in stream:
                got.append(chunk)
        assert len(got) == 2


async def test_failure_before_the_first_chunk_keeps_its_status(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="gpt-4o-mini", messages=ask("please FAIL"), stream=True)
        assert "FAIL" in e.value.message
        f.openai.fail_next = [503, 503]  # both attempts
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="gpt-4o-mini", messages=ask("x"), stream=True)


async def test_client_disconnect_cancels_the_upstream_stream(tmp_path):
    async with gateway(tmp_path) as (f, gw, url, _), httpx.AsyncClient() as http:
        f.openai.stream_gate = anyio.Event()  # upstream holds after its first event
        f.openai.stream_cut = anyio.Event()
        lane = gw.lanes[("oai", None)]
        async with http.stream("POST", url + "/v1/chat/completions",
                               headers={"authorization": f"Bearer {KEY}"},
                               json={"model": "gpt-4o-mini", "messages": ask("long story"),
                                     "stream": True}) as r:
            first = await r.aiter_lines().__anext__()
            assert first.startswith("data: ")
            assert lane.in_flight == 1  # the stream holds its slot while it runs
        # leaving the block closed the connection: the gateway must drop the upstream stream
        with anyio.fail_after(30):
            await f.openai.stream_cut.wait()
        assert f.openai.streams_cut == 1
        with anyio.fail_after(30):
            while lane.in_flight:
                await anyio.sleep(0.01)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "never mind"}),  # a direct endpoint
], ids=["chat", "embeddings"])
async def test_client_disconnect_cancels_a_whole_answer_call_upstream(tmp_path, path, body):
    async with gateway(tmp_path) as (f, gw, url, _):
        f.openai.gate = anyio.Event()  # the upstream holds every request
        lane = gw.lanes[("oai", None)]
        async with anyio.create_task_group() as tg:
            async def doomed() -> None:
                async with httpx.AsyncClient() as http:
                    await http.post(url + path, headers={"authorization": f"Bearer {KEY}"}, json=body)

            tg.start_soon(doomed)
            with anyio.fail_after(10):
                await f.openai.held.wait()
            assert lane.in_flight == 1
            tg.cancel_scope.cancel()  # the client hangs up
        with anyio.fail_after(10):
            while lane.in_flight:  # the lane frees its slot though the upstream still holds
                await anyio.sleep(0.01)
        assert 'outcome="-32004"' in gw.metrics.render().decode()
        f.openai.gate.set()


async def test_streams_are_never_shared_by_dedup(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        async def one() -> str:
            stream = await client.chat.completions.create(
                model="gpt-4o-mini", messages=ask("same"), stream=True, temperature=0, seed=1)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        results: list[str] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(lambda: _append(results, one()))
        assert results == ["echo: same"] * 3
        assert f.openai.requests["/v1/chat/completions"] == 3


async def _append(out: list[str], coro: Any) -> None:
    out.append(await coro)


async def test_stream_is_charged_and_corrected_from_usage(tmp_path):
    async with gateway(tmp_path) as (_, gw, _, client):
        limiter = gw.limiters["oai"]
        charged: list[tuple[int, int]] = []
        corrections: list[tuple[int, int]] = []
        consume, correct = limiter.consume, limiter.correct_tokens
        limiter.consume = lambda r, t: (charged.append((r, t)), consume(r, t))[1]
        limiter.correct_tokens = lambda e, a: (corrections.append((e, a)), correct(e, a))[1]
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=ask("count me " * 50), stream=True)
        _ = [c async for c in stream]
        assert len(charged) == 1 and charged[0][0] == 1 and charged[0][1] > 0  # the lane's charge
        # then the estimate is replaced by the fake's usage: 100 prompt + 101 reply words
        assert corrections == [(charged[0][1], 100 + 101)]


async def test_embeddings_float_and_base64(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        reply = await client.embeddings.create(model="text-embedding-3-small", input="some text")
        assert reply.data[0].embedding == pytest.approx(embed_text("some text"), abs=1e-6)  # base64
        reply = await client.embeddings.create(model="text-embedding-3-small", input=["a b", "c"],
                                               encoding_format="float")
        assert [d.embedding for d in reply.data] == [pytest.approx(embed_text(t)) for t in ["a b", "c"]]
        assert reply.usage.prompt_tokens == 3

        texts = [f"text {i}" for i in range(64)]
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            results[i] = await client.embeddings.create(model="text-embedding-3-small",
                                                        input=texts[i])

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
        for i, text in enumerate(texts):
            assert results[i].data[0].embedding == pytest.approx(embed_text(text), abs=1e-6)
        assert sum(f.openai.embedding_batch_sizes) == 2 + 64 + 1
        assert len(f.openai.embedding_batch_sizes) < 2 + 64  # packed upstream


async def test_models_lists_what_routes_list(tmp_path):
    async with gateway(tmp_path) as (_, _, _, client):
        models = await client.models.list()
        assert sorted(m.id for m in models.data) == [
            "claude-sonnet-4-5", "gpt-4o-mini", "text-embedding-3-small"]
        assert {m.owned_by for m in models.data} == {"oai", "claude"}
        assert (await client.models.retrieve("gpt-4o-mini")).owned_by == "oai"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-nope")


async def test_unknown_model_is_404_model_not_found(tmp_path):
    async with gateway(tmp_path) as (_, _, _, client):
        with pytest.raises(openai.NotFoundError) as e:
            await client.chat.completions.create(model="gpt-nope", messages=ask("x"))
        assert e.value.code == "model_not_found" and e.value.param == "model"
        assert e.value.body["type"] == "invalid_request_error"
        assert e.value.request_id.startswith("req_")


async def test_keys_bearer_and_x_api_key(tmp_path):
    async with gateway(tmp_path) as (_, _, url, _):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as e:
                await bad.models.list()
        assert e.value.code == "invalid_api_key"
        async with httpx.AsyncClient() as http:
            r = await http.get(url + "/v1/models", headers={"x-api-key": KEY})
            assert r.status_code == 200
            r = await http.get(url + "/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_bad_bodies_get_400_in_openai_shape(tmp_path):
    async with gateway(tmp_path) as (_, _, url, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="gpt-4o-mini", messages=[])
        assert e.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as e:  # an embeddings model on chat
            await client.chat.completions.create(model="text-embedding-3-small", messages=ask("x"))
        assert e.value.param == "model"
        async with httpx.AsyncClient() as http:
            r = await http.post(url + "/v1/chat/completions", content=b"{not json",
                                headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


async def test_quota_headers_and_429_with_retry_after(tmp_path):
    async with gateway(tmp_path, quotas={"alice": {"rpm": 2}}) as (_, _, _, client):
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=ask("a"))
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == "1"
        await client.chat.completions.create(model="gpt-4o-mini", messages=ask("b"))
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model="gpt-4o-mini", messages=ask("c"))
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"


async def test_route_name_as_model(tmp_path):
    async with gateway(tmp_path) as (_, _, _, client):
        reply = await client.chat.completions.create(model="chat", messages=ask("by name"))
        assert reply.choices[0].message.content == "echo: by name"
        assert reply.model == "gpt-4o-mini"  # the route's own model went upstream


async def test_a_stream_holds_its_callers_concurrency_until_it_ends(tmp_path):
    async with gateway(tmp_path, quotas={"alice": {"concurrency": 1}}) as (f, _, _, client):
        f.openai.stream_gate = anyio.Event()
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=ask("slow one"), stream=True)
        first = await stream.__anext__()
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as e:  # the open stream holds the one slot
            await client.chat.completions.create(model="gpt-4o-mini", messages=ask("x"))
        assert e.value.body["message"].startswith("Rate limited")
        f.openai.stream_gate.set()
        rest = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in rest) == "echo: slow one"
        reply = await client.chat.completions.create(model="gpt-4o-mini", messages=ask("now"))
        assert reply.choices[0].message.content == "echo: now"


# -- the Responses API (/v1/responses) on the same chat route ------------------------------------
async def test_responses_whole_through_the_chat_route(tmp_path):
    async with gateway(tmp_path) as (f, gw, _, client):
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o-mini", input="hello there", instructions="be brief")
        reply = raw.parse()
        assert reply.output_text == "echo: hello there" and reply.status == "completed"
        assert reply.usage.input_tokens == 2 and reply.usage.total_tokens == 5
        assert raw.headers["x-request-id"].startswith("req_")
        # the body went up as the client sent it, to the upstream's Responses endpoint
        assert f.openai.bodies["/v1/responses"] == [
            {"model": "gpt-4o-mini", "input": "hello there", "instructions": "be brief"}]
        assert f.openai.requests.get("/v1/chat/completions", 0) == 0
        items = await client.responses.create(
            model="gpt-4o-mini", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "as items"}]}])
        assert items.output_text == "echo: as items"
        assert 'route="chat"' in gw.metrics.render().decode()


async def test_responses_stream_is_its_named_events(tmp_path):
    async with gateway(tmp_path) as (_, _, url, client):
        stream = await client.responses.create(model="gpt-4o-mini", input="one two three", stream=True)
        events = [e async for e in stream]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "echo: one two three"
        assert events[-1].response.usage.total_tokens == 7
        assert [e.sequence_number for e in events] == list(range(len(events)))
        async with httpx.AsyncClient() as http, http.stream(
                "POST", url + "/v1/responses", headers={"authorization": f"Bearer {KEY}"},
                json={"model": "gpt-4o-mini", "input": "raw", "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert r.headers["content-type"].startswith("text/event-stream")
        assert lines[0] == "event: response.created" and lines[-2] == "event: response.completed"
        assert not any("[DONE]" in line for line in lines)  # the Responses API sends none


async def test_responses_stream_is_charged_and_corrected_from_the_final_usage(tmp_path):
    async with gateway(tmp_path) as (_, gw, _, client):
        limiter = gw.limiters["oai"]
        corrections: list[tuple[int, int]] = []
        correct = limiter.correct_tokens
        limiter.correct_tokens = lambda e, a: (corrections.append((e, a)), correct(e, a))[1]
        stream = await client.responses.create(model="gpt-4o-mini", input="count me " * 50, stream=True)
        _ = [e async for e in stream]
        assert len(corrections) == 1 and corrections[0][1] == 100 + 101  # the fake's usage


async def test_responses_failures_keep_the_openai_shapes(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="gpt-4o-mini", input="please FAIL")
        assert "FAIL" in e.value.message
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model="no-such-model", input="x")
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError, match="not responses"):
            await client.responses.create(model="text-embedding-3-small", input="x")
        with pytest.raises(openai.BadRequestError, match="not responses"):
            await client.responses.create(model="claude-sonnet-4-5", input="x")
        f.openai.stream_error_after = 3
        stream = await client.responses.create(model="gpt-4o-mini", input="will break", stream=True)
        events = [e async for e in stream]
        assert [e.type for e in events][-1] == "error" and len(events) == 4
        assert events[-1].message == "fake failure mid-stream"


async def test_responses_are_never_shared_by_dedup(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        async def one() -> str:
            return (await client.responses.create(model="gpt-4o-mini", input="same", temperature=0)).id

        ids: list[str] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(lambda: _append(ids, one()))
        assert len(set(ids)) == 3 and f.openai.requests["/v1/responses"] == 3


async def test_responses_on_a_batch_mode_route_ride_the_upstream_batch_api(tmp_path):
    async with fakes() as f:
        config = v1_config(f, tmp_path)
        config["routes"]["chat_batch"] = {"provider": "oai", "operation": "chat", "mode": "batch",
                                          "models": ["gpt-batch"]}
        async with (running(parse_config(config), port=0) as (_, url),
                    openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client):
            replies = await _gather([client.responses.create(model="gpt-batch", input=f"item {i}")
                                     for i in range(3)])
    assert sorted(r.output_text for r in replies) == ["echo: item 0", "echo: item 1", "echo: item 2"]
    assert f.openai.requests.get("/v1/responses", 0) == 0  # not one request each
    endpoints = {job.endpoint for job in f.openai.batches.values()}
    assert endpoints == {"/v1/responses"}


async def _gather(coros: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(coros)

    async def one(i: int) -> None:
        out[i] = await coros[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(coros)):
            tg.start_soon(one, i)
    return out


# -- legacy completions (/v1/completions) on the same chat route ---------------------------------
async def test_completions_whole_and_streamed_through_the_chat_route(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        whole = await client.completions.create(model="gpt-4o-mini", prompt="hello there", max_tokens=5)
        assert whole.object == "text_completion" and whole.choices[0].text == "echo: hello there"
        assert whole.usage.total_tokens == 5
        assert f.openai.bodies["/v1/completions"] == [
            {"model": "gpt-4o-mini", "prompt": "hello there", "max_tokens": 5}]
        stream = await client.completions.create(model="gpt-4o-mini", prompt="one two", stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "echo: one two"
        assert chunks[-1].usage.total_tokens == 5
        with pytest.raises(openai.BadRequestError, match="not completions"):
            await client.completions.create(model="text-embedding-3-small", prompt="x")
        with pytest.raises(openai.BadRequestError, match="FAIL"):
            await client.completions.create(model="gpt-4o-mini", prompt="please FAIL")
