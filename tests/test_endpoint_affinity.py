"""Prompt-cache affinity across a provider's base_urls: a conversation keeps to one endpoint
(OpenAI-compatible and Anthropic alike), conversations spread, a short prompt without a key
spreads by outstanding requests, a session keys, and a move off a downed endpoint is counted."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
import respx

from multiplexer.core.cache_affinity import AFFINITY_KEY, CACHE_MOVED, SESSION, moves_tally
from providers.anthropic import AnthropicProvider
from providers.openai import OpenAIProvider
from tests.remote_helpers import chat_reply, item, make_provider, started

pytestmark = pytest.mark.anyio
BASES = ["http://e1.test/v1", "http://e2.test/v1", "http://e3.test/v1"]
SYSTEM = "You answer questions about the manual. " * 600  # about 6,000 tokens: cacheable


def turn(conversation: int, n: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"conversation {conversation}"}]
    for i in range(n):
        messages += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i}"}]
    return {"model": "m", "messages": messages}


def openai(tmp_path, **settings: Any) -> OpenAIProvider:
    return make_provider(OpenAIProvider, {"base_urls": BASES, "api_key": "k", **settings}, tmp_path)


def recorder(seen: list[str]) -> Any:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(200, json=chat_reply("ok"))
    return answer


async def test_each_conversation_keeps_to_one_endpoint_and_conversations_spread(tmp_path) -> None:
    p = openai(tmp_path)
    homes: dict[int, set[str]] = {}
    seen: list[str] = []
    with respx.mock(assert_all_called=False) as mock:
        for base in BASES:
            mock.post(f"{base}/chat/completions").mock(side_effect=recorder(seen))
        async with started(p):
            for c in range(12):
                for n in range(4):
                    assert (await p.execute("chat", [item(p, "chat", turn(c, n))]))[0].ok
                    homes.setdefault(c, set()).add(seen[-1])
    assert all(len(h) == 1 for h in homes.values())  # every turn of a conversation: one endpoint
    assert len({next(iter(h)) for h in homes.values()}) == 3  # 12 conversations use all three


async def test_short_prompts_without_a_key_spread_and_a_session_keys(tmp_path) -> None:
    p = openai(tmp_path)
    seen: list[str] = []
    with respx.mock(assert_all_called=False) as mock:
        for base in BASES:
            mock.post(f"{base}/chat/completions").mock(side_effect=recorder(seen))
        async with started(p):
            short = [item(p, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                     for _ in range(6)]
            assert all(o.ok for o in await p.execute("chat", short))
            assert Counter(seen) == Counter({"e1.test": 2, "e2.test": 2, "e3.test": 2})
            seen.clear()
            for _ in range(5):  # below the minimum, but the caller named its session
                one = item(p, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                one.options[SESSION] = "s-1"
                assert (await p.execute("chat", [one]))[0].ok
            assert len(set(seen)) == 1


async def test_a_groups_key_is_reused_and_off_spreads(tmp_path) -> None:
    p = openai(tmp_path, endpoint_affinity="off")
    q = openai(tmp_path)
    keyed = item(q, "chat", turn(0, 0))
    keyed.options[AFFINITY_KEY] = 12345
    assert q.api.key_of(keyed) == 12345
    assert p.api.key_of(item(p, "chat", turn(0, 0))) is None
    assert q.api.key_of(item(q, "embeddings", {"model": "m", "input": SYSTEM})) is None


async def test_a_downed_home_moves_its_conversation_whole_and_counts_the_move(tmp_path) -> None:
    p = openai(tmp_path, endpoint_failures=1)
    seen: list[str] = []
    down: set[str] = set()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            raise httpx.ConnectError("refused")
        seen.append(request.url.host)
        return httpx.Response(200, json=chat_reply("ok"))

    with respx.mock(assert_all_called=False) as mock:
        for base in BASES:
            mock.post(f"{base}/chat/completions").mock(side_effect=answer)
        async with started(p):
            first = item(p, "chat", turn(7, 0))
            assert (await p.execute("chat", [first]))[0].ok
            home = seen[-1]
            down.add(home)
            seen.clear()
            moved = [item(p, "chat", turn(7, n)) for n in range(1, 5)]
            for one in moved:
                assert (await p.execute("chat", [one]))[0].ok
    assert len(set(seen)) == 1 and home not in seen  # one other endpoint took the rest
    assert all(one.options.get(CACHE_MOVED) for one in moved)  # booked as moves (money/meter.py)
    assert CACHE_MOVED not in first.options
    moves = moves_tally(p.ctx.metrics)
    assert moves.value("p@base_urls", "endpoint_down") >= 4


async def test_an_anthropic_provider_takes_base_urls_and_keeps_a_conversation(tmp_path) -> None:
    bases = ["http://a1.test", "http://a2.test"]
    p = make_provider(AnthropicProvider, {"base_urls": bases, "api_key": "k"}, tmp_path)
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(200, json={"id": "m", "type": "message", "role": "assistant",
                                         "content": [{"type": "text", "text": "ok"}],
                                         "usage": {"input_tokens": 5, "output_tokens": 1}})

    with respx.mock(assert_all_called=False) as mock:
        for base in bases:
            mock.post(f"{base}/v1/messages").mock(side_effect=answer)
        async with started(p):
            for n in range(4):
                params = {**turn(3, n), "max_tokens": 16}
                params["system"] = params["messages"].pop(0)["content"]
                assert (await p.execute("messages", [item(p, "messages", params)]))[0].ok
    assert len(seen) == 4 and len(set(seen)) == 1
