"""``prompt_cache: auto``: Anthropic breakpoints on the stable prefix where the caller set none
(tools, system, a conversation's last user turns; above the model's minimum; at most four), a
caller's own markers never touched, OpenAI's ``prompt_cache_key`` from the key and the head, and
the setting on a provider or a route."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from multiplexer.core.call import Item
from multiplexer.core.policy import RouteConfig
from multiplexer.gateway.config import ConfigError, parse_config
from providers.anthropic import AnthropicProvider
from providers.openai import OpenAIProvider
from providers.prompt_cache import anthropic_markers, minimum, openai_cache_key
from tests.remote_helpers import make_provider

LONG = "Follow the style guide to the letter. " * 400  # about 3,800 tokens
TOOLS = [{"name": "search", "description": "search the manual", "input_schema": {"type": "object"}},
         {"name": "open", "description": "open a page", "input_schema": {"type": "object"}}]
EPHEMERAL = {"type": "ephemeral"}


def conversation(turns: int, system: Any = LONG) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "first question"}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": f"answer {i}"},
                     {"role": "user", "content": [{"type": "text", "text": f"question {i + 1}"}]}]
    return {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": system, "tools": TOOLS,
            "messages": messages}


def marks(params: dict[str, Any]) -> list[str]:
    found = []
    for i, tool in enumerate(params.get("tools") or []):
        if "cache_control" in tool:
            found.append(f"tool{i}")
    system = params.get("system")
    if isinstance(system, list) and any("cache_control" in b for b in system):
        found.append("system")
    for i, m in enumerate(params["messages"]):
        if isinstance(m["content"], list) and any("cache_control" in b for b in m["content"]):
            found.append(f"message{i}")
    return found


def test_a_long_system_prompt_is_marked_and_the_callers_objects_are_not_changed() -> None:
    params = conversation(0)
    before = copy.deepcopy(params)
    out = anthropic_markers(params, 1024)
    assert out is not None and params == before
    assert marks(out) == ["system"]  # the tools alone are under the minimum; a first turn: no history
    assert out["system"] == [{"type": "text", "text": LONG, "cache_control": EPHEMERAL}]
    assert out["messages"] is params["messages"] and out["tools"] is params["tools"]


def test_a_conversation_marks_tools_system_and_its_last_two_user_turns_at_most_four() -> None:
    big_tools = [{**t, "description": LONG} for t in TOOLS]
    params = {**conversation(3), "tools": big_tools}
    out = anthropic_markers(params, 1024)
    assert out is not None
    assert marks(out) == ["tool1", "system", "message4", "message6"]
    last = out["messages"][6]["content"][-1]
    assert last == {"type": "text", "text": "question 3", "cache_control": EPHEMERAL}
    assert params["messages"][6]["content"][-1] == {"type": "text", "text": "question 3"}


def test_a_callers_own_marker_anywhere_leaves_the_body_as_it_is() -> None:
    for own in ({"system": [{"type": "text", "text": LONG, "cache_control": EPHEMERAL}]},
                {"tools": [*TOOLS[:-1], {**TOOLS[-1], "cache_control": EPHEMERAL}]},
                {"cache_control": EPHEMERAL}):
        assert anthropic_markers({**conversation(2), **own}, 1024) is None
    marked_turn = conversation(1)
    marked_turn["messages"][2]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert anthropic_markers(marked_turn, 1024) is None


def test_a_short_prompt_gets_no_marker_and_haiku_needs_more() -> None:
    assert anthropic_markers(conversation(2, system="Be brief."), 1024) is None
    assert minimum("claude-haiku-4-5", None) == 2048 and minimum("claude-sonnet-4-5", None) == 1024
    medium = "x " * 3000  # about 1,500 tokens: cached for Sonnet, not for Haiku
    assert anthropic_markers(conversation(0, system=medium), 2048) is None
    assert anthropic_markers(conversation(0, system=medium), 1024) is not None


def item(provider: Any, operation: str, params: dict[str, Any], **options: Any) -> Item:
    it = Item(route="r", operation=operation, method="m", params=params, identity="key-1",
              options={"mode": "sync", **options})
    provider.prepare(RouteConfig(provider="p", operation=operation), it)
    return it


def test_the_provider_or_the_route_turns_it_on(tmp_path) -> None:
    off = make_provider(AnthropicProvider, {"api_key": "k"}, tmp_path)
    params = conversation(1)
    assert item(off, "messages", params).params is params  # off: as the caller sent it
    both = ["system", "message0", "message2"]
    assert marks(item(off, "messages", params, prompt_cache="auto").params) == both
    on = make_provider(AnthropicProvider, {"api_key": "k", "prompt_cache": "auto"}, tmp_path)
    assert marks(item(on, "messages", params).params) == both
    assert item(on, "messages", params, prompt_cache="off").params is params


def test_openai_gets_a_prompt_cache_key_by_caller_and_head_and_keeps_its_own(tmp_path) -> None:
    p = make_provider(OpenAIProvider, {"api_key": "k", "prompt_cache": "auto"}, tmp_path)
    chat = {"model": "gpt-5", "messages": [{"role": "system", "content": LONG},
                                           {"role": "user", "content": "q"}]}
    later = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "a"},
                                  {"role": "user", "content": "q2"}]}
    key = item(p, "chat", chat).params["prompt_cache_key"]
    assert key.startswith("mux-") and item(p, "chat", later).params["prompt_cache_key"] == key
    assert openai_cache_key(chat, "key-2") != key  # another caller: another key
    own = {**chat, "prompt_cache_key": "mine"}
    assert item(p, "chat", own).params is own
    assert "prompt_cache_key" not in item(p, "chat", chat, prompt_cache="off").params


def test_the_route_key_is_checked_at_load() -> None:
    base = {"providers": {"a": {"kind": "anthropic", "api_key": "k", "prompt_cache": "auto"}},
            "routes": {"m": {"provider": "a", "operation": "messages", "prompt_cache": "off"}}}
    assert parse_config(base, env={}).routes["m"].extra == {"prompt_cache": "off"}
    bad = {**base, "routes": {"m": {"provider": "a", "operation": "messages", "prompt_cache": "always"}}}
    with pytest.raises(ConfigError, match="prompt_cache"):
        parse_config(bad, env={})
