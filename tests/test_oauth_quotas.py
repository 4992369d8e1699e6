"""An OAuth caller on /mcp is a key of the team its token names: the team's rpm holds for it as
for an API key of that team, and its budget is the team's. Tokens from a local issuer (keys made
here, its JWKS on 127.0.0.1), sent by the official MCP SDK client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
from pydantic import SecretStr

from multiplexer.access.admin import ENV
from multiplexer.access.directory import KeyDirectory
from multiplexer.access.entries import KeyEntry, TeamEntry
from multiplexer.access.keystore import TeamRow
from multiplexer.core.clock import ManualClock
from multiplexer.core.quota import Quotas
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import free_port, mcp_http_client
from tests.test_oauth import ISSUER, Issuer, issuer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio
RED_KEY = "red-key-" + "r" * 24


@pytest.fixture
async def gateway(issuer: tuple[Issuer, str], monkeypatch: Any) -> AsyncIterator[tuple[Any, str, str]]:  # noqa: F811
    """Team red at rpm 1 with a daily budget; an API key of red; OAuth tokens on /mcp."""
    monkeypatch.delenv(ENV, raising=False)
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    config = parse_config({
        "server": {"teams": {"red": {"tools": ["echo"], "rpm": 1, "budget_usd": {"daily": 5}},
                             "blue": {"tools": ["echo"], "rpm": 600}},
                   "api_keys": {"red-key": {"key": RED_KEY, "team": "red"}},
                   "oauth": {"issuer": ISSUER, "audience": audience, "jwks_url": issuer[1]}},
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}},
    })
    async with running(config, host="127.0.0.1", port=port) as (gw, url):
        yield gw, url, audience


async def served_of_ten(url: str, key: str) -> int:
    """How many of ten ``tools/call`` are served; each other one must be the rpm refusal."""
    served = 0
    async with mcp_http_client(url + "/mcp", key=key) as client:
        for i in range(10):
            result = await client.call_tool("echo", {"i": i})
            if result.is_error:
                error = (result.meta or {})["multiplexer/error"]
                assert (error["code"], error["data"]["limit"]) == (-32003, "rpm"), result
            else:
                served += 1
    return served


async def test_a_token_of_team_red_gets_the_teams_rpm_as_its_key_does(gateway: Any, issuer: Any) -> None:  # noqa: F811
    gw, url, audience = gateway
    keys, _ = issuer
    assert await served_of_ten(url, RED_KEY) == 1
    assert await served_of_ten(url, keys.token(audience, sub="ana", team="red")) == 1
    assert gw.quotas.limits("oauth:ana").rpm == 1
    assert gw.keys.entry("oauth:ana").team == "red"
    assert gw.money.budgets.budgets_of("oauth:ana") == gw.money.budgets.budgets_of("red-key")
    assert gw.money.budgets.budgets_of("oauth:ana")[0][:2] == ("team", "red")
    # the same subject with a token of another team: re-bound, its rpm and budget now blue's
    assert await served_of_ten(url, keys.token(audience, sub="ana", team="blue")) == 10
    assert gw.keys.entry("oauth:ana").team == "blue" and gw.money.budgets.budgets_of("oauth:ana") == []


def directory(**teams: TeamEntry) -> KeyDirectory:
    return KeyDirectory({"k": KeyEntry(key=SecretStr("k-secret"), team="red")}, teams,
                        Quotas(ManualClock(), {}))


def test_a_principal_answers_as_a_key_of_its_team_and_is_rebound() -> None:
    keys = directory(red=TeamEntry(rpm=2, tools=["echo"], budget_usd={"daily": Decimal(3)}),
                     blue=TeamEntry(rpm=7))
    version = keys.version
    keys.bind("oauth:a", "red")
    assert keys.entry("oauth:a").team == "red" and keys.team("red").rpm == 2  # type: ignore[union-attr]
    assert keys.quotas.limits("oauth:a").rpm == 2 and keys.rules_of("oauth:a") is not None
    keys.bind("oauth:a", "red")
    assert keys.version == version + 1  # bound once: the same claim again changes nothing
    keys.bind("oauth:a", "blue")
    assert keys.entry("oauth:a").team == "blue" and keys.quotas.limits("oauth:a").rpm == 7
    assert keys.version == version + 2  # spend's cache of budgets looks again
    keys.bind("oauth:b", "green")  # a team the config does not know: nothing, and no quota
    assert keys.quotas.limits("oauth:b") is None and keys.rules_of("oauth:b") is not None
    assert not keys.rules_of("oauth:b").tool_ok("echo")  # type: ignore[union-attr]


def test_principals_are_bounded_least_recent_first(monkeypatch: Any) -> None:
    monkeypatch.setattr("multiplexer.access.directory.MAX_BOUND", 2)
    keys = directory(red=TeamEntry(rpm=2))
    keys.bind("oauth:a", "red")
    keys.bind("oauth:b", "red")
    keys.bind("oauth:a", "red")  # a is used again: b is now the least recent
    keys.bind("oauth:c", "red")
    assert keys.entry("oauth:b") is None and keys.quotas.limits("oauth:b") is None
    assert keys.entry("oauth:a") is not None and keys.entry("oauth:c") is not None
    assert list(keys.bound) == ["oauth:a", "oauth:c"]


def test_a_stored_teams_change_reaches_its_principals() -> None:
    keys = directory()
    keys.install([], [TeamRow("ops", {"rpm": 3}, 0.0, 0.0)])
    keys.bind("oauth:a", "ops")
    assert keys.quotas.limits("oauth:a").rpm == 3
    keys.install([], [TeamRow("ops", {"rpm": 9}, 0.0, 0.0)])
    assert keys.quotas.limits("oauth:a").rpm == 9 and keys.entry("oauth:a").team == "ops"
    keys.install([], [])  # the team is gone: the principal may use nothing, and has no quota
    assert keys.quotas.limits("oauth:a") is None and not keys.rules_of("oauth:a").tool_ok("x")  # type: ignore[union-attr]
