"""Fallbacks: a call moves to its next route on the errors another provider may not have, never on
the caller's own, and retries times fallbacks never exceed ``max_attempts`` upstream requests."""

from __future__ import annotations

import pytest

from multiplexer.core.call import Call
from multiplexer.core.errors import Code
from multiplexer.gateway.config import ConfigError, parse_config
from tests.fallback_helpers import answered_by, chat, gateway, upstreams

pytestmark = pytest.mark.anyio

ROUTES = {
    "chat_a": {"provider": "a", "operation": "chat", "params": {"model": "gpt-a"},
               "fallbacks": ["chat_b"], "context_window_fallbacks": ["chat_big"]},
    "chat_b": {"provider": "b", "operation": "chat", "params": {"model": "gpt-b"}},
    "chat_big": {"provider": "big", "operation": "chat", "params": {"model": "gpt-big"}},
}


@pytest.mark.parametrize("failure", [429, 500, 502, 503, "connect", "timeout", "malformed"])
async def test_a_retryable_failure_reaches_the_fallback(tmp_path, failure):
    router, up = upstreams("a", "b", "big")
    up["a"].forever(failure)
    call = Call("chat_a", chat())
    async with gateway(tmp_path, router, up, ROUTES, attempts=1) as gw:
        out = await gw.submit(call)
    assert out.ok, out.error
    assert answered_by(out.result) == "b"
    assert call.route == "chat_b"
    assert (up["a"].count, up["b"].count, up["big"].count) == (1, 1, 0)
    assert up["b"].requests[0]["model"] == "gpt-b"  # the fallback's own model
    assert gw.metrics.fallbacks.labels("chat_a", "chat_b", _reason(failure))._value.get() == 1


def _reason(failure):
    return {429: "rate_limit", "connect": "connection", "timeout": "timeout",
            "malformed": "malformed"}.get(failure, "server_error")


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_a_clients_own_error_never_falls_back(tmp_path, status):
    router, up = upstreams("a", "b", "big")
    up["a"].forever(status)
    call = Call("chat_a", chat())
    async with gateway(tmp_path, router, up, ROUTES) as gw:
        out = await gw.submit(call)
    assert out.error is not None and out.error.data["upstream_status"] == status
    assert (up["a"].count, up["b"].count, up["big"].count) == (1, 0, 0)
    assert call.route == "chat_a"


async def test_a_context_length_refusal_goes_to_the_context_window_fallback_only(tmp_path):
    router, up = upstreams("a", "b", "big")
    up["a"].forever("context")
    async with gateway(tmp_path, router, up, ROUTES) as gw:
        out = await gw.submit(Call("chat_a", chat()))
    assert answered_by(out.result) == "big"
    assert (up["a"].count, up["b"].count, up["big"].count) == (1, 0, 1)


async def test_a_context_length_refusal_without_a_context_fallback_is_the_callers(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].forever("context")
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": []}, "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes) as gw:
        out = await gw.submit(Call("chat_a", chat()))
    assert out.error is not None and out.error.data["upstream_code"] == "context_length_exceeded"
    assert up["b"].count == 0


async def test_429_is_retried_on_its_route_first_then_falls_back(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].forever(429)
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": [], "max_attempts": 4},
              "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=3) as gw:
        out = await gw.submit(Call("chat_a", chat()))
    assert answered_by(out.result) == "b"
    # three tries on a (its retry policy, one request kept for b), then one on b
    assert (up["a"].count, up["b"].count) == (3, 1)


@pytest.mark.parametrize("max_attempts", [1, 2, 3, 5])
async def test_retries_times_fallbacks_never_exceed_max_attempts(tmp_path, max_attempts):
    router, up = upstreams("a", "b", "c")
    for u in up.values():
        u.forever(503)  # retried by each provider's policy (3 tries) and a fallback reason
    routes = {"r_a": {"provider": "a", "operation": "chat", "params": {"model": "m"},
                      "fallbacks": ["r_b", "r_c"], "max_attempts": max_attempts},
              "r_b": {"provider": "b", "operation": "chat", "params": {"model": "m"}},
              "r_c": {"provider": "c", "operation": "chat", "params": {"model": "m"}}}
    async with gateway(tmp_path, router, up, routes, attempts=3) as gw:
        out = await gw.submit(Call("r_a", chat()))
    assert out.error is not None and out.error.data["upstream_status"] == 503
    sent = [u.count for u in up.values()]
    assert sum(sent) == max_attempts
    if max_attempts >= 3:
        assert all(n >= 1 for n in sent)  # each route got at least one request


