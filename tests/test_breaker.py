"""Circuit breakers: open after allowed_fails in window_s, cool down, one probe half-open, then
closed; while open the primary gets no calls; shared by replicas through Redis."""

from __future__ import annotations

import pytest

from multiplexer.core.breaker import Breaker, Breakers
from multiplexer.core.call import Call
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code
from multiplexer.core.policy import BreakerPolicy
from tests.fallback_helpers import answered_by, chat, gateway, upstreams
from tests.redis_helpers import prefix, redis_url

pytestmark = pytest.mark.anyio
POLICY = BreakerPolicy(allowed_fails=3, window_s=10, cooldown_s=20)


async def test_it_opens_after_allowed_fails_within_the_window():
    clock = ManualClock()
    b = Breaker("p", POLICY, clock)
    b.failure()
    await clock.advance(11)  # the first failure leaves the window
    b.failure()
    b.failure()
    assert b.state == "closed" and b.allow()
    assert b.failure() is True
    assert b.state == "open" and not b.allow()
    assert b.retry_after() == 20


async def test_half_open_lets_one_probe_through_and_its_result_decides():
    clock = ManualClock()
    b = Breaker("p", POLICY, clock)
    for _ in range(3):
        b.failure()
    await clock.advance(5)
    assert b.failure() is False and b.retry_after() == 15  # a late failure does not extend it
    await clock.advance(15)
    assert b.state == "half_open"
    assert b.allow() is True  # the probe
    assert b.allow() is False  # only one
    b.failure()  # the probe failed: open again for a whole cooldown
    assert b.state == "open" and b.retry_after() == 20
    await clock.advance(20)
    assert b.allow() is True
    b.release()  # its caller went: no verdict, the next call probes
    assert b.allow() is True
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_a_success_while_closed_does_not_forget_failures_in_the_window():
    clock = ManualClock()
    b = Breaker("p", POLICY, clock)
    b.failure()
    b.failure()
    b.success()
    assert b.failure() is True


ROUTES = {
    "chat_a": {"provider": "a", "operation": "chat", "params": {"model": "m"}, "fallbacks": ["chat_b"]},
    "chat_b": {"provider": "b", "operation": "chat", "params": {"model": "m"}},
    "lonely": {"provider": "a", "operation": "chat", "params": {"model": "m"}},
}
BREAKER = {"allowed_fails": 2, "window_s": 30, "cooldown_s": 10}


async def test_an_open_breaker_sends_calls_straight_to_the_fallback_then_probes_once(tmp_path):
    clock = ManualClock()
    router, up = upstreams("a", "b")
    up["a"].forever(500)
    states = []
    async with gateway(tmp_path, router, up, ROUTES, breaker=BREAKER, clock=clock, attempts=1) as gw:
        gw.listeners.append(lambda event, data: states.append((data["endpoint"], data["state"]))
                            if event == "breaker" else None)
        for _ in range(2):
            assert answered_by((await gw.submit(Call("chat_a", chat()))).result) == "b"
        assert states == [("a", "open")]
        assert gw.metrics.breaker_state.labels("a")._value.get() == 1
        for _ in range(5):  # open: a gets nothing
            assert answered_by((await gw.submit(Call("chat_a", chat()))).result) == "b"
        assert (up["a"].count, up["b"].count) == (2, 7)
        # no fallback: fail fast with a clear error
        lonely = await gw.submit(Call("lonely", chat()))
        assert lonely.error.code == Code.UPSTREAM_UNAVAILABLE
        assert lonely.error.data["breaker"] == "open" and lonely.error.data["retry_after"] == 10
        assert "circuit breaker open for a" in lonely.error.data["detail"]
        assert up["a"].count == 2
        await clock.advance(10)
        up["a"].forever("ok")
        calls = [Call("chat_a", chat()) for _ in range(3)]
        outs = await gw.submit_many(calls)
        # one probe reached a (half-open); the others went on to b at once
        assert [c.route for c in calls].count("chat_a") == 1 and all(o.ok for o in outs)
        assert up["a"].count == 3
        assert states[-2:] == [("a", "half_open"), ("a", "closed")]
        outs = await gw.submit_many([Call("chat_a", chat()) for _ in range(3)])
        assert up["a"].count == 6  # closed: a serves again


