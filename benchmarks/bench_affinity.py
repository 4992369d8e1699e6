"""What cache affinity adds to a call to a model group: its key (a 3,000-token system prompt, about
12,000 characters, tools and a first question), the rendezvous ranking of three routes and the
bounded-load check, in nanoseconds per call.

    python -m benchmarks.bench_affinity
"""

from __future__ import annotations

import random
import timeit
from typing import Any

import anyio

from multiplexer.core.call import Call
from multiplexer.core.policy import GroupConfig, RouteConfig
from multiplexer.gateway.affinity import affinities, call_key, saturated
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway

WORDS = ["the", "model", "answers", "questions", "about", "our", "catalogue", "using", "only",
         "documents", "below", "and", "cites", "each", "source", "by", "title"]


def params(tokens: int = 3000) -> dict[str, Any]:
    rng = random.Random(7)
    system = " ".join(rng.choice(WORDS) for _ in range(tokens * 3 // 4))  # ~0.75 words a token
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "looks a thing up",
                                               "parameters": {"type": "object", "properties": {
                                                   "query": {"type": "string"}}}}} for i in range(3)]
    return {"model": "g", "tools": tools,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "What does the warranty cover?"},
                         {"role": "assistant", "content": "Parts and labour for two years."},
                         {"role": "user", "content": "And batteries?"}]}


def ns(fn: Any, number: int = 20_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e9


def main() -> None:
    body = params()
    routes = {n: RouteConfig(provider="p", operation="chat") for n in ("a", "b", "c")}
    affinity = affinities({"g": GroupConfig(routes=["a", "b", "c"])}, routes)["g"]
    key = call_key(body, "prefix")
    assert key is not None
    busy = {"a": 3, "b": 1, "c": 2}
    print(f"system prompt: {len(body['messages'][0]['content'])} characters")
    print(f"key (prefix hash):         {ns(lambda: call_key(body, 'prefix')):8.0f} ns")
    print(f"key (prompt_cache_key):    {ns(lambda: call_key({'prompt_cache_key': 'u-1'}, 'prefix')):8.0f} ns")
    print(f"ranking of 3 routes:       {ns(lambda: affinity.ranking(key)):8.0f} ns")
    print(f"bounded load of 3 routes:  {ns(lambda: saturated(['a', 'b', 'c'], busy)):8.0f} ns")
    anyio.run(admitted, body)


async def admitted(body: dict[str, Any]) -> None:
    """A whole admission of the call to a group of three routes, affinity on and off."""
    for mode in ("prefix", "off"):
        config = parse_config({
            "providers": {"p": {"kind": "echo"}},
            "routes": {n: {"provider": "p", "operation": "chat"} for n in ("a", "b", "c")},
            "groups": {"g": {"routes": ["a", "b", "c"], "affinity": mode}}}, env={})
        async with Gateway(config) as gw:
            gw.fallbacks.busy.update({"a": 1, "b": 1, "c": 0})  # no fast path for the load check
            took = ns(lambda: gw.admit(Call("g", body)), number=5_000)
        print(f"admission, affinity {mode + ':':7} {took:8.0f} ns")


if __name__ == "__main__":
    main()
