"""The prompt-cache fake behind ``benchmarks/bench_prompt_cache.py`` counts cached tokens as OpenAI does."""

from __future__ import annotations

from benchmarks._cache_fake import PromptCache, prompt_parts, tokens

SYSTEM = {"role": "system", "content": "x" * 8000}  # 2,000 tokens at chars / 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def parts(*messages: dict[str, str]) -> list[str]:
    return prompt_parts({"messages": list(messages)})


def test_a_follow_up_turn_reads_the_whole_previous_prompt_from_cache() -> None:
    cache = PromptCache(clock=Clock())
    first = parts(SYSTEM, {"role": "user", "content": "hi"})
    total, cached = cache.lookup_and_remember(first)
    assert cached == 0
    assert total == sum(tokens(p) for p in first)
    second = [*first, *parts({"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"})]
    assert cache.lookup_and_remember(second) == (sum(tokens(p) for p in second), total)


def test_a_prefix_under_the_minimum_is_not_a_hit() -> None:
    cache = PromptCache(clock=Clock(), min_tokens=1024)
    short = parts({"role": "system", "content": "x" * 400}, {"role": "user", "content": "hi"})
    cache.lookup_and_remember(short)
    assert cache.lookup_and_remember(short)[1] == 0


def test_tools_lead_the_prefix_and_another_tool_set_misses() -> None:
    cache = PromptCache(clock=Clock())
    body = {"tools": [{"type": "function", "function": {"name": "a"}}], "messages": [SYSTEM]}
    cache.lookup_and_remember(prompt_parts(body))
    assert cache.lookup_and_remember(prompt_parts(body))[1] > 2000
    other = {**body, "tools": [{"type": "function", "function": {"name": "b"}}]}
    assert cache.lookup_and_remember(prompt_parts(other))[1] == 0


def test_a_prefix_is_forgotten_after_its_ttl() -> None:
    clock = Clock()
    cache = PromptCache(ttl_s=300, clock=clock)
    prompt = parts(SYSTEM)
    cache.lookup_and_remember(prompt)
    clock.now = 299.0
    assert cache.lookup_and_remember(prompt)[1] == tokens(prompt[0])  # the hit renews it
    clock.now = 299.0 + 300.0
    assert cache.lookup_and_remember(prompt)[1] == 0
