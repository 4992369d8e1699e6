"""Issue 54's relays with the official TypeScript SDK as the client (``@modelcontextprotocol/sdk``,
installed by ``tests/ts_sdk.py``; every test here skips, saying why, where node or npm is missing).

The TypeScript client (``tests/ts/client.mjs``, one node process per test) speaks the handshake
era (2025-11-25) over Streamable HTTP to the gateway's ``/mcp``; the upstream is
``tests/asking_upstream.py`` in both its eras (``up``: 2026-07-28, ``leg``: handshake era), and
``tests/pin_helpers.py``'s upstream that changes a tool at run time. The Python SDK's side of the
same relays is ``tests/test_mcp_asking.py``, ``test_mcp_pins.py``, ``test_mcp_tool_limits.py``
and ``test_mcp_replicas.py``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.errors import Code
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import ROOT, http_upstream, until_connected
from tests.pin_helpers import upstream_url
from tests.ts_sdk import run_script, sdk_prefix

pytestmark = pytest.mark.anyio

ASKING = str(ROOT / "tests" / "asking_upstream.py")
ALICE, ADMIN = "sk-alice-ts-client", "sk-admin-ts-client"
PER_CALL = Decimal("0.25")
EVERYTHING = ["elicitation", "sampling", "roots"]
# (tool, its arguments, what the tool answers once the client did, what the client was asked)
CASES = [("greet", {}, "hello Ada", "elicit:form"),
         ("haiku", {"topic": "sea"}, "ts-model: ts waves", "sample:sea"),
         ("where", {}, "file:///ts/work", "roots"),
         ("visit", {}, "accept", "elicit:url")]
UPSTREAMS = {"up": "auto", "leg": "legacy"}  # route prefix -> the upstream's era


def asking(protocol: str) -> dict[str, Any]:
    return {"kind": "mcp", "command": sys.executable, "args": [ASKING], "protocol": protocol,
            "restart_backoff_ms": 20, "limits": {"concurrency": 16},
            "tool_limits": {"plain": {"rpm": 2}}}


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Gateway, str]]:
    sdk_prefix()  # skip before starting anything where there is no TypeScript SDK
    folder = tmp_path_factory.mktemp("ts-client")
    async with upstream_url() as rug:
        config = {
            "server": {"host": "127.0.0.1", "port": 0, "admin_key": ADMIN,
                       "api_keys": {"alice": {"key": ALICE}},
                       "mcp": {"ask_timeout_s": 5, "sampling": {"route": "chat", "when": "client_lacks"}}},
            "store": {"path": str(folder / "store.db")},
            "spend": {"flush_interval_s": 0.05},
            "providers": {**{name: asking(protocol) for name, protocol in UPSTREAMS.items()},
                          "rug": http_upstream(rug, pin=True),
                          "m": {"kind": "mock", "price": {"per_call": str(PER_CALL)}}},
            "routes": {**{f"{name}_*": {"provider": name, "timeout_ms": 20_000} for name in UPSTREAMS},
                       "rug_*": {"provider": "rug"},
                       "chat": {"provider": "m", "operation": "chat"}},
        }
        async with running(parse_config(config)) as (gw, url):
            await until_connected(gw, [*UPSTREAMS, "rug"])
            yield gw, url + "/mcp"


def calls(*steps: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"op": "call", "name": name, "args": args} for name, args in steps]


def text(step: dict[str, Any]) -> str:
    assert "result" in step, step
    result = step["result"]
    first = result["content"][0]
    assert first["type"] == "text", result
    return str(first["text"])


async def ts_client(url: str, *sessions: dict[str, Any], key: str = ALICE) -> list[dict[str, Any]]:
    out = await run_script("client.mjs", {"url": url, "key": key, "sessions": list(sessions)})
    done: list[dict[str, Any]] = out["sessions"]
    return done


async def test_each_question_reaches_the_typescript_client_from_both_upstream_eras(
        gateway: tuple[Gateway, str]) -> None:
    """Elicitation (form and URL), sampling and roots, asked mid-call by a 2026-07-28 upstream
    (``input_required``, held by the gateway for a handshake-era client) and a handshake-era one
    (pushed requests): each reaches the TypeScript client, whose answer comes back in the tool's
    result. A session that declared nothing gets the error naming the missing capability."""
    _, url = gateway
    steps = calls(*[(f"{up}_{tool}", args) for up in UPSTREAMS for tool, args, _, _ in CASES])
    asked, bare = await ts_client(url, {"capabilities": EVERYTHING, "steps": steps},
                                  {"capabilities": [], "steps": calls(("up_greet", {}), ("leg_greet", {}))})
    assert asked["protocol"] == "2025-11-25"
    assert [text(step) for step in asked["results"]] == [c[2] for c in CASES] * len(UPSTREAMS)
    assert asked["asked"] == [c[3] for c in CASES] * len(UPSTREAMS)
    for step in bare["results"]:
        assert step["error"]["code"] == -32021, step  # the SDK's MISSING_REQUIRED_CLIENT_CAPABILITY
        assert "Client did not declare the elicitation.form capability" in step["error"]["message"]
    assert bare["asked"] == []


async def spend(url: str) -> dict[tuple[str, str], tuple[int, Decimal]]:
    async with httpx.AsyncClient(base_url=url.removesuffix("/mcp")) as http:
        r = await http.get("/admin/spend?group_by=key,route", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return {(row["key"], row["route"]): (row["calls"], Decimal(str(row["cost_usd"])))
            for row in r.json()["rows"]}


async def test_sampling_for_a_typescript_client_without_it_is_answered_by_the_route_and_booked(
        gateway: tuple[Gateway, str]) -> None:
    """``server.mcp.sampling: {route: chat, when: client_lacks}``: the TypeScript client declares
    no sampling, so the gateway's mock route answers each upstream's ``createMessage``, priced and
    booked to the calling key; the client is never asked to sample."""
    _, url = gateway
    calls_before, cost_before = (await spend(url)).get(("alice", "chat"), (0, Decimal(0)))
    (done,) = await ts_client(url, {"capabilities": ["elicitation", "roots"],
                                    "steps": calls(("up_haiku", {"topic": "sea"}),
                                                   ("leg_haiku", {"topic": "sea"}))})
    for step in done["results"]:  # the mock route's model and its reply to the topic, not the client's
        assert text(step) == "mock: This is a mock response to: sea", step
    assert done["asked"] == []
    assert (await spend(url))[("alice", "chat")] == (calls_before + 2, cost_before + 2 * PER_CALL)


async def test_a_changed_tool_is_hidden_from_the_typescript_client_until_approved(
        gateway: tuple[Gateway, str]) -> None:
    """The rug upstream changes ``lookup``'s description (called by the TypeScript client itself);
    its ``list_changed`` quarantines the tool at once: a second session of the same client does not
    see it in ``listTools`` and its call is refused with -32010 naming the change; once an admin
    approves the new definition, a third session sees it and calls it."""
    gw, url = gateway
    changed = anyio.Event()

    def listener(event: str, data: dict[str, Any]) -> None:
        if event == "tool_pin" and data["tool"] == "lookup" and data["action"] == "changed":
            changed.set()

    gw.listeners.append(listener)
    try:
        (before,) = await ts_client(url, {"steps": [{"op": "list"}, *calls(("rug_lookup", {"word": "a"}),
                                                                            ("rug_rug", {}))]})
        with anyio.fail_after(10):
            await changed.wait()
    finally:
        gw.listeners.remove(listener)
    assert "rug_lookup" in before["results"][0]["tools"]
    assert text(before["results"][1]) == "A" and text(before["results"][2]) == "changed"
    (after,) = await ts_client(url, {"steps": [{"op": "list"}, *calls(("rug_lookup", {"word": "b"}))]})
    listed, refused = after["results"]
    assert "rug_rug" in listed["tools"] and "rug_lookup" not in listed["tools"]
    assert refused["result"]["isError"] is True, refused  # a tool error, as the Python SDK sees it
    error = refused["result"]["_meta"]["multiplexer/error"]
    assert error["code"] == Code.TOOL_QUARANTINED  # -32010
    assert error["data"]["changed"] == ["description"] and error["data"]["tool"] == "lookup"
    assert "description changed" in text(refused)
    async with httpx.AsyncClient(base_url=url.removesuffix("/mcp")) as http:
        r = await http.post("/admin/mcp/tools/rug:lookup/approve", json={"hash": error["data"]["hash"]},
                            headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["status"] == "approved", r.text
    (approved,) = await ts_client(url, {"steps": [{"op": "list"}, *calls(("rug_lookup", {"word": "c"}))]})
    assert "rug_lookup" in approved["results"][0]["tools"] and text(approved["results"][1]) == "C"


async def test_a_tools_rpm_refuses_the_typescript_clients_excess_call(gateway: tuple[Gateway, str]) -> None:
    """``tool_limits: {plain: {rpm: 2}}`` on the upstream: the TypeScript client's third call in the
    minute is refused (-32003, ``tool_rpm``); another tool of the same upstream is not held back."""
    _, url = gateway
    (done,) = await ts_client(url, {"capabilities": EVERYTHING,
                                    "steps": calls(*[("up_plain", {"text": str(i)}) for i in range(3)],
                                                   ("up_greet", {}))})
    first, second, third, other = done["results"]
    assert [text(first), text(second)] == ["0", "1"]
    assert third["result"]["isError"] is True, third
    error = third["result"]["_meta"]["multiplexer/error"]
    assert error["code"] == Code.RATE_LIMITED  # -32003
    assert error["data"]["limit"] == "tool_rpm" and error["data"]["tool"] == "plain"
    assert 0 < error["data"]["retry_after"] <= 60
    assert text(other) == "hello Ada" and done["asked"] == ["elicit:form"]


async def test_a_typescript_session_works_across_three_replicas(tmp_path: Path) -> None:
    """Three gateways on one Redis behind ``tests/rr_proxy.py`` (each request to the next replica):
    two TypeScript client sessions at once, each asked every question from both upstream eras, every
    answer reaching the replica that waits for it."""
    from tests.mcp_helpers import wait_listening
    from tests.redis_helpers import redis_url
    from tests.test_mcp_asking import HttpAsking
    from tests.test_mcp_replicas import KEYS, deployment, manager_of

    sdk_prefix()
    redis_url()
    upstream = HttpAsking()
    try:
        await wait_listening(upstream.port, upstream.proc)
        async with deployment(asking=upstream.url, ask_timeout_s=5) as (replicas, url, proxy, _):
            forwarded = sum(manager_of(gw).forwarded for gw, _ in replicas)
            steps = calls(*[(f"{up}_{tool}", args) for up in UPSTREAMS for tool, args, _, _ in CASES],
                          ("echo", {"n": 1}))
            sessions = await ts_client(url, *[{"capabilities": EVERYTHING, "steps": steps}] * 2,
                                       key=KEYS["a"])
            assert set(proxy.served) == {0, 1, 2}
            assert sum(manager_of(gw).forwarded for gw, _ in replicas) > forwarded
    finally:
        upstream.stop()
    assert len({s["id"] for s in sessions}) == 2
    for session in sessions:
        assert [text(step) for step in session["results"][:-1]] == [c[2] for c in CASES] * len(UPSTREAMS)
        assert session["results"][-1]["result"]["structuredContent"] == {"n": 1}
        assert session["asked"] == [c[3] for c in CASES] * len(UPSTREAMS)
