"""A provider over several endpoints (base_urls): spread by outstanding requests, with health."""

from __future__ import annotations

import httpx
import pytest
import respx

from providers.openai import OpenAIProvider
from tests.remote_helpers import body, chat_reply, item, make_provider, started

pytestmark = pytest.mark.anyio
A, B = "http://vllm-a.test/v1", "http://vllm-b.test/v1"



def provider(tmp_path, **settings):
    return make_provider(OpenAIProvider, {"base_urls": [A, B], "api_key": "k", **settings}, tmp_path)


def chat(p, text):
    return item(p, "chat", {"model": "m", "messages": [{"role": "user", "content": text}]})


def reply(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=chat_reply(body(request)["messages"][0]["content"]))


async def test_calls_spread_over_the_endpoints(tmp_path):
    p = provider(tmp_path)
    with respx.mock() as mock:
        a = mock.post(f"{A}/chat/completions").mock(side_effect=reply)
        b = mock.post(f"{B}/chat/completions").mock(side_effect=reply)
        async with started(p):
            out = await p.execute("chat", [chat(p, f"c{i}") for i in range(10)])
    assert all(o.ok for o in out)
    assert a.call_count == 5 and b.call_count == 5  # all at once: least outstanding alternates


async def test_a_dead_endpoint_is_taken_out_and_put_back_after_a_good_probe(tmp_path):
    p = provider(tmp_path, endpoint_failures=2, endpoint_retry_s=5)
    clock = p.ctx.clock
    a_up = False

    def a_side(request: httpx.Request) -> httpx.Response:
        if not a_up:
            raise httpx.ConnectError("refused")
        return reply(request)

    with respx.mock() as mock:
        a = mock.post(f"{A}/chat/completions").mock(side_effect=a_side)
        b = mock.post(f"{B}/chat/completions").mock(side_effect=reply)
        async with started(p):
            first = [await p.execute("chat", [chat(p, f"x{i}")]) for i in range(6)]
            tried_a = a.call_count
            assert p.api.endpoints.all[0].down_until is not None  # out after 2 failures
            a_up = True
            clock.t += 6  # past endpoint_retry_s: the next request to A is the probe
            later = [await p.execute("chat", [chat(p, f"y{i}")]) for i in range(4)]
    assert all(o[0].ok for o in first + later)  # a refused connection is retried on B
    assert tried_a == 2 and b.call_count >= 6
    assert a.call_count >= 3 and p.api.endpoints.all[0].down_until is None  # back in
    events = p.ctx.metrics.events
    assert events.labels("p", "endpoint_down")._value.get() == 1
    assert events.labels("p", "endpoint_up")._value.get() == 1


async def test_endpoint_concurrency_caps_each_endpoint(tmp_path):
    p = provider(tmp_path, endpoint_concurrency=1)
    seen: list[int] = []
    in_flight = {"n": 0}

    async def slow(request: httpx.Request) -> httpx.Response:
        import anyio

        in_flight["n"] += 1
        seen.append(in_flight["n"])
        await anyio.sleep(0.01)
        in_flight["n"] -= 1
        return reply(request)

    with respx.mock() as mock:
        mock.post(f"{A}/chat/completions").mock(side_effect=slow)
        mock.post(f"{B}/chat/completions").mock(side_effect=slow)
        async with started(p):
            out = await p.execute("chat", [chat(p, f"c{i}") for i in range(6)])
    assert all(o.ok for o in out) and max(seen) == 2  # one per endpoint, two endpoints
