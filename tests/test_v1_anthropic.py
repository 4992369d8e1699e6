"""``POST /v1/messages`` driven by the official ``anthropic`` SDK against the fake upstream:
whole and streamed (named events), keys, errors in Anthropic's shape, ``request-id``."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, ask, v1_config

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio
MODEL = "claude-sonnet-4-5"


@asynccontextmanager
async def gateway(tmp_path: Path, **server: object):
    async with (
        fakes() as f,
        running(parse_config(v1_config(f, tmp_path, **server)), port=0) as (gw, url),
        anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as client,
    ):
        yield f, gw, url, client


async def test_message_whole(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        raw = await client.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, messages=ask("bonjour tout le monde"))
        message = await raw.parse()
        assert message.content[0].text == "echo: bonjour tout le monde"
        assert message.usage.input_tokens == 4 and message.usage.output_tokens == 5
        assert raw.headers["request-id"].startswith("req_")
        assert f.anthropic.requests["/v1/messages"] == 1


async def test_message_stream_named_events(tmp_path):
    async with gateway(tmp_path) as (_, _, _, client):
        async with client.messages.stream(model=MODEL, max_tokens=64,
                                          messages=ask("one two three")) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == "echo: one two three" and len(pieces) == 4
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4


async def test_error_event_after_the_200(tmp_path):
    async with gateway(tmp_path) as (f, _, _, client):
        f.anthropic.stream_error_after = 3
        with pytest.raises(anthropic.APIStatusError, match="fake overload mid-stream"):
            async with client.messages.stream(model=MODEL, max_tokens=64,
                                              messages=ask("x y z")) as stream:
                async for _ in stream:
                    pass


async def test_client_disconnect_cancels_the_upstream_stream(tmp_path):
    async with gateway(tmp_path) as (f, _, url, _), httpx.AsyncClient() as http:
        f.anthropic.stream_gate = anyio.Event()
        f.anthropic.stream_cut = anyio.Event()
        async with http.stream("POST", url + "/v1/messages", headers={"x-api-key": KEY},
                               json={"model": MODEL, "max_tokens": 9, "messages": ask("a b"),
                                     "stream": True}) as r:
            assert r.headers["request-id"].startswith("req_")
            lines = r.aiter_lines()
            assert await lines.__anext__() == "event: message_start"
        with anyio.fail_after(30):
            await f.anthropic.stream_cut.wait()
        assert f.anthropic.streams_cut == 1


async def test_errors_in_anthropic_shape(tmp_path):
    async with gateway(tmp_path) as (f, _, url, client):
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.create(model="claude-nope", max_tokens=8, messages=ask("x"))
        assert e.value.body["error"]["type"] == "not_found_error"
        assert e.value.request_id.startswith("req_")
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=0, messages=ask("x"))
        assert "max_tokens" in e.value.message
        with pytest.raises(anthropic.BadRequestError):  # a chat model on /v1/messages
            await client.messages.create(model="gpt-4o-mini", max_tokens=8, messages=ask("x"))
        f.anthropic.fail_next = [529, 529]
        with pytest.raises(anthropic.APIStatusError) as e:
            await client.messages.create(model=MODEL, max_tokens=8, messages=ask("x"))
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        async with anthropic.AsyncAnthropic(base_url=url, api_key="nope", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as e:
                await bad.messages.create(model=MODEL, max_tokens=8, messages=ask("x"))
            assert e.value.body["error"]["type"] == "authentication_error"


async def test_gateway_overload_is_529(tmp_path):
    async with gateway(tmp_path, quotas={"alice": {"rpm": 1}}) as (_, _, _, client):
        await client.messages.create(model=MODEL, max_tokens=8, messages=ask("x"))
        with pytest.raises(anthropic.RateLimitError) as e:
            await client.messages.create(model=MODEL, max_tokens=8, messages=ask("y"))
        assert e.value.body["error"]["type"] == "rate_limit_error"
        assert int(e.value.response.headers["retry-after"]) >= 1


async def test_count_tokens_through_the_messages_route(tmp_path):
    async with gateway(tmp_path) as (f, gw, _, client):
        raw = await client.messages.with_raw_response.count_tokens(
            model=MODEL, system="be brief", messages=ask("how many words here"))
        counted = await raw.parse()
        assert counted.input_tokens == 4 + 2  # the fake counts words, the system prompt's too
        assert raw.headers["request-id"].startswith("req_")
        assert f.anthropic.requests["/v1/messages/count_tokens"] == 1
        assert f.anthropic.requests.get("/v1/messages", 0) == 0
        charged: list[int] = []
        limiter = gw.limiters["claude"]
        consume = limiter.consume
        limiter.consume = lambda r, t: (charged.append(t), consume(r, t))[1]
        await client.messages.count_tokens(model=MODEL, messages=ask("once more"))
        assert charged == [0]  # a request against rpm, no tokens


async def test_count_tokens_errors_and_routes_without_it(tmp_path):
    async with gateway(tmp_path) as (_, _, _, client):
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="claude-nope", messages=ask("x"))
        with pytest.raises(anthropic.BadRequestError):  # a chat model is not a messages route
            await client.messages.count_tokens(model="gpt-4o-mini", messages=ask("x"))
        with pytest.raises(anthropic.BadRequestError, match="messages"):
            await client.messages.count_tokens(model=MODEL, messages=[])


async def test_count_tokens_on_a_batch_mode_route_is_still_one_request(tmp_path):
    """Message Batches do not count tokens: a count on a mode: batch route goes up at once."""
    async with fakes() as f:
        config = v1_config(f, tmp_path)
        config["routes"]["claude_batch"] = {"provider": "claude", "operation": "messages", "mode": "batch",
                                            "models": ["claude-batch"]}
        async with (running(parse_config(config), port=0) as (_, url),
                    anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as client):
            with anyio.fail_after(10):
                counted = await client.messages.count_tokens(model="claude-batch", messages=ask("a b c"))
    assert counted.input_tokens == 3
    assert f.anthropic.requests["/v1/messages/count_tokens"] == 1 and not f.anthropic.batches


async def test_a_deadline_is_anthropics_timeout_error(tmp_path):
    async with fakes() as f:
        config = v1_config(f, tmp_path)
        config["routes"]["claude"]["timeout_ms"] = 300
        async with (
            running(parse_config(config), port=0) as (_, url),
            anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as client,
        ):
            f.anthropic.stream_gate = anyio.Event()  # the upstream holds after its first event
            with pytest.raises(anthropic.APIStatusError) as e:
                async with client.messages.stream(model=MODEL, max_tokens=8,
                                                  messages=ask("slow")) as stream:
                    async for _ in stream:
                        pass
            assert e.value.body == {"type": "error", "error": {
                "type": "timeout_error", "message": e.value.body["error"]["message"]}}
            f.anthropic.stream_gate.set()
