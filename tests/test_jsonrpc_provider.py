"""The JSON-RPC provider's array fallback, on an injected clock with respx as the upstream."""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from multiplexer.core.call import Item
from providers.jsonrpc import JsonRpcProvider
from tests.remote_helpers import InstantClock, make_provider, started

pytestmark = pytest.mark.anyio
URL = "http://upstream.test/rpc"


def items(n: int) -> list[Item]:
    return [Item(route="echo", operation="call", method="echo", params={"i": i}) for i in range(n)]


class Upstream:
    """Refuses arrays while ``refuse`` is set; answers every message with its params."""

    def __init__(self) -> None:
        self.refuse = True
        self.shapes: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.shapes.append("array" if isinstance(body, list) else "single")
        if isinstance(body, list):
            if self.refuse:
                return httpx.Response(400, text="arrays not supported")
            return httpx.Response(200, json=[{"jsonrpc": "2.0", "id": m["id"], "result": m["params"]}
                                             for m in body])
        return httpx.Response(200, json={"jsonrpc": "2.0", "id": body["id"], "result": body["params"]})


async def test_a_refused_array_is_tried_again_after_a_pause_that_doubles(tmp_path) -> None:
    clock = InstantClock()
    p = make_provider(JsonRpcProvider, {"url": URL, "transport": "httpx",
                                        "batch_arrays_reprobe_s": 60}, tmp_path, clock)
    upstream = Upstream()
    with respx.mock() as mock:
        mock.post(URL).mock(side_effect=upstream)
        async with started(p):
            async def run() -> list[str]:
                upstream.shapes.clear()
                outcomes = await p.execute("call", items(3))
                assert [o.result for o in outcomes] == [{"i": 0}, {"i": 1}, {"i": 2}]
                return list(upstream.shapes)

            assert await run() == ["array", "single", "single", "single"]  # refused: fall back
            assert await run() == ["single"] * 3  # within the pause: no array
            clock.t += 60
            assert await run() == ["array", "single", "single", "single"]  # re-probed, refused again
            clock.t += 60
            assert await run() == ["single"] * 3  # the pause doubled to 120 s
            clock.t += 60
            upstream.refuse = False
            assert await run() == ["array"]  # the upstream takes arrays again
            assert await run() == ["array"]
    text = p.ctx.metrics.render().decode()
    assert 'multiplexer_events_total{component="p",event="batch_arrays_refused"} 2.0' in text
