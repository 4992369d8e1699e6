"""Model groups: one public name over several routes, on /v1, /rpc and MCP; every answer says
which route served it (``x-multiplexer-route``, ``_meta.route`` when asked)."""

from __future__ import annotations

import httpx
import pytest

from multiplexer.core.call import Call
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.http import create_app
from multiplexer.faces.v1 import v1_routes
from tests.fallback_helpers import answered_by, chat, gateway, upstreams

pytestmark = pytest.mark.anyio

ROUTES = {
    "oai_east": {"provider": "east", "operation": "chat", "params": {"model": "gpt-east"}},
    "oai_west": {"provider": "west", "operation": "chat", "models": ["gpt-west"]},
    "plain": {"provider": "east", "operation": "chat", "models": ["gpt-plain"]},
}
GROUPS = {"gpt-x": {"routes": ["oai_east", "oai_west"], "strategy": "least_busy"}}


def client(gw):
    app = create_app(gw, v1_routes(gw, Authenticator({})))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")


async def test_a_group_is_one_public_model_on_v1_and_the_answer_names_its_route(tmp_path):
    router, up = upstreams("east", "west")
    async with gateway(tmp_path, router, up, ROUTES, groups=GROUPS) as gw, client(gw) as c:
        models = (await c.get("/v1/models")).json()["data"]
        assert {m["id"]: m["owned_by"] for m in models} == {
            "gpt-west": "west", "gpt-plain": "east", "gpt-x": "multiplexer"}
        reply = await c.post("/v1/chat/completions", json={"model": "gpt-x", **chat()})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-multiplexer-route"] == "oai_east"  # least busy, first in the config
        assert up["east"].requests[0]["model"] == "gpt-east"
        plain = await c.post("/v1/chat/completions", json={"model": "gpt-plain", **chat()})
        assert plain.headers["x-multiplexer-route"] == "plain"


async def test_a_group_falls_back_over_its_routes_and_the_header_says_where(tmp_path):
    router, up = upstreams("east", "west")
    up["east"].forever(503)
    async with gateway(tmp_path, router, up, ROUTES, groups=GROUPS, attempts=1) as gw, client(gw) as c:
        reply = await c.post("/v1/chat/completions", json={"model": "gpt-x", **chat()})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-multiplexer-route"] == "oai_west"
        assert answered_by(reply.json()) == "west"
        assert up["west"].requests[0]["model"] == "gpt-west"  # its own model, not the group's name
        up["west"].forever(503)
        failed = await c.post("/v1/chat/completions", json={"model": "gpt-x", **chat()})
        assert failed.status_code == 503 and failed.headers["x-multiplexer-route"] == "oai_west"


async def test_a_stream_on_a_group_names_its_route(tmp_path):
    router = respx_stream_router()
    async with gateway(tmp_path, router, ["east", "west"], ROUTES, groups=GROUPS) as gw, client(gw) as c:
        reply = await c.post("/v1/chat/completions", json={"model": "gpt-x", "stream": True, **chat()})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-multiplexer-route"] == "oai_east"
    assert "data: [DONE]" in reply.text


def respx_stream_router():
    import respx

    from tests.fallback_helpers import base
    router = respx.MockRouter(assert_all_called=False)
    sse = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
           b'{"content":"hi"}}]}\n\ndata: [DONE]\n\n')
    for n in ("east", "west"):
        router.post(f"{base(n)}/chat/completions").mock(return_value=httpx.Response(
            200, content=sse, headers={"content-type": "text/event-stream"}))
    return router


async def test_rpc_and_mcp_know_a_group_by_its_name_and_meta_route_is_given_when_asked(tmp_path):
    router, up = upstreams("east", "west")
    up["east"].forever(500)
    async with gateway(tmp_path, router, up, ROUTES, groups=GROUPS, attempts=1) as gw, client(gw) as c:
        tools = {t.name for t in await gw.list_tools()}
        assert {"gpt-x", "oai_east", "oai_west"} <= tools
        asked = await c.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "gpt-x",
                                           "params": {**chat(), "_meta": {"want_route": True}}})
        result = asked.json()["result"]
        assert result["_meta"] == {"route": "oai_west"} and answered_by(result) == "west"
        unasked = await c.post("/rpc", json={"jsonrpc": "2.0", "id": 2, "method": "gpt-x", "params": chat()})
        assert "_meta" not in unasked.json()["result"]
        bad = await c.post("/rpc", json={"jsonrpc": "2.0", "id": 3, "method": "gpt-x",
                                         "params": {**chat(), "_meta": {"want_route": "yes"}}})
        assert bad.json()["error"]["data"]["detail"] == "_meta.want_route must be a boolean"
        up["west"].forever(400)
        err = await c.post("/rpc", json={"jsonrpc": "2.0", "id": 4, "method": "gpt-x",
                                         "params": {**chat(), "_meta": {"want_route": True}}})
        assert err.json()["error"]["data"]["route"] == "oai_west"


async def test_least_busy_latency_and_weighted_pick_their_first_route(tmp_path):
    router, up = upstreams("east", "west")
    groups = {"busy": {"routes": ["oai_east", "oai_west"]},
              "fast": {"routes": ["oai_east", "oai_west"], "strategy": "latency"},
              "heavy": {"routes": ["oai_east", "oai_west"], "strategy": "weighted",
                        "weights": {"oai_west": 1e9, "oai_east": 1e-9}}}
    async with gateway(tmp_path, router, up, ROUTES, groups=groups) as gw:
        fb = gw.fallbacks
        fb.busy.update({"oai_east": 3, "oai_west": 1})
        assert fb.order(fb.groups["busy"]) == ["oai_west", "oai_east"]
        fb.busy.clear()
        fb.latency.update({"oai_east": 0.5, "oai_west": 0.1})
        assert fb.order(fb.groups["fast"]) == ["oai_west", "oai_east"]
        calls = [Call("heavy", chat()) for _ in range(10)]
        await gw.submit_many(calls)
        assert {c.route for c in calls} == {"oai_west"}
        assert up["west"].count == 10 and up["east"].count == 0


async def test_with_every_routes_breaker_open_the_first_route_takes_the_call(tmp_path):
    """Breakers keep calls off a failing endpoint while another can serve. With both of a
    group's routes open, a call is not refused untried: the strategy's first route takes it,
    once (counted as ``all_open``); a route alone still fails fast while its breaker is open."""
    from multiplexer.core.errors import Code

    router, up = upstreams("east", "west")
    breaker = {"allowed_fails": 1, "window_s": 60, "cooldown_s": 60}
    async with gateway(tmp_path, router, up, ROUTES, groups=GROUPS, breaker=breaker) as gw:
        gw.fallbacks.breakers.get("east").failure()
        gw.fallbacks.breakers.get("west").failure()
        assert [gw.fallbacks.breakers.get(n).state for n in ("east", "west")] == ["open", "open"]
        out = await gw.submit(Call("gpt-x", chat()))
        assert out.ok, out.error
        served = answered_by(out.result)
        alone = await gw.submit(Call("plain", chat(model="gpt-plain")))  # a route alone
        text = gw.metrics.render().decode()
    assert served in ("east", "west") and up[served].count == 1
    assert up["east"].count + up["west"].count == 1  # one request: the call was not walked twice
    assert alone.error is not None and alone.error.code == Code.UPSTREAM_UNAVAILABLE
    assert alone.error.data["breaker"] == "open"
    assert f'multiplexer_attempts_total{{result="all_open",route="oai_{served}"}} 1.0' in text