async def test_on_narrows_what_falls_back(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].forever(429)
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": [], "on": ["server_error"]},
              "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=1) as gw:
        out = await gw.submit(Call("chat_a", chat()))
    assert out.error is not None and out.error.data["upstream_status"] == 429
    assert up["b"].count == 0


async def test_on_widens_to_a_status(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].forever(401)  # a revoked key on one account: the other may serve
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": [], "on": ["server_error", 401]},
              "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes) as gw:
        out = await gw.submit(Call("chat_a", chat()))
    assert answered_by(out.result) == "b"


async def test_fallbacks_are_followed_depth_first_and_the_last_error_is_answered(tmp_path):
    router, up = upstreams("a", "b", "c", "d")
    for u in up.values():
        u.forever(500)
    up["d"].forever(502)
    routes = {"r_a": {"provider": "a", "operation": "chat", "params": {"model": "m"},
                      "fallbacks": ["r_b", "r_d"], "max_attempts": 9},
              "r_b": {"provider": "b", "operation": "chat", "params": {"model": "m"}, "fallbacks": ["r_c"]},
              "r_c": {"provider": "c", "operation": "chat", "params": {"model": "m"}},
              "r_d": {"provider": "d", "operation": "chat", "params": {"model": "m"}}}
    call = Call("r_a", chat())
    async with gateway(tmp_path, router, up, routes, attempts=1) as gw:
        out = await gw.submit(call)
    assert out.error.data["upstream_status"] == 502 and call.route == "r_d"
    assert [u.count for u in up.values()] == [1, 1, 1, 1]
    ways = {(k[0], k[1]) for k in _fallback_labels(gw)}
    assert ways == {("r_a", "r_b"), ("r_b", "r_c"), ("r_c", "r_d")}


def _fallback_labels(gw):
    return [tuple(s.labels.values()) for m in gw.metrics.fallbacks.collect() for s in m.samples
            if s.name.endswith("_total") and s.value]


async def test_every_call_of_a_batch_ends_once_under_its_own_id(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].answer(500, "ok", 429, "connect", 400, "ok")
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": []}, "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=1) as gw:
        calls = [Call("chat_a", chat(f"q{i}")) for i in range(6)]
        outs = await gw.submit_many(calls)
    assert len(outs) == 6
    assert [o.ok for o in outs].count(False) == 1  # the 400 only
    assert outs[4].error.data["upstream_status"] == 400
    # each answer is its own call's
    for c, o in zip(calls, outs, strict=True):
        if o.ok:
            served = answered_by(o.result)
            assert served == c.route.removeprefix("chat_")
    assert up["a"].count == 6 and up["b"].count == 3


def test_config_refuses_unknown_routes_cycles_and_cost():
    providers = {"p": {"kind": "echo"}}
    with pytest.raises(ConfigError, match="unknown route 'nope'"):
        parse_config({"providers": providers,
                      "routes": {"a": {"provider": "p", "fallbacks": ["nope"]}}})
    with pytest.raises(ConfigError, match="cycle: a -> b -> a"):
        parse_config({"providers": providers,
                      "routes": {"a": {"provider": "p", "fallbacks": ["b"]},
                                 "b": {"provider": "p", "fallbacks": ["a"]}}})
    with pytest.raises(ConfigError, match="fall back to itself"):
        parse_config({"providers": providers, "routes": {"a": {"provider": "p", "fallbacks": ["a"]}}})
    with pytest.raises(ConfigError, match="'cost' needs model prices"):
        parse_config({"providers": providers, "routes": {"a": {"provider": "p"}},
                      "groups": {"g": {"routes": ["a"], "strategy": "cost"}}})
    with pytest.raises(ConfigError, match=r"groups\.g\.routes: unknown route 'x'"):
        parse_config({"providers": providers, "routes": {"a": {"provider": "p"}},
                      "groups": {"g": {"routes": ["a", "x"]}}})
    with pytest.raises(ConfigError, match="answers 'embeddings', not 'chat'"):
        parse_config({"providers": providers,
                      "routes": {"a": {"provider": "p", "operation": "chat", "fallbacks": ["e"]},
                                 "e": {"provider": "p", "operation": "embeddings"}}})
    with pytest.raises(ConfigError, match="did you mean"):
        parse_config({"providers": providers, "routes": {"a": {"provider": "p", "fallback": ["a"]}}})
    with pytest.raises(ConfigError, match="breaker"):
        parse_config({"providers": {"p": {"kind": "echo", "breaker": {"allowed_fail": 2}}}})