async def test_client_errors_do_not_open_a_breaker(tmp_path):
    clock = ManualClock()
    router, up = upstreams("a", "b")
    up["a"].forever(400)
    async with gateway(tmp_path, router, up, ROUTES, breaker=BREAKER, clock=clock, attempts=1) as gw:
        for _ in range(5):
            assert (await gw.submit(Call("chat_a", chat()))).error.data["upstream_status"] == 400
        assert gw.fallbacks.breakers.get("a").state == "closed"
    assert (up["a"].count, up["b"].count) == (5, 0)


async def test_three_replicas_sharing_redis_stop_sending_to_a_broken_endpoint(tmp_path):
    state = {"url": redis_url(), "prefix": prefix()}
    router, up = upstreams("a", "b")
    up["a"].forever(503)
    gws = [gateway(tmp_path / str(i), router, up, ROUTES, breaker=BREAKER, state=state, attempts=1)
           for i in range(3)]
    for i in range(3):
        (tmp_path / str(i)).mkdir()
    async with gws[0] as one, gws[1] as two, gws[2] as three:
        for _ in range(2):  # replica one discovers it
            assert answered_by((await one.submit(Call("chat_a", chat()))).result) == "b"
        assert one.fallbacks.breakers.get("a").state == "open"
        for gw in (one, two, three):
            await gw.fallbacks.breakers.sync()  # what their background loop does every 250 ms
        assert two.fallbacks.breakers.get("a").state == "open"
        sent = up["a"].count
        for gw in (two, three):
            for _ in range(3):
                assert answered_by((await gw.submit(Call("chat_a", chat()))).result) == "b"
        assert up["a"].count == sent == 2


async def test_failures_on_different_replicas_add_up_in_the_shared_window(tmp_path):
    clock = ManualClock()
    store_state = {"url": redis_url(), "prefix": prefix()}
    router, up = upstreams("a", "b")
    up["a"].forever(503)
    dirs = [tmp_path / "x", tmp_path / "y"]
    for d in dirs:
        d.mkdir()
    async with gateway(dirs[0], router, up, ROUTES, breaker=BREAKER, state=store_state, attempts=1,
                       clock=clock) as one, \
            gateway(dirs[1], router, up, ROUTES, breaker=BREAKER, state=store_state, attempts=1,
                    clock=clock) as two:
        await one.submit(Call("chat_a", chat()))
        await one.fallbacks.breakers.sync()
        await two.submit(Call("chat_a", chat()))  # each replica saw one failure: together two
        await two.fallbacks.breakers.sync()
        await one.fallbacks.breakers.sync()
        assert one.fallbacks.breakers.get("a").state == "open"
        assert two.fallbacks.breakers.get("a").state == "open"


def test_breakers_without_a_store_sync_to_nothing():
    b = Breakers({"p": POLICY}, ManualClock())
    b.record("p", True)
    b.record("unknown", True)
    assert b.get("p").state == "closed" and b.get("unknown") is None


