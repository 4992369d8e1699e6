"""An upstream's ``sampling/createMessage`` answered by a chat route of the gateway (issue 54, part 2):
an item of the calling key, under its access, quotas and budget, priced and booked to it.

Upstream: ``tests/asking_upstream.py``'s ``haiku`` (its model hint names ``chat``), as a
2026-07-28 upstream (``up``, ``input_required``) and a handshake-era one (``leg``, pushed).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import mcp_types as types
import pytest

from multiplexer.faces.mcp.asking import ClientAsker
from multiplexer.faces.mcp.sampling import FACE, Sampler, chat_body, sampling_result
from multiplexer.gateway.config import McpSamplingConfig, parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import ROOT, mcp_http_client, until_connected, wait_until

pytestmark = pytest.mark.anyio

ASKING = str(ROOT / "tests" / "asking_upstream.py")
ALICE, BOB, ADMIN = "sk-alice-sampling", "sk-bob-sampling", "sk-admin-sampling"
PER_CALL = Decimal("0.25")
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}


def upstream(protocol: str) -> dict[str, Any]:
    return {"kind": "mcp", "command": sys.executable, "args": [ASKING], "protocol": protocol,
            "restart_backoff_ms": 20}


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Gateway, str]]:
    store = tmp_path_factory.mktemp("sampling") / "store.db"
    config = {
        "server": {"host": "127.0.0.1", "port": 0, "admin_key": ADMIN,
                   "api_keys": {"alice": {"key": ALICE}, "bob": {"key": BOB, "routes": ["up_*", "leg_*"]}},
                   "mcp": {"sampling": {"route": "chat", "when": "client_lacks"}}},
        "store": {"path": str(store)},
        "spend": {"flush_interval_s": 0.05},
        "log": {"flush_interval_s": 0.05},
        "providers": {"up": upstream("auto"), "leg": upstream("legacy"),
                      "m": {"kind": "mock", "price": {"per_call": str(PER_CALL)}}},
        "routes": {"up_*": {"provider": "up"}, "leg_*": {"provider": "leg"},
                   "chat": {"provider": "m", "operation": "chat"}},
    }
    async with running(parse_config(config)) as (gw, url):
        await until_connected(gw, ["up", "leg"])
        yield gw, url


async def spend(url: str) -> dict[tuple[str, str], tuple[int, Decimal]]:
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.get("/admin/spend?group_by=key,route", headers=AS_ADMIN)
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    return {(row["key"], row["route"]): (row["calls"], Decimal(str(row["cost_usd"]))) for row in rows}


def text(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent), result
    return first.text


@pytest.mark.parametrize("up", ["up", "leg"])
async def test_a_key_that_may_not_use_the_sampling_route_is_refused(gateway: tuple[Gateway, str],
                                                                    up: str) -> None:
    """The bypass test: sampling is a call of the calling key, checked by admission like any."""
    _, url = gateway
    before = await spend(url)
    async with mcp_http_client(url + "/mcp", "auto", key=BOB) as client:
        try:
            result = await client.call_tool(f"{up}_haiku", {"topic": "sea"})
            refusal = text(result) if result.is_error else f"answered: {text(result)}"
        except Exception as e:  # the upstream's failure, as the SDK raises it
            refusal = str(e)
    assert "Permission denied: this key may not use route 'chat'" in refusal, refusal
    after = await spend(url)
    assert after.get(("bob", "chat")) is None and after.get(("bob", "chat")) == before.get(("bob", "chat"))


@pytest.mark.parametrize("up", ["up", "leg"])
async def test_sampling_is_answered_by_the_route_and_booked_to_the_caller(gateway: tuple[Gateway, str],
                                                                         up: str) -> None:
    _, url = gateway
    calls, cost = (await spend(url)).get(("alice", "chat"), (0, Decimal(0)))
    async with mcp_http_client(url + "/mcp", "auto", key=ALICE) as client:  # declares no sampling
        result = await client.call_tool(f"{up}_haiku", {"topic": "the sea at night"})
    assert not result.is_error, result
    model, _, reply = text(result).partition(": ")
    assert reply and model  # the mock route's reply to the topic, and the model it names
    assert (await spend(url))[("alice", "chat")] == (calls + 1, cost + PER_CALL)
    async with httpx.AsyncClient(base_url=url) as http:  # its source, in the request log

        async def recorded() -> bool:
            r = await http.get("/admin/requests", headers=AS_ADMIN, params={"key": "alice", "route": "chat"})
            return any(row["face"] == FACE for row in r.json()["requests"])

        await wait_until(recorded)


async def test_a_client_with_sampling_is_asked_when_it_lacks_nothing(gateway: tuple[Gateway, str]) -> None:
    _, url = gateway
    asked: list[str] = []

    async def sample(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        asked.append("sample")
        return types.CreateMessageResult(role="assistant", model="client-model",
                                         content=types.TextContent(type="text", text="own"))

    async with mcp_http_client(url + "/mcp", "legacy", key=ALICE, sampling_callback=sample) as client:
        result = await client.call_tool("leg_haiku", {"topic": "sea"})
    assert text(result) == "client-model: own" and asked == ["sample"]


def test_model_hints_pick_the_route_the_table_says(tmp_path: Path) -> None:
    config = parse_config({
        "providers": {"m": {"kind": "mock"}},
        "routes": {name: {"provider": "m", "operation": "chat"}
                   for name in ("chat", "fast-chat", "big-chat")},
    })
    gw = Gateway(config)
    sampler = Sampler(gw, McpSamplingConfig(route="chat"), None)
    assert sampler.route_for(None) == "chat"
    assert sampler.route_for({"hints": [{"name": "big-chat"}]}) == "big-chat"  # a name: that route
    assert sampler.route_for({"hints": [{"name": "nope"}, {"name": "fast"}]}) == "fast-chat"  # a part of one
    assert sampler.route_for({"hints": [{"name": "claude-3"}]}) == "chat"  # none: the configured route


def test_sampling_requests_and_answers_translate() -> None:
    body = chat_body({"messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}],
                      "systemPrompt": "be brief", "maxTokens": 5, "temperature": 0.2, "stopSequences": ["."]})
    assert body == {"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}],
                    "max_tokens": 5, "temperature": 0.2, "stop": ["."]}
    completion = {"model": "m1", "choices": [{"message": {"content": "yo"}, "finish_reason": "length"}]}
    answer = sampling_result(completion, "chat")
    assert answer == {"role": "assistant", "content": {"type": "text", "text": "yo"}, "model": "m1",
                      "stopReason": "maxTokens"}


def test_always_answers_even_a_client_that_samples() -> None:
    class Ctx:
        caps = types.ClientCapabilities(sampling=types.SamplingCapability())
        session = type("S", (), {"client_capabilities": caps})()
        request_id = 1
        protocol_version = "2025-11-25"

    gw = Gateway(parse_config({"providers": {"m": {"kind": "mock"}},
                               "routes": {"chat": {"provider": "m", "operation": "chat"}}}))
    lacks = ClientAsker(Ctx(), 5, Sampler(gw, McpSamplingConfig(route="chat"), None), None)  # type: ignore[arg-type]
    always = ClientAsker(Ctx(), 5, Sampler(gw, McpSamplingConfig(route="chat", when="always"), None),  # type: ignore[arg-type]
                         None)
    assert not lacks.answers_here("sampling/createMessage", {})
    assert always.answers_here("sampling/createMessage", {})
    assert not always.answers_here("roots/list", {})
