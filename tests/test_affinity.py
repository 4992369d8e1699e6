"""Cache affinity for model groups: the key of a call, the rendezvous ranking of a group's routes
(stable, even, minimal moves, weighted) and bounded load, as pure functions and in admission."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from multiplexer.core.call import Call
from multiplexer.core.policy import GroupConfig, RouteConfig
from multiplexer.gateway.affinity import affinities, call_key, mode_of, ranking, saturated
from tests.fallback_helpers import gateway, upstreams

ROUTES = {name: RouteConfig(provider="p", operation="chat") for name in ("a", "b", "c")}
KEYS = range(1, 30_001)


def members(names: tuple[str, ...] = ("a", "b", "c"), weights: dict[str, float] | None = None,
            ) -> tuple[tuple[str, int, float], ...]:
    group = GroupConfig(routes=list(names), strategy="weighted" if weights else "least_busy",
                        weights=weights or {})
    return affinities({"g": group}, {n: ROUTES.get(n, ROUTES["a"]) for n in names})["g"].members


def spread_key(i: int) -> int:
    return call_key({"prompt_cache_key": f"user-{i}"}, "prefix") or 0


def turn(n: int, system: str = "You are terse.", first: str = "hello") -> dict[str, Any]:
    """Turn ``n`` (0-based) of one conversation: its history grows, its head does not."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": first}]
    for i in range(n):
        messages += [{"role": "assistant", "content": f"answer {i}"},
                     {"role": "user", "content": f"question {i + 1}"}]
    return {"model": "g", "messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}


def test_every_turn_of_a_conversation_has_one_key_and_another_conversation_another() -> None:
    keys = {call_key(turn(n), "prefix") for n in range(4)}
    assert len(keys) == 1 and None not in keys
    assert call_key(turn(0, first="other"), "prefix") not in keys
    assert call_key(turn(0, system="You are verbose."), "prefix") not in keys
    assert call_key({**turn(0), "tools": []}, "prefix") not in keys


def test_a_moved_cache_control_mark_keeps_the_key() -> None:
    def anthropic(marked: bool, n: int) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "text", "text": "hello"}
        if marked:
            block["cache_control"] = {"type": "ephemeral"}
        rest = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}] * n
        return {"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": [block]}, *rest]}

    assert call_key(anthropic(True, 0), "prefix") == call_key(anthropic(False, 1), "prefix")
    assert call_key(anthropic(True, 0), "prefix") != call_key({**anthropic(True, 0), "system": "T"}, "prefix")


def test_prompt_cache_key_comes_first_and_modes_say_what_counts() -> None:
    keyed = {**turn(0), "prompt_cache_key": "tenant-7"}
    other_turn = {**turn(2, first="x"), "prompt_cache_key": "tenant-7"}
    assert call_key(keyed, "prefix") == call_key(other_turn, "prefix")
    assert call_key(keyed, "session") == call_key(keyed, "prefix")
    assert call_key(turn(0), "session") is None  # no explicit key: the strategy picks
    assert call_key(keyed, "off") is None
    assert call_key({"input": ["a", "b"]}, "prefix") is None  # no prompt head: no key
    assert call_key(["positional"], "prefix") is None
    responses = {"instructions": "be brief", "input": "hi"}
    assert call_key(responses, "prefix") == call_key({**responses, "previous_response_id": "r"}, "prefix")


def test_the_ranking_is_stable_and_the_same_on_every_replica() -> None:
    one, two = members(), members()
    assert one == two  # seeds come from the route names alone
    for key in (1, 2**63, spread_key(5)):
        assert ranking(key, one) == ranking(key, two) == ranking(key, one)
        assert sorted(ranking(key, one)) == ["a", "b", "c"]


def test_keys_spread_evenly_over_three_routes_within_ten_percent() -> None:
    group = members()
    firsts = Counter(ranking(spread_key(i), group)[0] for i in KEYS)
    expected = len(KEYS) / 3
    assert set(firsts) == {"a", "b", "c"}
    assert all(abs(n - expected) <= 0.1 * expected for n in firsts.values()), firsts


