"""Cache affinity end to end: conversations through a model group of three routes, each on its own
fake OpenAI upstream on 127.0.0.1, keep to one route per conversation; when that route's breaker
opens its conversations move, each to one other route, and ``/metrics`` counts the moves."""

from __future__ import annotations

from collections import defaultdict
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from multiplexer.gateway.affinity import call_key
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.openai_fake import FakeOpenAIState
from tests.fakes.openai_fake import create_app as openai_app
from tests.fakes.serve import serve_app

pytestmark = pytest.mark.anyio

NAMES = ("r0", "r1", "r2")
CONVERSATIONS, TURNS = 20, 4


def config(urls: dict[str, str]) -> Any:
    return parse_config({
        "providers": {n: {"kind": "openai", "base_url": f"{urls[n]}/v1", "api_key": "sk-test",
                          "retry": {"attempts": 1},
                          "breaker": {"allowed_fails": 1, "window_s": 600, "cooldown_s": 600}}
                      for n in NAMES},
        "routes": {n: {"provider": n, "operation": "chat", "params": {"model": f"gpt-{n}"}} for n in NAMES},
        "groups": {"gpt-x": {"routes": list(NAMES)}},
    }, env={})


def body(c: int, t: int, first_turn: int = 0) -> dict[str, Any]:
    """Turn ``t`` of conversation ``c``: one system prompt and first question, a growing history."""
    messages = [{"role": "system", "content": f"You are assistant {c}. " + "Be precise. " * 200},
                {"role": "user", "content": f"conversation {c} begins"}]
    for i in range(first_turn + t):
        messages += [{"role": "assistant", "content": f"answer {i}"},
                     {"role": "user", "content": f"question {i + 1}"}]
    return {"model": "gpt-x", "messages": messages}


async def converse(http: httpx.AsyncClient, url: str, first_turn: int) -> dict[int, list[str]]:
    served: dict[int, list[str]] = defaultdict(list)
    for t in range(TURNS):
        for c in range(CONVERSATIONS):
            reply = await http.post(f"{url}/v1/chat/completions", json=body(c, t, first_turn))
            assert reply.status_code == 200, reply.text
            served[c].append(reply.headers["x-multiplexer-route"])
    return served


def moves(metrics: str, reason: str) -> float:
    line = f'multiplexer_cache_moves_total{{group="gpt-x",reason="{reason}"}} '
    found = [row for row in metrics.splitlines() if row.startswith(line)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


async def test_turns_keep_to_one_route_and_move_together_when_its_breaker_opens() -> None:
    states = {n: FakeOpenAIState() for n in NAMES}
    async with AsyncExitStack() as stack:
        urls = {n: await stack.enter_async_context(serve_app(openai_app(states[n]))) for n in NAMES}
        gw, url = await stack.enter_async_context(running(config(urls), port=0))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        affinity = gw.fallbacks.affinity["gpt-x"]

        served = await converse(http, url, 0)
        homes = {c: routes[0] for c, routes in served.items()}
        assert all(len(set(routes)) == 1 for routes in served.values()), served
        for c, home in homes.items():  # the rendezvous pick any replica would make
            assert home == affinity.ranking(call_key(body(c, 0), "prefix") or 0)[0]
        assert len(set(homes.values())) == 3  # twenty conversations use every route
        assert sum(states[n].requests["/v1/chat/completions"] for n in NAMES) == CONVERSATIONS * TURNS
        metrics = (await http.get(f"{url}/metrics")).text
        assert moves(metrics, "breaker_open") == moves(metrics, "fallback") == 0

        down = max(NAMES, key=lambda n: sum(h == n for h in homes.values()))
        states[down].fail_next = [500] * 100  # its next request fails; with one allowed fail, it opens
        moved = [c for c, h in homes.items() if h == down]
        after = await converse(http, url, TURNS)
        for c, routes in after.items():
            assert len(set(routes)) == 1, (c, routes)  # a moved conversation moves whole
            assert routes[0] == (homes[c] if c not in moved else
                                 affinity.ranking(call_key(body(c, 0), "prefix") or 0)[1])
        # its own turns before, and the one request that failed
        assert states[down].requests["/v1/chat/completions"] == len(moved) * TURNS + 1
        metrics = (await http.get(f"{url}/metrics")).text
        assert moves(metrics, "fallback") == 1  # the failed attempt's call, served by its next pick
        assert moves(metrics, "breaker_open") == len(moved) * TURNS - 1
