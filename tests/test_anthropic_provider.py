"""AnthropicProvider against respx: headers, messages, 429/529, learned limits, malformed bodies."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
import respx

from multiplexer.core.errors import Code, RpcError
from providers.anthropic import AnthropicProvider, auth_headers
from tests.remote_helpers import InstantClock, body, item, make_provider, started

pytestmark = pytest.mark.anyio
BASE = "http://claude.test"



def provider(tmp_path, **kw):
    settings = {"base_url": BASE, "api_key": "ant-secret", **kw.pop("settings", {})}
    return make_provider(AnthropicProvider, settings, tmp_path, **kw)


def msg(p, text, **extra):
    return item(p, "messages", {"model": "claude", "max_tokens": 16,
                                "messages": [{"role": "user", "content": text}], **extra})


def reply(text, input_tokens=3, output_tokens=2):
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def echo(request):
    return httpx.Response(200, json=reply("echo: " + body(request)["messages"][0]["content"]))


async def test_messages_carry_key_and_version_and_each_call_gets_its_reply(tmp_path):
    p = provider(tmp_path, settings={"beta": ["b1", "b2"]})
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/v1/messages").mock(side_effect=echo)
        async with started(p):
            out = await p.execute("messages", [msg(p, "a"), msg(p, "b")])
    assert [o.result["content"][0]["text"] for o in out] == ["echo: a", "echo: b"]
    headers = route.calls[0].request.headers
    assert headers["x-api-key"] == "ant-secret"
    assert headers["anthropic-version"] == "2023-06-01"
    assert headers["anthropic-beta"] == "b1,b2"
    assert "authorization" not in headers


def test_prepare_and_dedup(tmp_path):
    p = provider(tmp_path)
    it = msg(p, "hello", system="be brief")
    assert it.group == ("messages", "claude") and it.tokens > 16
    for bad in ({"model": "c", "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
                {"model": "c", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
                {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
                {"model": "c", "max_tokens": 5, "messages": []}):
        with pytest.raises(RpcError) as e:
            item(p, "messages", bad)
        assert e.value.code == Code.INVALID_PARAMS
    assert p.dedup_safe(msg(p, "x", temperature=0))
    assert not p.dedup_safe(msg(p, "x"))


def test_key_from_environment(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "from-env")
    settings = AnthropicProvider.Settings.model_validate({})
    assert auth_headers(settings)["x-api-key"] == "from-env"
    assert settings.batch_max_requests == 100_000


async def test_529_overloaded_honours_retry_after(tmp_path):
    clock = InstantClock()
    p = provider(tmp_path, clock=clock)
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/v1/messages").mock(side_effect=[
            httpx.Response(529, headers={"retry-after": "4"}, json=overloaded), echo])
        async with started(p):
            out = await p.execute("messages", [msg(p, "x")])
    assert route.call_count == 2 and out[0].ok
    assert clock.sleeps == [4.0]


async def test_429_without_retry_after_waits_for_the_rfc3339_reset(tmp_path, monkeypatch):
    clock = InstantClock()
    p = provider(tmp_path, clock=clock)
    wall = clock.wall()
    reset = datetime.fromtimestamp(wall + 20, tz=UTC).isoformat().replace("+00:00", "Z")
    headers = {"anthropic-ratelimit-requests-limit": "50",
               "anthropic-ratelimit-requests-remaining": "0",
               "anthropic-ratelimit-requests-reset": reset}
    limited = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    with respx.mock(base_url=BASE) as mock:
        mock.post("/v1/messages").mock(side_effect=[
            httpx.Response(429, headers=headers, json=limited), echo])
        async with started(p):
            out = await p.execute("messages", [msg(p, "x")])
            assert p.ctx.limiter.requests.capacity == 50
    assert out[0].ok
    assert clock.sleeps == [20.0]


async def test_errors_keep_the_upstream_message(tmp_path):
    p = provider(tmp_path)
    invalid = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad field"}}
    with respx.mock(base_url=BASE) as mock:
        mock.post("/v1/messages").mock(return_value=httpx.Response(400, json=invalid))
        async with started(p):
            out = await p.execute("messages", [msg(p, "x")])
    assert out[0].error.data["upstream_status"] == 400
    assert "bad field" in out[0].error.data["detail"]


async def test_5xx_timeouts_and_malformed_bodies(tmp_path):
    p = provider(tmp_path)

    def handler(request):
        text = body(request)["messages"][0]["content"]
        if text == "boom":
            return httpx.Response(500, json={"type": "error", "error": {"type": "api_error"}})
        if text == "slow":
            raise httpx.ReadTimeout("slow")
        if text == "garbled":
            return httpx.Response(200, content=b"\x00\x01 not json")
        return echo(request)

    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/v1/messages").mock(side_effect=handler)
        async with started(p):
            out = await p.execute("messages", [msg(p, t) for t in ("ok", "boom", "slow", "garbled")])
            det = await p.execute("messages", [msg(p, "boom", temperature=0)])
    assert out[0].ok
    assert out[1].error.data["upstream_status"] == 500
    assert out[2].error.code == Code.UPSTREAM_UNAVAILABLE
    assert "malformed" in out[3].error.data["detail"]
    assert route.call_count == 4 + 3  # the deterministic 500 is retried (3 attempts)
    assert det[0].error.data["upstream_status"] == 500


async def test_usage_corrects_tokens_and_headers_teach_tokens(tmp_path):
    p = provider(tmp_path, tpm=5_000)
    headers = {"anthropic-ratelimit-tokens-limit": "5000",
               "anthropic-ratelimit-tokens-remaining": "4000",
               "anthropic-ratelimit-tokens-reset": "2100-01-01T00:00:00Z"}
    with respx.mock(base_url=BASE) as mock:
        mock.post("/v1/messages").mock(
            return_value=httpx.Response(200, headers=headers, json=reply("x", 100, 50)))
        async with started(p):
            it = msg(p, "x")
            p.ctx.limiter.consume(1, it.tokens)
            await p.execute("messages", [it])
    # clamped to what the upstream reported, then charged the 150 real tokens minus the estimate
    assert p.ctx.limiter.tokens.level == pytest.approx(4000 - (150 - it.tokens))
