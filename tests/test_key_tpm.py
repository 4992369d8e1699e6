"""A key's tokens per minute: each call charged its provider's estimate at admission, settled to
the usage its answer reports; in one gateway, across replicas on Redis, and refused in each face's
shape like an rpm refusal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code, upstream_error
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import Provider
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.redis_helpers import prefix, redis_url

pytestmark = pytest.mark.anyio


class Metered(Provider):
    """Estimates a call at its ``estimate`` param (as a model provider's ``prepare`` does) and
    answers with ``used`` tokens of usage when the call names it, no usage otherwise."""

    def __init__(self) -> None:
        self.name = "p"
        self.ran = 0

    def prepare(self, route: RouteConfig, item: Item) -> None:
        item.tokens = item.params["estimate"]

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        self.ran += len(items)
        return [Outcome.fail(upstream_error("p", "refused")) if i.params.get("fail")
                else Outcome(result={"usage": {"prompt_tokens": i.params["used"], "completion_tokens": 0}}
                             if "used" in i.params else {}) for i in items]


def tpm_config(dedup: bool = False, **state: Any) -> Any:
    """alice's key asks 500 tokens a minute, her team 100: the smaller holds."""
    return parse_config({
        "server": {"api_keys": {"alice": {"key": "k-alice", "team": "red", "tpm": 500}},
                   "teams": {"red": {"tpm": 100}}},
        **({"state": state} if state else {}),
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1}}},
        "routes": {"r": {"provider": "p", "dedup": dedup}},
    })


def calls(*params: dict[str, Any]) -> list[Call]:
    return [Call("r", {"i": i, **p}, identity="alice") for i, p in enumerate(params)]


async def test_a_keys_tpm_charges_estimates_refills_and_settles_to_usage() -> None:
    clock, provider = ManualClock(), Metered()
    async with Gateway(tpm_config(), clock=clock, providers={"p": provider}) as gw:
        assert gw.quotas.limits("alice").tpm == 100  # type: ignore[union-attr]
        # one array, decided before any of it runs: 40 + 40 of 100, the third lacks 20
        first = await gw.submit_many(calls({"estimate": 40}, {"estimate": 40}, {"estimate": 40}))
        assert [o.ok for o in first] == [True, True, False]
        assert first[2].error.code == Code.RATE_LIMITED  # type: ignore[union-attr]
        assert first[2].error.data == {"limit": "tpm", "retry_after": 12.0,  # type: ignore[union-attr]
                                       "identity": "alice"}
        assert provider.ran == 2  # a refused call never runs
        await clock.advance(11.9)  # no usage came back: the estimates stand, 20 + 19.8 left
        assert not (await gw.submit_many(calls({"estimate": 40})))[0].ok
        await clock.advance(0.1)
        assert (await gw.submit_many(calls({"estimate": 40})))[0].ok  # the window refilled
        await clock.advance(60)  # full again: 100
        used = await gw.submit_many(calls({"estimate": 40, "used": 5}, {"estimate": 40, "used": 5}))
        assert all(o.ok for o in used)  # settled to 5 each: 90 left, not 20
        assert (await gw.submit_many(calls({"estimate": 90})))[0].ok
        assert not (await gw.submit_many(calls({"estimate": 1})))[0].ok
        bob = await gw.submit(Call("r", {"estimate": 10_000}))  # no key, no tpm: never asked
        assert bob.ok


async def test_a_shared_answer_costs_no_tokens_and_a_failed_call_keeps_its_estimate() -> None:
    clock, provider = ManualClock(), Metered()
    async with Gateway(tpm_config(dedup=True), clock=clock, providers={"p": provider}) as gw:
        same = [Call("r", {"estimate": 40, "used": 30}, identity="alice") for _ in range(2)]
        assert all(o.ok for o in await gw.submit_many(same)) and provider.ran == 1
        # the one that ran is settled to its 30, the one that joined it to 0: 70 left
        failed = await gw.submit_many(calls({"estimate": 40, "fail": True}))
        assert failed[0].error is not None and failed[0].error.code == Code.UPSTREAM_ERROR
        # its 40 stand (it may have used them upstream): 30 left
        assert (await gw.submit_many(calls({"estimate": 30})))[0].ok
        assert not (await gw.submit_many(calls({"estimate": 1})))[0].ok