def test_removing_a_route_moves_only_its_own_keys() -> None:
    three, two = members(), members(("a", "b"))
    moved = 0
    for i in KEYS:
        key = spread_key(i)
        before, after = ranking(key, three)[0], ranking(key, two)[0]
        if before != after:
            assert before == "c"  # only the removed route's keys move
            moved += 1
    assert abs(moved / len(KEYS) - 1 / 3) < 0.02


def test_weights_apply_as_rendezvous_weights() -> None:
    group = members(weights={"a": 2.0, "b": 1.0, "c": 1.0})
    firsts = Counter(ranking(spread_key(i), group)[0] for i in KEYS)
    assert abs(firsts["a"] / len(KEYS) - 0.5) < 0.02, firsts
    assert ranking(1, members(weights={"a": 0.0, "b": 1.0, "c": 1.0}))[-1] == "a"


def test_saturation_is_above_one_and_a_quarter_times_the_mean_plus_one() -> None:
    assert saturated(["a", "b", "c"], {}) == set()
    assert saturated(["a", "b", "c"], {"a": 1}) == set()  # cap 1.42: one call is never too many
    assert saturated(["a", "b", "c"], {"a": 6, "b": 3, "c": 0}) == {"a"}  # cap 4.75
    assert saturated(["a", "b", "c"], {"a": 5, "b": 5, "c": 5}) == set()


def test_the_default_mode_is_prefix_only_for_chat_and_messages_groups() -> None:
    routes = {"chat": RouteConfig(provider="p", operation="chat"),
              "msg": RouteConfig(provider="p", operation="messages"),
              "emb": RouteConfig(provider="p", operation="embeddings")}
    assert mode_of(GroupConfig(routes=["chat", "msg"]), routes) == "prefix"
    assert mode_of(GroupConfig(routes=["chat", "emb"]), routes) == "off"
    assert mode_of(GroupConfig(routes=["emb"], affinity="session"), routes) == "session"
    assert mode_of(GroupConfig(routes=["chat"], affinity="off"), routes) == "off"
    assert set(affinities({"x": GroupConfig(routes=["chat"], affinity="off")}, routes)) == set()


GW_ROUTES = {n: {"provider": n, "operation": "chat", "params": {"model": f"m-{n}"}} for n in ("a", "b", "c")}


@pytest.mark.anyio
async def test_bounded_load_moves_a_saturated_members_keys_and_counts_them(tmp_path: Path) -> None:
    router, up = upstreams("a", "b", "c")
    groups = {"g": {"routes": ["a", "b", "c"]}}
    async with gateway(tmp_path, router, up, GW_ROUTES, groups=groups) as gw:
        fb = gw.fallbacks
        params = [{"messages": [{"role": "user", "content": f"conversation {i}"}]} for i in range(300)]
        homes = [fb.affinity["g"].ranking(call_key(p, "prefix") or 0) for p in params]
        assert [gw.admit(Call("g", p)).label for p in params] == [h[0] for h in homes]
        fb.busy.update({"a": 9, "b": 2, "c": 1})  # a above 1.25 x 4 + 1
        labels = [gw.admit(Call("g", p)).label for p in params]
        for label, home in zip(labels, homes, strict=True):
            assert label == (home[1] if home[0] == "a" else home[0])  # a's keys to their second pick
        moved = sum(h[0] == "a" for h in homes)
        assert 60 < moved < 140
        assert fb.cache_moves.value("g", "overloaded") == moved
        fb.busy.clear()
        assert [gw.admit(Call("g", p)).label for p in params] == [h[0] for h in homes]  # and back


def test_a_bare_yaml_off_turns_affinity_off() -> None:
    """YAML 1.1 reads `affinity: off` as false; the config takes it as `off`, not an error."""
    import yaml

    from multiplexer.core.policy import GroupConfig

    data = yaml.safe_load("routes: [a, b]\naffinity: off\n")
    assert data["affinity"] is False
    assert GroupConfig.model_validate(data).affinity == "off"
