"""The OpenAI surface on local models: chat on a generate model (whole, and streamed token by
token from the continuous batcher) and embeddings on the packaged MiniLM, via the openai SDK."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.local_helpers import MINILM, tiny_causal_lm

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> Path:
    return tiny_causal_lm(tmp_path_factory.mktemp("llama"))


@asynccontextmanager
async def gateway(lm_dir: Path, tmp_path: Path):
    config = parse_config({
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"local": {"kind": "local", "models": {
            "lm": {"source": str(lm_dir), "task": "generate", "device": "cpu", "dtype": "float32",
                   "max_new_tokens": 12},
            "minilm": {"source": MINILM, "task": "embed", "device": "cpu", "compile": False},
        }}},
        "routes": {
            "writer": {"provider": "local", "model": "lm", "models": ["tiny-llama"]},
            "embed_local": {"provider": "local", "model": "minilm", "models": ["all-MiniLM-L6-v2"]},
        },
    })
    async with (
        running(config, port=0) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        yield gw, client


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_local_chat_whole_and_streamed_agree(lm_dir, tmp_path):
    async with gateway(lm_dir, tmp_path) as (gw, client):
        whole = await client.chat.completions.create(model="tiny-llama", messages=ask("the cat runs"),
                                                     max_tokens=10)
        assert whole.object == "chat.completion" and whole.model == "tiny-llama"
        text = whole.choices[0].message.content
        assert text and 1 <= whole.usage.completion_tokens <= 10
        finish = whole.choices[0].finish_reason
        assert finish in ("stop", "length")

        stream = await client.chat.completions.create(
            model="tiny-llama", messages=ask("the cat runs"), max_tokens=10, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        pieces = [c.choices[0].delta.content for c in chunks if c.choices]
        assert "".join(pieces) == text  # greedy: the same words, now token by token
        assert len([p for p in pieces if p]) >= min(3, whole.usage.completion_tokens)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
        assert chunks[-1].usage == whole.usage
        first_chunks = gw.metrics.registry.get_sample_value(
            "multiplexer_time_to_first_chunk_seconds_count", {"route": "writer"})
        assert first_chunks == 1.0  # the stream's time to first chunk; the whole call has none


async def test_local_streams_share_the_batcher(lm_dir, tmp_path):
    async with gateway(lm_dir, tmp_path) as (gw, client):
        engine = (await gw.providers["local"].pool.ready("lm")).engine  # type: ignore[attr-defined]
        rows: list[int] = []
        engine.listeners.append(lambda e: rows.append(len(e.running)))
        texts: dict[int, str] = {}

        async def one(i: int) -> None:
            stream = await client.chat.completions.create(
                model="tiny-llama", messages=ask(f"dog {i}"), max_tokens=8, stream=True)
            texts[i] = "".join([c.choices[0].delta.content or "" async for c in stream])

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        assert len(texts) == 4 and all(texts.values())
        assert max(rows) > 1  # decoded side by side in one continuous batch


async def test_local_embeddings_float_and_base64(lm_dir, tmp_path):
    async with gateway(lm_dir, tmp_path) as (_, client):
        floats = await client.embeddings.create(model="all-MiniLM-L6-v2", input=["a cat", "a dog"],
                                                encoding_format="float")
        decoded = await client.embeddings.create(model="all-MiniLM-L6-v2", input=["a cat", "a dog"])
        assert len(floats.data) == 2 and len(floats.data[0].embedding) == 384
        for f, d in zip(floats.data, decoded.data, strict=True):
            assert d.embedding == pytest.approx(f.embedding, abs=1e-6)
        # token ids (LangChain's default sends tiktoken's) would be other words here: refused, named
        for ids in ([7592, 2088], [[101, 7592, 102]]):
            with pytest.raises(openai.BadRequestError, match="holds token ids") as refused:
                await client.embeddings.create(model="all-MiniLM-L6-v2", input=ids)
            assert refused.value.param == "input"
        with pytest.raises(openai.BadRequestError, match="is 602 tokens long") as refused:
            await client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 600)
        assert refused.value.param == "input"
        with pytest.raises(openai.BadRequestError):  # an embedding model does not chat
            await client.chat.completions.create(model="all-MiniLM-L6-v2", messages=ask("x"),
                                                 stream=True)


async def test_a_client_gone_mid_stream_leaves_the_batch(lm_dir, tmp_path):
    """The engine is held after its first step while the client hangs up; the request must be
    marked cancelled, and the next step drops it instead of decoding on."""
    import threading

    import httpx

    async with gateway(lm_dir, tmp_path) as (gw, client):
        provider = gw.providers["local"]
        engine = (await provider.pool.ready("lm")).engine  # type: ignore[attr-defined]
        engine.eos = set()  # no early end: only a cancel stops it before max_tokens
        release, steps, seen = threading.Event(), [0], []
        step = engine._step

        def held_step(joiners):
            steps[0] += 1
            if steps[0] == 2:
                release.wait(40)  # past the test's own 30 s guard on the cancel
            return step(joiners)

        engine._step = held_step
        generate = provider.pool.generate

        async def recording(name, requests):
            seen.extend(requests)
            return await generate(name, requests)

        provider.pool.generate = recording
        url = str(client.base_url)
        async with httpx.AsyncClient() as http, http.stream(
                "POST", url + "chat/completions",
                json={"model": "tiny-llama", "messages": ask("the cat"), "max_tokens": 60,
                      "stream": True}) as r:
            first = await r.aiter_lines().__anext__()
            assert first.startswith("data: ")
        with anyio.fail_after(30):
            while not seen or not seen[0].cancelled:
                await anyio.sleep(0.01)
        release.set()
        with anyio.fail_after(10):
            await seen[0].done.wait()
        assert seen[0].finish_reason == "cancelled" and len(seen[0].tokens) < 5


async def test_chat_uses_the_models_chat_template(lm_dir, tmp_path):
    """With a template, the conversation is rendered by it: the reply equals the completion of
    the rendered text; without one, the plain transcript is the prompt."""
    from multiplexer.core.call import Call

    async with gateway(lm_dir, tmp_path) as (gw, client):
        handle = await gw.providers["local"].pool.ready("lm")  # type: ignore[attr-defined]

        async def completion(prompt: str) -> str:
            outcome = await gw.submit(Call("writer", {"prompt": prompt, "max_new_tokens": 6}))
            return outcome.result["choices"][0]["text"]

        messages = [{"role": "system", "content": "the moon"}, *ask("a red bird sings")]
        plain = await client.chat.completions.create(model="tiny-llama", messages=messages,
                                                     max_tokens=6)
        assert plain.choices[0].message.content == await completion(
            "system: the moon\nuser: a red bird sings\nassistant:")

        handle.loaded.tokenizer.chat_template = (
            "{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}answer{% endif %}")
        templated = await client.chat.completions.create(model="tiny-llama", messages=messages,
                                                         max_tokens=6)
        assert templated.choices[0].message.content == await completion(
            "the moon a red bird sings answer")
        assert templated.choices[0].message.content != plain.choices[0].message.content


async def test_local_responses_whole_and_streamed_agree_with_chat(lm_dir, tmp_path):
    """The Responses API on a local generate model: the same text as chat, in its own shapes."""
    async with gateway(lm_dir, tmp_path) as (_, client):
        chat = await client.chat.completions.create(model="tiny-llama", messages=ask("the cat runs"),
                                                    max_tokens=10)
        whole = await client.responses.create(model="tiny-llama", input="the cat runs", max_output_tokens=10)
        assert whole.object == "response" and whole.model == "tiny-llama"
        assert whole.output_text == chat.choices[0].message.content
        assert whole.usage.output_tokens == chat.usage.completion_tokens
        assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

        stream = await client.responses.create(model="tiny-llama", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "the cat runs"}]}],
            max_output_tokens=10, stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        assert events[-1].response.output_text == whole.output_text
        assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
        assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_local_responses_refuse_what_a_local_model_cannot_do(lm_dir, tmp_path):
    async with gateway(lm_dir, tmp_path) as (_, client):
        with pytest.raises(openai.BadRequestError, match="keeps no responses"):
            await client.responses.create(model="tiny-llama", input="x", previous_response_id="resp_1")
        with pytest.raises(openai.BadRequestError, match="text content only"):
            await client.responses.create(model="tiny-llama", input=[
                {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])


async def test_local_completions_take_the_prompt_as_it_is(lm_dir, tmp_path):
    """Legacy completions on a local generate model: no chat template, the API's shapes."""
    async with gateway(lm_dir, tmp_path) as (gw, client):
        native = await gw.submit(Call("writer", {"prompt": "the cat runs", "max_tokens": 8}))
        assert native.ok, native.error
        whole = await client.completions.create(model="tiny-llama", prompt="the cat runs", max_tokens=8)
        assert whole.object == "text_completion" and whole.model == "tiny-llama"
        assert whole.choices[0].text == native.result["choices"][0]["text"]
        assert whole.usage.completion_tokens == native.result["usage"]["completion_tokens"]
        stream = await client.completions.create(model="tiny-llama", prompt="the cat runs", max_tokens=8,
                                                 stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            await client.completions.create(model="tiny-llama", prompt="x", logprobs=2)
