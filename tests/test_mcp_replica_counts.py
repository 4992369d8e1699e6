"""Open MCP sessions counted for every replica (``state.url``): ``server.mcp.max_sessions`` and
``max_sessions_per_key`` hold across two gateways on one Redis, a session leaves the count when its
client ends it on any replica or when it idles out."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from multiplexer.backends.redis_state import RedisState
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import wait_until
from tests.redis_helpers import prefix, redis_url
from tests.test_mcp_replicas import together

pytestmark = pytest.mark.anyio

KEYS = {"alice": "key-a-" + "x" * 20, "bob": "key-b-" + "y" * 20}
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}


def config(state_prefix: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0, "api_keys": KEYS,
                   "mcp": {"max_sessions": 3, "max_sessions_per_key": 2}},
        "state": {"url": redis_url(), "prefix": state_prefix},
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}},
    }


def as_(key: str, session: str | None = None) -> dict[str, str]:
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {KEYS[key]}"}
    if session is not None:
        headers |= {"Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-11-25"}
    return headers


async def test_session_caps_hold_across_replicas_and_a_delete_anywhere_frees_a_place() -> None:
    pre = prefix()
    gateways = [running(parse_config(config(pre))) for _ in range(2)]
    async with together(gateways) as replicas, httpx.AsyncClient() as http:
        a, b = (url + "/mcp" for _, url in replicas)
        first = await http.post(a, json=INIT, headers=as_("alice"))
        second = await http.post(b, json=INIT, headers=as_("alice"))
        assert (first.status_code, second.status_code) == (200, 200)
        third = await http.post(a, json=INIT, headers=as_("alice"))  # one here, one on b: two
        assert third.status_code == 429
        assert third.json()["error"]["code"] == -32003
        assert third.json()["error"]["data"] == {"limit": "mcp_sessions", "max": 2, "open": 2}
        assert (await http.post(b, json=INIT, headers=as_("bob"))).status_code == 200
        full = await http.post(a, json=INIT, headers=as_("bob"))  # three open on the two replicas
        assert full.status_code == 503 and full.json()["error"]["message"] == "Too many open sessions"
        # alice ends the session she opened on a through b: its place is free on both
        ended = await http.delete(b, headers=as_("alice", first.headers["mcp-session-id"]))
        assert ended.status_code == 200
        again = await http.post(a, json=INIT, headers=as_("alice"))
        assert again.status_code == 200
        listed = await http.post(a, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                 headers=as_("alice", second.headers["mcp-session-id"]))
        assert listed.status_code == 200  # a session opened on b works on a at the cap


async def test_an_idle_session_leaves_the_count() -> None:
    state = RedisState(redis_url(), prefix=prefix())
    try:
        sessions = state.mcp_sessions()
        owner = '{"client_id": "alice"}'
        assert await sessions.open("/mcp", "s1", owner, 0.2, 1, None) == (True, "", 0)
        assert await sessions.open("/mcp", "s2", owner, 0.2, 1, None) == (False, "all", 1)
        assert await sessions.open("/mcp", "s2", owner, 0.2, None, 1) == (False, "key", 1)
        assert await sessions.open("/mcp", "s3", "null", 30, None, 1) == (True, "", 0)  # another key

        async def s1_idled_out() -> bool:
            return (await sessions.open("/mcp", "s2", owner, 30, None, 1))[0]

        await wait_until(s1_idled_out, timeout=5)  # Redis's own clock: 200 ms without a touch
        assert await sessions.open_count("/mcp") == 2
        await sessions.delete("/mcp", "s2", owner)
        await sessions.delete("/mcp", "s3")  # its owner read from its record: none kept here
        assert await sessions.open_count("/mcp") == 0
    finally:
        await state.aclose()