async def test_the_deadline_is_one_for_all_attempts(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].forever(500)
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": []}, "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=1) as gw:
        out = await gw.submit(Call("chat_a", chat(), timeout_ms=60_000))
    assert out.ok and Code.UPSTREAM_ERROR != 0


async def test_each_attempt_is_its_own_span_under_the_call(tmp_path):
    pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from multiplexer.gateway.otel import OtelTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router, up = upstreams("a", "b")
    up["a"].forever(500)
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": []}, "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=1, tracer=OtelTracer(provider)) as gw:
        assert (await gw.submit(Call("chat_a", chat()))).ok
    spans = exporter.get_finished_spans()
    attempts = sorted((s for s in spans if s.name.startswith("attempt ")),
                      key=lambda s: s.attributes["multiplexer.attempt"])
    from opentelemetry.trace import SpanKind
    [call] = [s for s in spans if s.kind == SpanKind.SERVER]
    assert [(s.name, s.attributes["multiplexer.attempt.result"]) for s in attempts] == [
        ("attempt chat_a", "server_error"), ("attempt chat_b", "ok")]
    assert all(s.parent.span_id == call.context.span_id for s in attempts)


CHUNK = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
         b'{"content":"%s"}}]}\n\n')


def stream_router(first):
    """a answers ``first`` (a status, or the bytes of a stream); b streams 'b' to its end."""
    import httpx
    import respx

    from tests.fallback_helpers import base

    router = respx.MockRouter(assert_all_called=False)
    sent = {"a": 0, "b": 0}

    def a(request):
        sent["a"] += 1
        if isinstance(first, int):
            return httpx.Response(first, json={"error": {"message": "down", "type": "server_error"}})
        return httpx.Response(200, content=first, headers={"content-type": "text/event-stream"})

    def b(request):
        sent["b"] += 1
        return httpx.Response(200, content=CHUNK % b"b" + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    router.post(f"{base('a')}/chat/completions").mock(side_effect=a)
    router.post(f"{base('b')}/chat/completions").mock(side_effect=b)
    return router, sent


async def _stream(gw, model):
    import httpx

    from multiplexer.faces.auth import Authenticator
    from multiplexer.faces.http import create_app
    from multiplexer.faces.v1 import v1_routes

    app = create_app(gw, v1_routes(gw, Authenticator({})))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        return await c.post("/v1/chat/completions", json={"model": model, "stream": True, **chat()})


STREAM_ROUTES = {"chat_a": {"provider": "a", "operation": "chat", "models": ["m-a"], "fallbacks": ["chat_b"]},
                 "chat_b": {"provider": "b", "operation": "chat", "models": ["m-b"]}}


@pytest.mark.parametrize("first", [500, 429, b"data: not json\n\n"])
async def test_a_stream_falls_back_before_its_first_byte(tmp_path, first):
    router, sent = stream_router(first)
    async with gateway(tmp_path, router, ["a", "b"], STREAM_ROUTES, attempts=1) as gw:
        reply = await _stream(gw, "m-a")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-multiplexer-route"] == "chat_b"
    assert '"content":"b"' in reply.text and reply.text.endswith("data: [DONE]\n\n")
    assert sent == {"a": 1, "b": 1}


async def test_a_stream_never_switches_provider_after_its_first_byte(tmp_path):
    router, sent = stream_router(CHUNK % b"a")  # one chunk, then the stream breaks off
    async with gateway(tmp_path, router, ["a", "b"], STREAM_ROUTES, attempts=1) as gw:
        reply = await _stream(gw, "m-a")
    assert reply.status_code == 200
    assert reply.headers["x-multiplexer-route"] == "chat_a"
    assert '"content":"a"' in reply.text and '"content":"b"' not in reply.text
    assert "ended before its last event" in reply.text  # the error event, not another answer
    assert sent == {"a": 1, "b": 0}


async def test_a_stream_with_nowhere_to_go_gets_the_upstreams_status(tmp_path):
    router, sent = stream_router(503)
    routes = {"chat_a": {**STREAM_ROUTES["chat_a"], "fallbacks": []}}
    async with gateway(tmp_path, router, ["a", "b"], routes, attempts=1) as gw:
        reply = await _stream(gw, "m-a")
    assert reply.status_code == 503 and reply.headers["x-multiplexer-route"] == "chat_a"
    assert sent == {"a": 1, "b": 0}


async def test_metrics_count_attempts_fallbacks_and_breaker_states_by_config_names(tmp_path):
    router, up = upstreams("a", "b")
    up["a"].answer(503, 400)
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": []}, "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=1,
                       breaker={"allowed_fails": 5, "window_s": 10, "cooldown_s": 10}) as gw:
        await gw.submit(Call("chat_a", chat()))
        await gw.submit(Call("chat_a", chat()))
        text = gw.metrics.render().decode()
    lines = {line for line in text.splitlines() if not line.startswith("#")}
    assert 'multiplexer_attempts_total{result="server_error",route="chat_a"} 1.0' in lines
    assert 'multiplexer_attempts_total{result="client_error",route="chat_a"} 1.0' in lines
    assert 'multiplexer_attempts_total{result="ok",route="chat_b"} 1.0' in lines
    assert ('multiplexer_fallbacks_total{from_route="chat_a",reason="server_error",to_route="chat_b"} 1.0'
            in lines)
    assert 'multiplexer_breaker_state{endpoint="a"} 0.0' in lines