async def test_each_base_url_has_its_own_breaker_and_all_open_falls_back(tmp_path):
    import httpx
    import respx

    from multiplexer.gateway.config import parse_config
    from multiplexer.gateway.gateway import Gateway
    from providers.openai import OpenAIProvider
    from tests.remote_helpers import chat_reply, make_provider

    clock = ManualClock()
    sent = {"e1": 0, "e2": 0, "b": 0}
    router = respx.MockRouter(assert_all_called=False)

    def answer(name, status):
        def handler(request):
            sent[name] += 1
            return httpx.Response(status, json=chat_reply(name) if status == 200 else
                                  {"error": {"message": "down", "type": "server_error"}})
        return handler

    e1 = router.post("http://e1.test/v1/chat/completions").mock(side_effect=answer("e1", 500))
    router.post("http://e2.test/v1/chat/completions").mock(side_effect=answer("e2", 200))
    router.post("http://b.test/v1/chat/completions").mock(side_effect=answer("b", 200))
    bases = ["http://e1.test/v1", "http://e2.test/v1"]
    config = parse_config({
        "providers": {"a": {"kind": "openai", "base_urls": bases, "breaker": BREAKER},
                      "b": {"kind": "openai", "base_url": "http://b.test/v1"}},
        "routes": ROUTES})
    transport = httpx.MockTransport(router.async_handler)
    providers = {"a": make_provider(OpenAIProvider, {"base_urls": bases, "api_key": "k", "breaker": BREAKER},
                                    tmp_path, clock, name="a", attempts=1, transport=transport),
                 "b": make_provider(OpenAIProvider, {"base_url": "http://b.test/v1", "api_key": "k"},
                                    tmp_path, clock, name="b", attempts=1, transport=transport)}
    gw = Gateway(config, providers=providers, clock=clock)
    for p in providers.values():
        p.ctx.breakers = gw.fallbacks.breakers
    async with gw:
        outs = [await gw.submit(Call("lonely", chat())) for _ in range(8)]
        e1_breaker = gw.fallbacks.breakers.get("a@http://e1.test/v1")
        assert e1_breaker.state == "open"
        assert sent["e1"] == 2  # two failures opened it; e2 took the rest
        assert [o.ok for o in outs].count(True) == 6
        e1.mock(side_effect=answer("e1", 200))
        await clock.advance(10)
        await gw.submit_many([Call("lonely", chat()) for _ in range(4)])
        assert e1_breaker.state == "closed" and sent["e1"] >= 3  # the probe answered: back in use
        # every endpoint open: the route's fallback takes the calls without a request to a
        e1.mock(side_effect=answer("e1", 500))
        router.post("http://e2.test/v1/chat/completions").mock(side_effect=answer("e2", 500))
        for _ in range(6):
            await gw.submit(Call("chat_a", chat()))
        before = dict(sent)
        outs = [await gw.submit(Call("chat_a", chat())) for _ in range(3)]
        assert all(answered_by(o.result) == "b" for o in outs)
        assert (sent["e1"], sent["e2"]) == (before["e1"], before["e2"])


async def test_replicas_sharing_a_breaker_send_one_probe_at_a_time(tmp_path):
    clock = ManualClock()
    state = {"url": redis_url(), "prefix": prefix()}
    router, up = upstreams("a", "b")
    up["a"].forever(503)
    dirs = [tmp_path / "x", tmp_path / "y"]
    for d in dirs:
        d.mkdir()
    async with gateway(dirs[0], router, up, ROUTES, breaker=BREAKER, state=state, attempts=1,
                       clock=clock) as one, \
            gateway(dirs[1], router, up, ROUTES, breaker=BREAKER, state=state, attempts=1,
                    clock=clock) as two:
        for _ in range(2):
            await one.submit(Call("chat_a", chat()))
        await one.fallbacks.breakers.sync()
        await two.fallbacks.breakers.sync()
        assert two.fallbacks.breakers.get("a").state == "open"
        await _until_closed_in_redis(one)  # Redis' own clock runs its open key: expire it now
        await clock.advance(10)  # and the cooldown is over on both replicas
        up["a"].forever("ok")
        for gw in (one, two, one, two):
            await gw.fallbacks.breakers.sync()  # one of them claims the shared probe
        granted = [gw for gw in (one, two) if gw.fallbacks.breakers.get("a")._granted]
        assert len(granted) == 1
        holder, waiter = granted[0], two if granted[0] is one else one
        sent = up["a"].count
        assert answered_by((await waiter.submit(Call("chat_a", chat()))).result) == "b"
        assert up["a"].count == sent  # the other waits for the probe
        assert answered_by((await holder.submit(Call("chat_a", chat()))).result) == "a"
        assert up["a"].count == sent + 1 and holder.fallbacks.breakers.get("a").state == "closed"
        await holder.fallbacks.breakers.sync()  # its report frees the probe
        await waiter.fallbacks.breakers.sync()
        assert answered_by((await waiter.submit(Call("chat_a", chat()))).result) == "a"
        assert waiter.fallbacks.breakers.get("a").state == "closed"


async def _until_closed_in_redis(gw):
    """Redis' own clock runs the open key's time to live (10 s in BREAKER), not the test's: drop it."""
    store = gw.fallbacks.breakers.store
    await store.r.delete(store._keys("a")[1])