async def test_a_keys_tpm_is_shared_by_the_replicas() -> None:
    config = tpm_config(url=redis_url(), prefix=prefix())
    async with Gateway(config, providers={"p": Metered()}) as g1, \
            Gateway(config, providers={"p": Metered()}) as g2:
        assert (await g1.submit_many(calls({"estimate": 40})))[0].ok
        assert (await g2.submit_many(calls({"estimate": 40})))[0].ok
        window = g2.quotas.window("alice", "tpm")  # its headers: as g2's decision left the bucket
        assert window is not None and window[0] == 100 and 20 <= window[1] < 21  # type: ignore[operator]
        third = (await g1.submit_many(calls({"estimate": 40})))[0].error
        assert third is not None and third.data is not None and third.data["limit"] == "tpm"
        assert 11 < third.data["retry_after"] <= 12.0  # both replicas' 80 of the 100
        # a call that used nothing of its 15 gives them back to every replica as it ends
        assert (await g2.submit_many(calls({"estimate": 15, "used": 0})))[0].ok
        assert (await g1.submit_many(calls({"estimate": 20})))[0].ok  # 20 left, not 5
        refused = (await g2.submit_many(calls({"estimate": 20})))[0].error
        assert refused is not None and refused.data is not None and refused.data["limit"] == "tpm"


# -- the refusal on each face --------------------------------------------------------------------
def face_config(tmp_path: Path) -> Any:
    """A mock model whose every answer uses 2 tokens (the prompt's one word and "ok"): a call
    asking 100 more than that is charged 101, all of alice's 10, then settled to 2."""
    return parse_config({
        "server": {"api_keys": {"alice": {"key": "k-alice", "tpm": 10}}},
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"m": {"kind": "mock", "response": "ok"}},
        "routes": {"chat": {"provider": "m", "operation": "chat", "models": ["gpt-4o-mini"]},
                   "claude": {"provider": "m", "operation": "messages", "models": ["claude-x"]}},
    })


AUTH = {"authorization": "Bearer k-alice"}
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}


async def refused_after_one(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                            headers: dict[str, str]) -> httpx.Response:
    """The first call goes (the whole bucket, then settled to 2 of it: 8 left); the second is
    charged 101 again and waits for the 2 it lacks (12 s at 10 a minute)."""
    first = await http.post(path, json=body, headers=headers)
    assert first.status_code == 200
    if path.startswith("/v1"):  # the key's tpm as the last decision, then the settlement, left it
        assert first.headers["x-ratelimit-limit-tokens"] == "10"
        assert first.headers["x-ratelimit-remaining-tokens"] == "8"
        assert 11 < float(first.headers["x-ratelimit-reset-tokens"].rstrip("s")) <= 12
        assert "x-ratelimit-limit-requests" not in first.headers  # no rpm quota
    return await http.post(path, json=body, headers=headers)


async def test_a_tpm_refusal_on_v1_is_a_429_like_rpm(tmp_path: Path) -> None:
    async with running(face_config(tmp_path), port=0) as (_, url), httpx.AsyncClient(base_url=url) as http:
        r = await refused_after_one(http, "/v1/chat/completions", CHAT, AUTH)
        assert r.status_code == 429 and 11 <= int(r.headers["retry-after"]) <= 12
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert error["message"] == f"Rate limited: tpm; retry after {r.headers['retry-after']} s"


async def test_a_tpm_refusal_on_v1_messages_is_anthropics_429(tmp_path: Path) -> None:
    async with running(face_config(tmp_path), port=0) as (_, url), httpx.AsyncClient(base_url=url) as http:
        body = {**CHAT, "model": "claude-x"}
        r = await refused_after_one(http, "/v1/messages", body, {"x-api-key": "k-alice"})
        assert r.status_code == 429 and 11 <= int(r.headers["retry-after"]) <= 12
        said = f"Rate limited: tpm; retry after {r.headers['retry-after']} s"
        assert r.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": said}}


async def test_a_tpm_refusal_on_rpc_is_minus_32003(tmp_path: Path) -> None:
    async with running(face_config(tmp_path), port=0) as (_, url), httpx.AsyncClient(base_url=url) as http:
        body = {"jsonrpc": "2.0", "id": 1, "method": "chat", "params": CHAT}
        r = await refused_after_one(http, "/rpc", body, AUTH)
        error = r.json()["error"]
        assert error["code"] == -32003 and error["message"] == "Rate limited"
        assert error["data"]["limit"] == "tpm" and error["data"]["identity"] == "alice"
        assert 11 < error["data"]["retry_after"] <= 12
