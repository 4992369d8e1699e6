"""``kind: mock``: the stand-in model answers the OpenAI and Anthropic SDKs offline in their own
shapes, whole and streamed a word per chunk (streams shaped as the openai and anthropic
providers pass theirs on), with usage counted in words, deterministic embeddings, a fixed
``response``, and ``latency_ms`` on the gateway's clock."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.provider import Streamer
from multiplexer.core.sink import ChunkSink
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from providers.mock import MockProvider, unit_vector
from tests.remote_helpers import fakes, item, make_provider
from tests.sdk_helpers import Clients, sdk_clients

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "hello there"}]
REPLY = "This is a mock response to: hello there"


def mock_config(store: Path, **mock: Any) -> dict[str, Any]:
    return {
        "store": {"path": str(store)},
        "providers": {"mock": {"kind": "mock", **mock}},
        "routes": {
            "chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]},
            "claude": {"provider": "mock", "operation": "messages", "models": ["mock-claude"]},
            "embed_mock": {"provider": "mock", "operation": "embeddings", "models": ["mock-embedding"]},
        },
    }


@pytest.fixture(scope="module")
async def mock(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Clients]]:
    config = parse_config(mock_config(tmp_path_factory.mktemp("mock") / "jobs.db"))
    async with running(config, port=0) as (gw, url), sdk_clients(url) as clients:
        yield gw, clients


# -- OpenAI ---------------------------------------------------------------------------------------
async def test_chat_completion_says_it_is_a_mock(mock) -> None:
    _, c = mock
    reply = await c.openai.chat.completions.create(model="mock-gpt", messages=ASK)
    assert reply.choices[0].message.content == REPLY and reply.choices[0].finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-mock") and reply.system_fingerprint == "fp_mock"
    assert reply.model == "mock-gpt" and reply.object == "chat.completion"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (2, 8, 10)


async def test_chat_stream_a_word_per_chunk_with_usage_when_asked(mock) -> None:
    _, c = mock
    stream = await c.openai.chat.completions.create(
        model="mock-gpt", messages=ASK, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    words = [ch.choices[0].delta.content for ch in chunks[1:-2]]
    assert words == ["This", " is", " a", " mock", " response", " to:", " hello", " there"]
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 10
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-mock")

    stream = await c.openai.chat.completions.create(model="mock-gpt", messages=ASK, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(ch.usage is None and ch.choices for ch in chunks)  # no usage chunk unless asked


async def test_chat_stream_ends_with_done(mock) -> None:
    _, c = mock
    async with httpx.AsyncClient() as http, http.stream(
            "POST", c.url + "/v1/chat/completions",
            json={"model": "mock-gpt", "messages": ASK, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 8 + 1 + 1


async def test_max_tokens_cuts_the_reply_at_that_many_words(mock) -> None:
    _, c = mock
    chat = await c.openai.chat.completions.create(model="mock-gpt", messages=ASK, max_tokens=3)
    assert chat.choices[0].message.content == "This is a" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 3
    message = await c.anthropic.messages.create(model="mock-claude", max_tokens=2, messages=ASK)
    assert message.content[0].text == "This is" and message.stop_reason == "max_tokens"
    response = await c.openai.responses.create(model="mock-gpt", input="hello", max_output_tokens=1)
    assert response.status == "incomplete" and response.output_text == "This"


async def test_responses_whole_and_streamed(mock) -> None:
    _, c = mock
    whole = await c.openai.responses.create(model="mock-gpt", input="hello there", instructions="be brief")
    assert whole.output_text == REPLY and whole.status == "completed" and whole.id.startswith("resp_mock")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (4, 8)
    events = [e async for e in await c.openai.responses.create(
        model="mock-gpt", input=[{"role": "user", "content": "hello there"}], stream=True)]
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                           "response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert events[-1].type == "response.completed" and events[-1].response.output_text == REPLY
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_legacy_completions_whole_and_streamed(mock) -> None:
    _, c = mock
    whole = await c.openai.completions.create(model="mock-gpt", prompt="hello there")
    assert whole.choices[0].text == REPLY and whole.id.startswith("cmpl-mock")
    stream = await c.openai.completions.create(model="mock-gpt", prompt="hello there", stream=True,
                                               stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == REPLY
    assert chunks[-1].usage.completion_tokens == 8


async def test_embeddings_are_deterministic_unit_vectors(mock) -> None:
    _, c = mock
    # the SDK asks for base64 unless told otherwise; both encodings carry the same floats
    packed = await c.openai.embeddings.create(model="mock-embedding", input=["alpha", "beta gamma"])
    floats = await c.openai.embeddings.create(model="mock-embedding", input=["alpha", "beta gamma"],
                                              encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.usage.prompt_tokens == 3
    for d, text in zip(floats.data, ["alpha", "beta gamma"], strict=True):
        assert d.embedding == unit_vector(text, 384)
        assert math.isclose(math.fsum(v * v for v in d.embedding), 1.0)
    for a, b in zip(packed.data, floats.data, strict=True):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-6
    small = await c.openai.embeddings.create(model="mock-embedding", input="alpha", dimensions=8,
                                             encoding_format="float")
    assert small.data[0].embedding == unit_vector("alpha", 8)
    with pytest.raises(openai.BadRequestError, match="'dimensions' must be an integer from 1 to 8192"):
        await c.openai.embeddings.create(model="mock-embedding", input="alpha", dimensions=0)


# -- Anthropic -----------------------------------------------------------------------------------
async def test_message_whole_streamed_and_counted(mock) -> None:
    _, c = mock
    message = await c.anthropic.messages.create(model="mock-claude", max_tokens=64, messages=ASK,
                                                system="be brief")
    assert message.content[0].text == REPLY and message.stop_reason == "end_turn"
    assert message.id.startswith("msg_mock") and message.model == "mock-claude"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 8)
    async with c.anthropic.messages.stream(model="mock-claude", max_tokens=64, messages=ASK) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert pieces == ["This", " is", " a", " mock", " response", " to:", " hello", " there"]
    assert final.content[0].text == REPLY and final.usage.output_tokens == 8
    counted = await c.anthropic.messages.count_tokens(model="mock-claude", messages=ASK)
    assert counted.input_tokens == 2


async def test_messages_need_max_tokens_as_anthropics_do(mock) -> None:
    _, c = mock
    async with httpx.AsyncClient() as http:
        r = await http.post(c.url + "/v1/messages", json={"model": "mock-claude", "messages": ASK})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "Invalid params: 'max_tokens' must be a positive integer"}}


# -- streams shaped as the real providers pass theirs on ------------------------------------------
def openai_shape(chunk: Any) -> tuple[Any, ...]:
    if not chunk.choices:
        return ("usage",)
    choice = chunk.choices[0]
    delta = choice.delta.model_dump(exclude_none=True)
    return chunk.object, tuple(sorted(delta)), choice.finish_reason


async def test_streams_take_the_shape_of_the_real_providers_streams(tmp_path: Path) -> None:
    """The same requests to the mock and to the openai/anthropic providers (on the fakes): the
    same chunks and events in the same order, only the words differ."""
    config = mock_config(tmp_path / "jobs.db", response="as many words as the fakes say")
    async with fakes() as f:
        config["providers"]["oai"] = {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "k"}
        config["providers"]["anth"] = {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "k"}
        config["routes"]["real_chat"] = {"provider": "oai", "operation": "chat", "models": ["gpt-4o"]}
        config["routes"]["real_claude"] = {"provider": "anth", "operation": "messages",
                                           "models": ["claude-x"]}
        ask = [{"role": "user", "content": "one two three four five six"}]  # "echo: " + 6: as ours
        async with running(parse_config(config), port=0) as (_, url), sdk_clients(url) as c:
            shapes = []
            for model in ("mock-gpt", "gpt-4o"):
                stream = await c.openai.chat.completions.create(
                    model=model, messages=ask, stream=True, stream_options={"include_usage": True})
                shapes.append([openai_shape(ch) async for ch in stream])
            assert shapes[0] == shapes[1]
            events = []
            for model in ("mock-claude", "claude-x"):
                stream = await c.anthropic.messages.create(model=model, max_tokens=64, messages=ask,
                                                           stream=True)
                events.append([e.type async for e in stream])
            assert events[0] == events[1]


# -- /rpc, the lane's clock, settings --------------------------------------------------------------
async def test_rpc_calls_get_the_same_shapes(mock) -> None:
    gw, _ = mock
    chat = await gw.submit(Call("chat", {"messages": ASK}))
    assert chat.result["object"] == "chat.completion" and chat.result["model"] == "mock-gpt"
    assert chat.result["choices"][0]["message"]["content"] == REPLY
    refused = await gw.submit(Call("chat", {"messages": ASK, "stream": True}))
    assert refused.error is not None and refused.error.data["param"] == "stream"
    no_messages = await gw.submit(Call("claude", {"max_tokens": 5}))
    assert no_messages.error is not None
    assert no_messages.error.data["detail"] == "'messages' must be a non-empty array"


async def test_a_fixed_response(tmp_path: Path) -> None:
    config = parse_config(mock_config(tmp_path / "jobs.db", response="Always the same."))
    async with running(config, port=0) as (_, url), sdk_clients(url) as c:
        reply = await c.openai.chat.completions.create(model="mock-gpt", messages=ASK)
        message = await c.anthropic.messages.create(model="mock-claude", max_tokens=9, messages=ASK)
    assert reply.choices[0].message.content == message.content[0].text == "Always the same."
    assert reply.usage.completion_tokens == 3


class WatchedClock(ManualClock):
    """A manual clock that says when something starts waiting on it, and for how long."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.waiting = anyio.Event()

    async def sleep_until(self, deadline: float) -> None:
        self.waits.append(round(deadline - self.now(), 6))
        self.waiting.set()
        await super().sleep_until(deadline)


@pytest.mark.parametrize("streamed", [False, True])
async def test_latency_is_waited_on_the_providers_clock(tmp_path: Path, streamed: bool) -> None:
    clock = WatchedClock()
    provider = make_provider(MockProvider, {"latency_ms": 250}, tmp_path, clock)
    assert isinstance(provider, Streamer)
    call = item(provider, "chat", {"messages": ASK})
    send, receive = anyio.create_memory_object_stream[Any](100)
    done: list[Outcome] = []

    async def run() -> None:
        if streamed:
            done.append(await provider.stream(call, ChunkSink(send)))
        else:
            done.extend(await provider.execute("chat", [call]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await clock.waiting.wait()
        assert clock.waits == [0.25] and not done
        assert receive.statistics().current_buffer_used == 0  # no word before the model's time
        await clock.advance(0.25)
    assert done[0].ok
    if streamed:
        assert receive.statistics().current_buffer_used == 1 + 8 + 1
        assert done[0].result == {"usage": {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}}
    else:
        assert done[0].result["choices"][0]["message"]["content"] == REPLY
        assert done[0].result["created"] == int(clock.wall())
