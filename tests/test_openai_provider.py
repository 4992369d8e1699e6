"""OpenAIProvider against respx: every request and response shape, packing, retries and limits."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
import respx

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.sink import ChunkSink
from providers.openai import OpenAIProvider, auth_headers
from tests.remote_helpers import (
    InstantClock,
    body,
    chat_reply,
    embedding_reply,
    item,
    make_provider,
    started,
)

pytestmark = pytest.mark.anyio
BASE = "http://oai.test/v1"
SETTINGS = {"base_url": BASE, "api_key": "sk-secret-key", "organization": "org-1"}



def provider(tmp_path, **kw):
    settings = {**SETTINGS, **kw.pop("settings", {})}
    return make_provider(OpenAIProvider, settings, tmp_path, **kw)


def embed(p, inputs, model="emb", **extra):
    return item(p, "embeddings", {"model": model, "input": inputs, **extra})


def chat(p, text, **extra):
    return item(p, "chat", {"model": "gpt", "messages": [{"role": "user", "content": text}], **extra})


def echo_embeddings(request: httpx.Request, **kw) -> httpx.Response:
    sent = body(request)
    inputs = sent["input"] if isinstance(sent["input"], list) else [sent["input"]]
    return httpx.Response(200, json=embedding_reply(inputs, sent["model"], **kw))


# -- packing ---------------------------------------------------------------------

async def test_embedding_calls_are_packed_into_one_request_and_scattered_back(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/embeddings").mock(
            side_effect=lambda r: echo_embeddings(r, shuffle=True))
        async with started(p):
            items = [embed(p, "one two"), embed(p, ["a", "b c d"]), embed(p, "last")]
            out = await p.execute("embeddings", items)
    assert route.call_count == 1
    sent = body(route.calls[0].request)
    assert sent == {"model": "emb", "input": ["one two", "a", "b c d", "last"]}
    assert [o.ok for o in out] == [True, True, True]
    first, second, third = (o.result for o in out)
    assert [d["text"] for d in first["data"]] == ["one two"]
    assert [d["index"] for d in second["data"]] == [0, 1]
    assert [d["text"] for d in second["data"]] == ["a", "b c d"]
    assert [d["text"] for d in third["data"]] == ["last"]
    # usage is shared out and adds up to what the upstream reported (7 words)
    shares = [o.result["usage"]["prompt_tokens"] for o in out]
    assert sum(shares) == 7 and all(s >= 1 for s in shares)
    assert first["object"] == "list" and first["model"] == "emb"


async def test_packing_respects_max_inputs_and_token_budget(tmp_path):
    p = provider(tmp_path, settings={"max_inputs": 3, "max_batch_tokens": 50})
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/embeddings").mock(side_effect=echo_embeddings)
        async with started(p):
            items = [embed(p, f"t{i}") for i in range(7)] + [embed(p, "x" * 400)]
            out = await p.execute("embeddings", items)
    sizes = [len(body(c.request)["input"]) for c in route.calls]
    assert sorted(sizes) == [1, 1, 3, 3]  # 7 small in 3+3+1, the 100-token text alone
    assert all(o.ok for o in out)
    assert [o.result["data"][0]["text"] for o in out[:7]] == [f"t{i}" for i in range(7)]


async def test_one_callers_inputs_may_span_requests(tmp_path):
    p = provider(tmp_path, settings={"max_inputs": 2})
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/embeddings").mock(side_effect=echo_embeddings)
        async with started(p):
            out = await p.execute("embeddings", [embed(p, ["a", "b", "c"]), embed(p, "d")])
    assert route.call_count == 2
    assert [d["text"] for d in out[0].result["data"]] == ["a", "b", "c"]
    assert [d["index"] for d in out[0].result["data"]] == [0, 1, 2]
    assert [d["text"] for d in out[1].result["data"]] == ["d"]


async def test_a_refused_packed_request_is_resent_per_caller(tmp_path):
    p = provider(tmp_path)

    def handler(request):
        if any("BAD" in x for x in body(request)["input"]):
            return httpx.Response(400, json={"error": {"message": "input BAD rejected",
                                                       "type": "invalid_request_error"}})
        return echo_embeddings(request)

    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/embeddings").mock(side_effect=handler)
        async with started(p):
            out = await p.execute("embeddings", [embed(p, "good"), embed(p, "BAD"), embed(p, "fine")])
    assert route.call_count == 4  # packed, then one per caller
    assert out[0].ok and out[2].ok
    assert out[1].error.code == Code.UPSTREAM_ERROR
    assert out[1].error.data["upstream_status"] == 400
    assert "BAD" in out[1].error.data["detail"]


@pytest.mark.parametrize("reply", [
    httpx.Response(200, text="<html>oops</html>"),
    httpx.Response(200, json=["not", "an", "object"]),
    httpx.Response(200, json={"data": [{"index": 0, "embedding": [1.0]}]}),  # one vector for two
    httpx.Response(200, json={"data": [{"index": 0, "embedding": [1.0]},
                                       {"index": 0, "embedding": [2.0]}]}),  # duplicate index
])
async def test_malformed_embedding_bodies_fail_the_callers_clearly(tmp_path, reply):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        mock.post("/embeddings").mock(return_value=reply)
        async with started(p):
            out = await p.execute("embeddings", [embed(p, "a"), embed(p, "b")])
    for o in out:
        assert o.error is not None and o.error.code == Code.UPSTREAM_ERROR
        assert "malformed" in o.error.data["detail"]


async def test_differently_shaped_embedding_calls_do_not_share_a_group(tmp_path):
    p = provider(tmp_path)
    a, b, c = embed(p, "x"), embed(p, "y"), embed(p, "z", dimensions=4)
    assert a.group == b.group == ("embeddings", "emb")
    assert c.group != a.group
    assert embed(p, "x", model="other").group == ("embeddings", "other")


# -- chat ------------------------------------------------------------------------

async def test_chat_calls_go_one_request_each_concurrently(tmp_path):
    p = provider(tmp_path)
    arrived, all_in = 0, anyio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        nonlocal arrived
        arrived += 1
        if arrived == 3:
            all_in.set()
        with anyio.fail_after(10):  # one after another, the first would wait here for good
            await all_in.wait()
        return httpx.Response(200, json=chat_reply("echo " + body(request)["messages"][0]["content"]))

    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/chat/completions").mock(side_effect=answer)
        async with started(p):
            out = await p.execute("chat", [chat(p, "a"), chat(p, "b"), chat(p, "c")])
    assert route.call_count == 3 and all_in.is_set()
    assert [o.result["choices"][0]["message"]["content"] for o in out] == ["echo a", "echo b", "echo c"]
    request = route.calls[0].request
    assert request.headers["authorization"] == "Bearer sk-secret-key"
    assert request.headers["openai-organization"] == "org-1"


async def test_prepare_validates_and_estimates(tmp_path):
    p = provider(tmp_path)
    it = chat(p, "hello there", max_tokens=50)
    assert it.group == ("chat", "gpt") and it.tokens > 50
    with pytest.raises(RpcError) as e:
        item(p, "chat", {"messages": [{"role": "user", "content": "x"}]})
    assert e.value.code == Code.INVALID_PARAMS and e.value.data["param"] == "model"
    with pytest.raises(RpcError):
        item(p, "chat", {"model": "m", "messages": []})
    with pytest.raises(RpcError):
        chat(p, "x", stream=True)
    with pytest.raises(RpcError):
        embed(p, "")
    with pytest.raises(RpcError):
        embed(p, [1.5])
    with pytest.raises(RpcError) as missing:
        item(p, "completions", {"model": "m"})
    assert missing.value.data["param"] == "prompt"
    with pytest.raises(RpcError) as missing:
        item(p, "responses", {"model": "m"})
    assert missing.value.data["param"] == "input"
    assert item(p, "completions", {"model": "m", "prompt": "abcd", "max_tokens": 7}).tokens == 1 + 7
    assert item(p, "responses", {"model": "m", "input": "abcd", "max_output_tokens": 7}).tokens == 1 + 7
    assert embed(p, [[1, 2, 3]]).tokens == 3  # token arrays count exactly
    batch = item(p, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                 mode="batch")
    assert batch.tokens == 0 and batch.options["tokens"] > 0  # batch quota is separate


def test_dedup_only_for_deterministic_chat_and_embeddings(tmp_path):
    p = provider(tmp_path)
    assert p.dedup_safe(embed(p, "x"))
    assert p.dedup_safe(chat(p, "x", temperature=0))
    assert not p.dedup_safe(chat(p, "x"))
    assert not p.dedup_safe(chat(p, "x", temperature=0.7))
    assert not p.dedup_safe(chat(p, "x", temperature=0, n=3))


def test_api_key_is_secret_and_falls_back_to_the_environment(tmp_path, monkeypatch):
    p = provider(tmp_path)
    assert "sk-secret-key" not in repr(p.settings) and "sk-secret-key" not in str(p.settings)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    settings = OpenAIProvider.Settings.model_validate({"base_url": BASE})
    assert auth_headers(settings)["authorization"] == "Bearer sk-from-env"


# -- retries and learned limits ----------------------------------------------------

async def test_429_with_retry_after_pauses_the_lane_and_retries(tmp_path):
    clock = InstantClock()
    p = provider(tmp_path, clock=clock)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/chat/completions").mock(side_effect=[
            httpx.Response(429, headers={"retry-after": "7"}, json={"error": {"message": "slow"}}),
            httpx.Response(200, json=chat_reply("ok")),
        ])
        async with started(p):
            start = clock.now()
            out = await p.execute("chat", [chat(p, "x")])
            assert p.ctx.limiter.paused_until == start + 7
    assert out[0].ok and route.call_count == 2
    assert clock.sleeps == [7.0]


async def test_429_without_retry_after_waits_for_the_reported_reset(tmp_path):
    clock = InstantClock()
    p = provider(tmp_path, clock=clock)
    limited = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
               "x-ratelimit-reset-requests": "45s"}
    with respx.mock(base_url=BASE) as mock:
        mock.post("/chat/completions").mock(side_effect=[
            httpx.Response(429, headers=limited, json={"error": {"message": "rpm"}}),
            httpx.Response(200, json=chat_reply("ok")),
        ])
        async with started(p):
            start = clock.now()
            out = await p.execute("chat", [chat(p, "x")])
            assert p.ctx.limiter.paused_until == start + 45
    assert out[0].ok
    assert clock.sleeps == [45.0]


async def test_429_without_any_hint_backs_off_then_gives_up_with_rate_limit_detail(tmp_path):
    clock = InstantClock()
    p = provider(tmp_path, clock=clock, attempts=3)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/chat/completions").mock(
            return_value=httpx.Response(429, json={"error": {"message": "too many"}}))
        async with started(p):
            out = await p.execute("chat", [chat(p, "x")])
    assert route.call_count == 3
    assert len(clock.sleeps) == 2 and all(0 < s <= 0.2 for s in clock.sleeps)
    assert out[0].error.data["upstream_status"] == 429


async def test_5xx_is_retried_only_where_safe(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        chat_route = mock.post("/chat/completions").mock(
            return_value=httpx.Response(500, json={"error": {"message": "boom"}}))
        emb_route = mock.post("/embeddings").mock(side_effect=[
            httpx.Response(502, text="bad gateway"), httpx.Response(200, json=embedding_reply(["a"]))])
        async with started(p):
            chat_out = await p.execute("chat", [chat(p, "x")])
            emb_out = await p.execute("embeddings", [embed(p, "a")])
    assert chat_route.call_count == 1  # it may have run: not repeated for a sampling call
    assert chat_out[0].error.data["upstream_status"] == 500
    assert emb_route.call_count == 2 and emb_out[0].ok


async def test_503_and_deterministic_500_are_retried(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/chat/completions").mock(side_effect=[
            httpx.Response(503), httpx.Response(500), httpx.Response(200, json=chat_reply("ok"))])
        async with started(p):
            out = await p.execute("chat", [chat(p, "x", temperature=0)])
    assert route.call_count == 3 and out[0].ok


async def test_timeouts(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        conn_route = mock.post("/chat/completions", json__messages__0__content="conn").mock(
            side_effect=[httpx.ConnectError("refused"), httpx.Response(200, json=chat_reply("ok"))])
        chat_route = mock.post("/chat/completions").mock(side_effect=httpx.ReadTimeout("slow"))
        emb_route = mock.post("/embeddings").mock(side_effect=[
            httpx.ReadTimeout("slow"), httpx.Response(200, json=embedding_reply(["a"]))])
        async with started(p):
            conn_out = await p.execute("chat", [chat(p, "conn")])
            chat_out = await p.execute("chat", [chat(p, "x")])
            emb_out = await p.execute("embeddings", [embed(p, "a")])
    assert conn_route.call_count == 2 and conn_out[0].ok  # never reached the server: safe
    assert chat_route.call_count == 1
    assert chat_out[0].error.code == Code.UPSTREAM_UNAVAILABLE
    assert "ReadTimeout" in chat_out[0].error.data["detail"]
    assert emb_route.call_count == 2 and emb_out[0].ok


async def test_malformed_chat_body_fails_only_that_call(tmp_path):
    p = provider(tmp_path)

    def handler(request):
        if body(request)["messages"][0]["content"] == "bad":
            return httpx.Response(200, text="{truncated")
        return httpx.Response(200, json=chat_reply("ok"))

    with respx.mock(base_url=BASE) as mock:
        mock.post("/chat/completions").mock(side_effect=handler)
        async with started(p):
            out = await p.execute("chat", [chat(p, "good"), chat(p, "bad")])
    assert out[0].ok
    assert out[1].error.code == Code.UPSTREAM_ERROR and "malformed" in out[1].error.data["detail"]


async def test_rate_limit_headers_teach_the_limiter(tmp_path):
    p = provider(tmp_path)
    headers = {"x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "3",
               "x-ratelimit-reset-requests": "12ms", "x-ratelimit-limit-tokens": "1000",
               "x-ratelimit-remaining-tokens": "-1", "x-ratelimit-reset-tokens": "6s"}
    with respx.mock(base_url=BASE) as mock:
        mock.post("/chat/completions").mock(
            return_value=httpx.Response(200, headers=headers, json=chat_reply("ok")))
        async with started(p):
            await p.execute("chat", [chat(p, "x")])
    limiter = p.ctx.limiter
    assert limiter.requests is not None and limiter.requests.capacity == 100
    assert limiter.requests.level == 3
    # full again in 12 ms: fast for those 12 ms only, then the plan's 100 per minute
    assert limiter.requests.until == pytest.approx(p.ctx.clock.now() + 0.012, abs=0.5)
    assert limiter.requests.rate == pytest.approx(100 / 60)
    assert limiter.tokens is None  # "-1" means unknown: nothing learned


async def test_usage_corrects_the_token_estimate(tmp_path):
    p = provider(tmp_path, tpm=10_000)
    with respx.mock(base_url=BASE) as mock:
        mock.post("/chat/completions").mock(
            return_value=httpx.Response(200, json=chat_reply("ok", 400, 100)))
        async with started(p):
            it = chat(p, "short")
            p.ctx.limiter.consume(1, it.tokens)  # what the lane charged
            await p.execute("chat", [it])
    assert p.ctx.limiter.tokens.level == pytest.approx(10_000 - 500)


# -- transport and defaults ----------------------------------------------------

async def test_a_respx_router_handed_in_as_the_transport_gets_every_request(tmp_path):
    router = respx.MockRouter(base_url=BASE)
    route = router.post("/chat/completions").mock(
        return_value=httpx.Response(200, json=chat_reply("hi")))
    p = provider(tmp_path, transport=httpx.MockTransport(router.async_handler))
    async with started(p):
        out = await p.execute("chat", [chat(p, "hello")])
    assert out[0].result == chat_reply("hi")
    sent = route.calls[0].request
    assert sent.headers["authorization"] == "Bearer sk-secret-key"
    assert sent.headers["content-type"] == "application/json"
    assert body(sent)["messages"] == [{"role": "user", "content": "hello"}]


def test_default_concurrency_does_not_cap_a_64_client_run():
    from multiplexer.gateway.config import ProviderConfig
    from multiplexer.gateway.gateway import with_kind_defaults
    from providers.llm_base import DEFAULT_CONCURRENCY

    def effective(limits):
        conf = ProviderConfig.model_validate({"kind": "openai", "limits": limits, **SETTINGS})
        out = with_kind_defaults(conf, OpenAIProvider)
        assert conf.limits.concurrency == limits.get("concurrency", 16)  # the config is not changed
        return out.limits.concurrency

    assert effective({}) == DEFAULT_CONCURRENCY >= 64
    assert effective({"concurrency": 8}) == 8  # what the config says wins


class _BreaksAfterOneEvent(httpx.AsyncByteStream):
    """An upstream stream that sends one event, then loses its connection."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "one"}}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


async def test_a_stream_broken_mid_way_ends_as_upstream_unavailable(tmp_path):
    p = provider(tmp_path)
    send, receive = anyio.create_memory_object_stream[Any](10)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/chat/completions").mock(return_value=httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_BreaksAfterOneEvent()))
        async with started(p), send, receive:
            out = await p.stream(chat(p, "hello"), ChunkSink(send))
            chunks = [receive.receive_nowait() for _ in range(receive.statistics().current_buffer_used)]
    assert route.call_count == 1  # not sent again: its first event had reached the caller
    assert chunks == [{"choices": [{"index": 0, "delta": {"content": "one"}}]}]
    assert out.error is not None and out.error.code == Code.UPSTREAM_UNAVAILABLE
    assert "ReadError" in out.error.data["detail"] and "broke off" in out.error.data["detail"]
