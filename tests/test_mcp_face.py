"""The gateway as an MCP server over Streamable HTTP, driven by the SDK's own client, in both eras."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import mcp_types as types
import psutil
import pytest
import yaml
from mcp import MCPError

from multiplexer.core.call import Call
from multiplexer.core.provider import ToolSpec
from multiplexer.faces.mcp.tools import ERROR_META_KEY
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import (
    MODES,
    ROOT,
    call,
    free_port,
    grow_and_hear_it,
    live_children,
    mcp_http_client,
    stdio_upstream,
    structured,
    wait_until,
)

pytestmark = pytest.mark.anyio

LONG = "a_route_with_a_name_far_longer_than_the_sixty_four_characters_clients_accept"

SUM_SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "number"}}},
              "required": ["values"]}


def gateway_config(**server: Any) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0, **server},
        "providers": {"tools": stdio_upstream(), "builtin": {"kind": "echo"}},
        "routes": {
            "tools_*": {"provider": "tools"},
            "echo": {"provider": "builtin", "description": "Returns its params"},
            "sum": {"provider": "builtin", "input_schema": SUM_SCHEMA},
            LONG: {"provider": "builtin", "method": "echo"},
            "plus": {"provider": "tools", "method": "add"},
        },
    }


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    before = live_children()
    async with running(parse_config(gateway_config())) as (gw, url):
        yield gw, url + "/mcp"
    assert live_children() <= before


@pytest.mark.parametrize("mode", MODES)
async def test_every_route_is_a_tool(gateway: tuple[Gateway, str], mode: str) -> None:
    _, url = gateway
    async with mcp_http_client(url, mode) as client:
        assert client.protocol_version == MODES[mode]
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert {"tools_echo", "tools_add", "tools_sleep", "echo", "sum"} <= set(tools)
        assert tools["sum"].input_schema == SUM_SCHEMA  # from config
        assert tools["echo"].description == "Returns its params"
        assert set(tools["tools_add"].input_schema["properties"]) == {"a", "b"}  # from the upstream
        assert tools["tools_add"].annotations is not None and tools["tools_add"].annotations.read_only_hint
        assert tools["plus"].input_schema == tools["tools_add"].input_schema  # exact route to an upstream
        assert (await client.call_tool("plus", {"a": 1, "b": 2})).structured_content == {"result": 3}
        assert all(len(name) <= 64 for name in tools)
        alias = next(n for n in tools if n.startswith(LONG[:40]))
        result = await client.call_tool(alias, {"via": "alias"})
        assert result.structured_content == {"via": "alias"}


@pytest.mark.parametrize("mode", MODES)
async def test_calls_results_and_errors(gateway: tuple[Gateway, str], mode: str) -> None:
    _, url = gateway
    async with mcp_http_client(url, mode) as client:
        passthrough = await client.call_tool("tools_add", {"a": 2, "b": 40})
        assert passthrough.structured_content == {"result": 42} and not passthrough.is_error
        assert passthrough.content[0].text == "42"  # type: ignore[union-attr]

        wrapped = await client.call_tool("sum", {"values": [1, 2, 3.5]})
        assert wrapped.structured_content == {"result": 6.5}
        assert wrapped.content[0].text == "6.5"  # type: ignore[union-attr]

        tool_failed = await client.call_tool("tools_fail", {"message": "nope"})
        assert tool_failed.is_error and "nope" in tool_failed.content[0].text  # type: ignore[union-attr]

        gateway_error = await client.call_tool("sum", {"values": "x"})
        assert gateway_error.is_error and gateway_error.meta is not None
        assert gateway_error.meta[ERROR_META_KEY]["code"] == -32602

        with pytest.raises(MCPError) as unknown:
            await client.call_tool("no_such_tool", {})
        assert unknown.value.code == types.INVALID_PARAMS and "no_such_tool" in unknown.value.message


@pytest.mark.parametrize("mode", MODES)
async def test_progress_is_passed_through(gateway: tuple[Gateway, str], mode: str) -> None:
    _, url = gateway
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message))

    async with mcp_http_client(url, mode) as client:
        result = await client.call_tool("tools_sleep", {"seconds": 0.02, "steps": 3},
                                        progress_callback=progress)
    assert result.structured_content == {"result": "slept"}
    assert seen == [(1, 3, "step 1 of 3"), (2, 3, "step 2 of 3"), (3, 3, "step 3 of 3")]


@pytest.mark.parametrize("mode", MODES)
async def test_client_cancel_reaches_the_upstream(gateway: tuple[Gateway, str], mode: str) -> None:
    gw, url = gateway
    before = structured(await call(gw, "tools_stats", {}))["cancelled"]
    async with mcp_http_client(url, mode) as client, anyio.create_task_group() as tg:
        tg.start_soon(client.call_tool, "tools_sleep", {"seconds": 30})

        async def running() -> bool:
            return structured(await call(gw, "tools_stats", {}))["running"] == 1

        await wait_until(running)  # the upstream runs it: the client's cancel has to travel there
        tg.cancel_scope.cancel()

    async def upstream_cancelled() -> bool:
        stats = structured(await call(gw, "tools_stats", {}))
        return stats["cancelled"] == before + 1 and stats["running"] == 0

    await wait_until(upstream_cancelled)
    assert all(lane.in_flight == 0 for lane in gw.lanes.values())


@pytest.mark.parametrize("version", ["2026-07-28", "2025-11-25", "2025-06-18"])
async def test_json_rpc_arrays_are_refused(gateway: tuple[Gateway, str], version: str) -> None:
    _, url = gateway
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
             {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}]
    async with httpx.AsyncClient() as http:
        r = await http.post(url, json=batch, headers={
            "MCP-Protocol-Version": version, "Accept": "application/json, text/event-stream"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == -32600 and r.json()["id"] is None


async def test_2025_03_26_sessions_may_send_batches(gateway: tuple[Gateway, str]) -> None:
    """The one revision with batches: elements are served one by one, replies come back as an array."""
    _, url = gateway
    accept = {"Accept": "application/json, text/event-stream"}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    async with httpx.AsyncClient() as http:
        opened = await http.post(url, json=init, headers=accept)
        session = {**accept, "Mcp-Session-Id": opened.headers["mcp-session-id"]}
        await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                        headers=session)
        r = await http.post(url, headers=session, json=[
            {"jsonrpc": "2.0", "id": "s", "method": "tools/call",
             "params": {"name": "sum", "arguments": {"values": [1, 2]}}},
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "zz"}},
            {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
             "params": {"name": "tools_add", "arguments": {"a": 1, "b": 1}}},
            {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": "nope"}},
            5,
        ])
    assert r.status_code == 200
    replies = r.json()
    assert [x["id"] for x in replies] == ["s", 7, 8, None]
    assert replies[0]["result"]["structuredContent"] == {"result": 3}
    assert replies[1]["result"]["structuredContent"] == {"result": 2}
    assert replies[2]["error"]["code"] == -32602 and replies[3]["error"]["code"] == -32600


async def test_foreign_origins_are_refused(gateway: tuple[Gateway, str]) -> None:
    _, url = gateway
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient() as http:
        evil = await http.post(url, json=init, headers={**headers, "Origin": "http://evil.example"})
        local = await http.post(url, json=init, headers={**headers, "Origin": "http://localhost:5173"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == -32600
    assert local.status_code == 200


async def test_bearer_keys_identify_the_caller() -> None:
    config = {
        "server": {"host": "127.0.0.1", "port": 0, "api_keys": {"alice": "key-a", "bob": "key-b"}},
        "providers": {"builtin": {"kind": "echo"}},
        "routes": {"echo": {"provider": "builtin"}},
    }
    async with running(parse_config(config)) as (gw, base):
        async def whoami(c: Call) -> Any:
            return {"identity": c.identity}

        gw.register_method(ToolSpec("whoami", "Who is calling"), whoami)
        url = base + "/mcp"
        async with httpx.AsyncClient() as http:
            r = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                headers={"Accept": "application/json, text/event-stream"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == -32005
        for mode in MODES:
            async with mcp_http_client(url, mode, key="key-b") as client:
                result = await client.call_tool("whoami", {})
                assert result.structured_content == {"identity": "bob"}
        # A handshake-era session belongs to the key that opened it.
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        accept = {"Accept": "application/json, text/event-stream"}
        async with httpx.AsyncClient() as http:
            opened = await http.post(url, json=init, headers={**accept, "Authorization": "Bearer key-a"})
            session = opened.headers["mcp-session-id"]
            hijack = await http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                     headers={**accept, "Authorization": "Bearer key-b",
                                              "Mcp-Session-Id": session,
                                              "MCP-Protocol-Version": "2025-11-25"})
        assert opened.status_code == 200 and hijack.status_code == 404


async def test_open_sessions_are_capped_per_key() -> None:
    config = {
        "server": {"host": "127.0.0.1", "port": 0, "api_keys": {"alice": "key-a", "bob": "key-b"},
                   "mcp": {"max_sessions_per_key": 2}},
        "providers": {"builtin": {"kind": "echo"}},
        "routes": {"echo": {"provider": "builtin"}},
    }
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}

    def as_(key: str) -> dict[str, str]:
        return {**accept, "Authorization": f"Bearer {key}"}

    async with running(parse_config(config)) as (gw, base), httpx.AsyncClient() as http:
        url = base + "/mcp"

        async def sessions() -> float:
            return gw.metrics.registry.get_sample_value("multiplexer_mcp_sessions") or 0.0

        async def one_ended() -> bool:  # the session ends just after the DELETE's reply
            return await sessions() == 2

        burst: list[httpx.Response] = []

        async def open_one() -> None:
            burst.append(await http.post(url, json=init, headers=as_("key-a")))

        async with anyio.create_task_group() as tg:  # sessions being opened count toward the cap
            for _ in range(6):
                tg.start_soon(open_one)
        assert sorted(r.status_code for r in burst) == [200, 200, 429, 429, 429, 429]
        opened = [r for r in burst if r.status_code == 200]
        refused = await http.post(url, json=init, headers=as_("key-a"))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == -32003
        assert refused.json()["error"]["data"] == {"limit": "mcp_sessions", "max": 2, "open": 2}
        assert (await http.post(url, json=init, headers=as_("key-b"))).status_code == 200  # bob's own
        in_session = {**as_("key-a"), "Mcp-Session-Id": opened[0].headers["mcp-session-id"],
                      "MCP-Protocol-Version": "2025-11-25"}
        listed = await http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                                 headers=in_session)
        assert listed.status_code == 200  # open sessions still work at the cap
        assert await sessions() == 3
        assert (await http.delete(url, headers=in_session)).status_code == 200
        await wait_until(one_ended)
        again = await http.post(url, json=init, headers=as_("key-a"))
    assert again.status_code == 200  # a closed session frees its place


@pytest.mark.parametrize("mode", MODES)
async def test_upstream_list_changes_reach_connected_clients(mode: str) -> None:
    changed = anyio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with (
        running(parse_config(gateway_config())) as (_, base),
        mcp_http_client(base + "/mcp", mode, message_handler=on_message) as client,
    ):
        assert "tools_shout" not in {t.name for t in (await client.list_tools()).tools}
        if client.protocol_version != "2026-07-28":
            assert client.server_capabilities.tools is not None
            assert client.server_capabilities.tools.list_changed
        await grow_and_hear_it(client, changed)
        tools = {t.name for t in (await client.list_tools(cache_mode="bypass")).tools}
        assert "tools_shout" in tools
        shout = await client.call_tool("tools_shout", {"text": "hi"})
        assert shout.structured_content == {"result": "HI"}


async def test_sigterm_on_serve_reaps_the_upstream_children(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({**gateway_config(port=port),
                                      "store": {"path": str(tmp_path / "store.db")}}))
    proc = subprocess.Popen([sys.executable, "-m", "multiplexer", "serve", "--config", str(config)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient() as http:
            async def healthy() -> bool:
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(healthy, timeout=60, poll=0.05)
        children = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(children) == 1
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(proc.wait, 30) == 0
        assert not (children & live_children())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
