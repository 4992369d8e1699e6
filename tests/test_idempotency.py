"""Idempotency keys end to end (real HTTP, a real JSON-RPC upstream on 127.0.0.1): a key is its
caller's own even on a ``dedup_scope: global`` route, and is bound to the params it was first
sent with."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from examples.jsonrpc_upstream import UpstreamState
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import RpcError
from multiplexer.gateway.idempotency import IdempotencyKey, IdempotencyKeys
from tests.jsonrpc_helpers import gateway_with_upstream

pytestmark = pytest.mark.anyio
ALICE, BOB = "sk-alice-idempotency-0123", "sk-bob-idempotency-4567"
GLOBAL = {"provider": "calc", "dedup": True, "dedup_scope": "global", "cache_ttl_s": 60}


def keyed(**routes: Any) -> dict[str, Any]:
    return {"server": {"api_keys": {"alice": ALICE, "bob": BOB}},
            "routes": {"echo": GLOBAL, "wait": {**GLOBAL, "cache_ttl_s": None}, **routes}}


async def rpc(url: str, key: str, method: str, params: dict[str, Any], idem: str) -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "id": 1, "method": method,
            "params": {**params, "_meta": {"idempotency_key": idem}}}
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(f"{url}/rpc", json=body, headers={"authorization": f"Bearer {key}"})
    assert reply.status_code == 200
    return reply.json()


async def test_an_idempotency_key_is_its_callers_own_on_a_global_dedup_route() -> None:
    """Alice's and Bob's ``"1"`` are two calls: Bob never reads Alice's cached answer."""
    async with gateway_with_upstream(**keyed()) as (url, state, _):
        assert (await rpc(url, ALICE, "echo", {"who": "alice"}, "1"))["result"] == {"who": "alice"}
        assert (await rpc(url, BOB, "echo", {"who": "bob"}, "1"))["result"] == {"who": "bob"}
        assert (await rpc(url, BOB, "echo", {"who": "alice"}, "1"))["error"]["code"] == -32602
        assert state.executions["echo"] == 2
        # the same key and params again: each caller's own cached answer, nothing runs
        assert (await rpc(url, ALICE, "echo", {"who": "alice"}, "1"))["result"] == {"who": "alice"}
        assert (await rpc(url, BOB, "echo", {"who": "bob"}, "1"))["result"] == {"who": "bob"}
        assert state.executions["echo"] == 2


async def test_a_key_reused_with_other_params_is_refused_while_its_answer_is_cached() -> None:
    async with gateway_with_upstream(**keyed()) as (url, state, _):
        assert (await rpc(url, ALICE, "echo", {"x": 1}, "k2"))["result"] == {"x": 1}
        error = (await rpc(url, ALICE, "echo", {"x": 2}, "k2"))["error"]
        assert error["code"] == -32602
        assert error["data"]["idempotency_key"] == "k2"
        assert error["data"]["param"] == "_meta.idempotency_key"
        assert "'k2'" in error["data"]["detail"] and "other params" in error["data"]["detail"]
        assert (await rpc(url, ALICE, "echo", {"x": 1}, "k2"))["result"] == {"x": 1}  # cached
        assert (await rpc(url, ALICE, "echo", {"x": 2}, "k3"))["result"] == {"x": 2}  # a new key
        assert state.executions["echo"] == 2


async def test_a_key_reused_with_other_params_is_refused_while_its_first_call_runs() -> None:
    state = UpstreamState(gate=anyio.Event())
    async with gateway_with_upstream(state, **keyed()) as (url, state, gw):
        answers: list[dict[str, Any]] = []

        async def first() -> None:
            answers.append(await rpc(url, ALICE, "wait", {"n": 1}, "w"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(10):
                while state.executions["wait"] == 0:  # the first is upstream
                    await anyio.sleep(0.01)
            refused = await rpc(url, ALICE, "wait", {"n": 2}, "w")
            assert refused["error"]["code"] == -32602
            assert refused["error"]["data"]["idempotency_key"] == "w"
            tg.start_soon(first)  # the same call again: joins the one running
            joined = gw.metrics.dedup_hits.labels("wait", "inflight")
            with anyio.fail_after(10):
                while joined._value.get() < 1:
                    await anyio.sleep(0.01)
            assert state.gate is not None
            state.gate.set()
    assert [a["result"] for a in answers] == ["released", "released"]
    assert state.executions["wait"] == 1


def key(params_digest: str, identity: str | None = "alice") -> IdempotencyKey:
    return IdempotencyKey("echo", "echo", identity, "k", params_digest)


async def test_a_key_is_bound_to_its_params_only_until_its_call_and_cache_have_run_out() -> None:
    clock = ManualClock(start=100.0)
    keys = IdempotencyKeys(clock)
    keys.check(key("a"), until=130.0)
    with pytest.raises(RpcError) as refused:
        keys.check(key("b"), until=140.0)
    assert refused.value.code == -32602 and refused.value.data["idempotency_key"] == "k"
    keys.check(key("b", identity="bob"), until=140.0)  # another caller's "k"
    keys.check(key("a"), until=150.0)  # the same call again: bound until 150 now
    await clock.advance(49.0)
    with pytest.raises(RpcError):
        keys.check(key("b"), until=160.0)
    await clock.advance(1.0)
    keys.check(key("b"), until=180.0)  # run out: the key is free for other params


def test_the_keys_remembered_are_bounded() -> None:
    keys = IdempotencyKeys(ManualClock(start=0.0), max_keys=2)
    for n in range(5):
        keys.check(IdempotencyKey("echo", "echo", "alice", str(n), "a"), until=100.0)
    assert len(keys._seen) == 2