async def test_a_batch_mode_call_falls_back_only_at_submission(tmp_path):
    router, up = upstreams("a", "b")
    routes = {"batch_a": {"provider": "a", "operation": "chat", "mode": "batch", "params": {"model": "m"},
                          "fallbacks": ["chat_b"], "on": ["server_error", "overloaded", "breaker_open"]},
              "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, breaker={"allowed_fails": 1, "window_s": 9,
                                                                "cooldown_s": 9}) as gw:
        call = Call("batch_a", chat(), identity="k")
        plan = gw.admit(call)
        assert plan.attempts.on == ("overloaded", "breaker_open")  # never after a job holds it
        assert plan.attempts.context == [] and "budget" not in plan.item.options
        gw.fallbacks.breakers.get("a").failure()  # open: refused at submission, so it moves on
        out = await gw.submit(Call("batch_a", chat(), identity="k"))
    assert answered_by(out.result) == "b" and up["a"].count == 0


def test_a_chain_never_mixes_a_kind_with_its_own_body_and_one_without() -> None:
    """A `/v1` body is translated for the chain's first route: a Gemini route cannot fall back to
    an OpenAI one (or join its group), since the body sent would be in the wrong API."""
    from multiplexer.gateway.config import ConfigError, parse_config

    data = {"providers": {"g": {"kind": "gemini", "api_key": "x"}, "o": {"kind": "openai", "api_key": "x"}},
            "routes": {"a": {"provider": "g", "operation": "chat", "fallbacks": ["b"]},
                       "b": {"provider": "o", "operation": "chat"}}}
    with pytest.raises(ConfigError, match="a fallback must take the same body"):
        parse_config(data)
    del data["routes"]["a"]["fallbacks"]
    data["groups"] = {"m": {"routes": ["a", "b"]}}
    with pytest.raises(ConfigError, match="a fallback must take the same body"):
        parse_config(data)


async def test_a_failed_attempt_still_tries_a_fallback_whose_breaker_is_open_once(tmp_path):
    """Nothing but an open breaker is left after the first route failed: that route takes the
    call once rather than leaving it with an error it might not have made."""
    router, up = upstreams("a", "b")
    up["a"].forever(500)
    routes = {"chat_a": {**ROUTES["chat_a"], "context_window_fallbacks": [],
                         "on": ["server_error", "breaker_open"]}, "chat_b": ROUTES["chat_b"]}
    async with gateway(tmp_path, router, up, routes, attempts=1,
                       breaker={"allowed_fails": 1, "window_s": 60, "cooldown_s": 60}) as gw:
        gw.fallbacks.breakers.get("b").failure()
        assert gw.fallbacks.breakers.get("b").state == "open"
        out = await gw.submit(Call("chat_a", chat()))
    assert out.ok and answered_by(out.result) == "b"
    assert (up["a"].count, up["b"].count) == (1, 1)
