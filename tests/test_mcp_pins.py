"""Tool pinning: an SDK-built upstream that changes a tool's description at run time gets that
tool quarantined (hidden, every way in refused) until an admin approves the new definition."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer import Client as SdkClient
from multiplexer.access.admin import ENV
from multiplexer.cli import main
from multiplexer.core.errors import Code
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.jobs.tool_tables import ToolTables
from multiplexer.server import running
from tests.mcp_helpers import McpHttp, call, mcp_http_client, wait_until
from tests.pin_helpers import ADMIN, HONEST, KEYS, RUG, config_data, upstream_url

pytestmark = pytest.mark.anyio


async def tools_of(gw: Gateway) -> set[str]:
    return {t.name for t in await gw.list_tools()}


async def change_and_wait(gw: Gateway, tool: str, action: str) -> None:
    seen = anyio.Event()

    def listener(event: str, data: dict[str, Any]) -> None:
        if event == "tool_pin" and data["tool"] == "lookup" and data["action"] == action:
            seen.set()

    gw.listeners.append(listener)
    try:
        outcome = await call(gw, tool, {})
        assert outcome.ok, outcome.error
        with anyio.fail_after(10):  # list_changed triggers the check at once: no ttl, no poll
            await seen.wait()
    finally:
        gw.listeners.remove(listener)


async def test_a_changed_tool_is_quarantined_on_every_way_in_until_approved(tmp_path: Path) -> None:
    async with upstream_url() as url, running(parse_config(config_data(url, tmp_path))) as (gw, base):
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(timeout=30) as http:
            listed = (await http.get(base + "/admin/mcp/tools", headers=admin)).json()
            assert {t["id"]: t["status"] for t in listed["tools"]} == {
                "rug:lookup": "approved", "rug:rug": "approved", "rug:unrug": "approved",
                "rug:hold": "approved"}

            await change_and_wait(gw, "rug_rug", "changed")
            assert "rug_lookup" not in await tools_of(gw)

            # every way in: /mcp (SDK client, both eras), plain 2026 HTTP with tasks opted in, /rpc, SDK
            for mode in ("auto", "legacy"):
                async with mcp_http_client(base + "/mcp", mode, KEYS["alice"]) as client:
                    listed_names = {t.name for t in (await client.list_tools()).tools}
                    assert "rug_rug" in listed_names
                    assert not {"rug_lookup", "word"} & listed_names
                    result = await client.call_tool("rug_lookup", {"word": "x"})
                    assert result.is_error
                    assert result.meta["multiplexer/error"]["code"] == Code.TOOL_QUARANTINED
                    assert "description changed" in result.content[0].text  # type: ignore[union-attr]
            plain = McpHttp(http, base + "/mcp", KEYS["alice"], tasks=True)
            answer = await plain.call("rug_lookup", {"word": "x"})
            assert answer["result"]["isError"] is True
            assert answer["result"]["_meta"]["multiplexer/error"]["code"] == Code.TOOL_QUARANTINED
            for method in ("rug_lookup", "word"):  # the wildcard's tool and an exact route to it
                body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {"word": "x"}}
                r = await http.post(base + "/rpc", json=body,
                                    headers={"Authorization": f"Bearer {KEYS['alice']}"})
                assert r.json()["error"]["code"] == Code.TOOL_QUARANTINED, r.text
            async with SdkClient(base, api_key=KEYS["alice"]) as sdk:
                with pytest.raises(Exception) as refused:
                    await sdk.call("rug_lookup", {"word": "x"})
                assert getattr(refused.value, "code", None) == Code.TOOL_QUARANTINED

            panel = (await http.get(base + "/ui/api/state", headers=admin)).json()["panels"]["mcp"]
            (upstream,) = panel["upstreams"]
            assert upstream["quarantined"] == [{"id": "rug:lookup", "tool": "lookup", "diff": {
                "description": {"approved": HONEST, "now": RUG}}}]
            listed = (await http.get(base + "/admin/mcp/tools?status=quarantined", headers=admin)).json()
            assert listed["quarantined"] == 1
            (held,) = listed["tools"]
            assert held["id"] == "rug:lookup"
            assert held["diff"] == {"description": {"approved": HONEST, "now": RUG}}
            assert [c["action"] for c in held["changes"]] == ["changed", "pinned"]

            r = await http.post(base + "/admin/mcp/tools/rug:nothing/approve", headers=admin)
            assert r.status_code == 404
            r = await http.post(base + "/admin/mcp/tools/rug:lookup/approve", headers=admin,
                                json={"hash": held["approved_hash"]})  # not what is served now
            assert r.status_code == 409 and r.json()["error"]["detail"] == {"hash": held["hash"]}
            r = await http.post(base + "/admin/mcp/tools/rug:lookup/approve", headers=admin,
                                json={"hash": held["hash"]})
            assert r.status_code == 200 and r.json()["status"] == "approved"
            metrics = (await http.get(base + "/metrics", headers=admin)).text
            for action in ("pinned", "changed", "approved"):
                assert f'multiplexer_mcp_tool_changes_total{{action="{action}",provider="rug"}}' in metrics
            assert "rug_lookup" in await tools_of(gw)
            async with mcp_http_client(base + "/mcp", "auto", KEYS["alice"]) as client:
                tool = next(t for t in (await client.list_tools()).tools if t.name == "rug_lookup")
                assert tool.description == RUG  # what the admin approved
                result = await client.call_tool("rug_lookup", {"word": "x"})
                assert not result.is_error

        tables = ToolTables(tmp_path / "store.db")
        try:
            (pin,) = [p for p in tables.pins("rug") if p.tool == "lookup"]
            assert not pin.quarantined and json.loads(pin.approved_def)["description"] == RUG
            actions = [row[1] for row in tables.changes("rug", "lookup")]
            assert actions == ["approved", "changed", "pinned"]
        finally:
            tables.close()


async def test_pins_survive_a_restart_and_a_tool_changed_back_is_served_again(tmp_path: Path) -> None:
    async with upstream_url() as url:
        cfg = parse_config(config_data(url, tmp_path))
        async with Gateway(cfg) as gw:
            await wait_until(lambda: _has(gw, "rug_lookup"))
            await change_and_wait(gw, "rug_rug", "changed")
            assert gw.providers["rug"].quarantined("lookup")  # type: ignore[attr-defined]
        async with Gateway(parse_config(config_data(url, tmp_path))) as gw:
            # the upstream still serves the changed description: still held after the restart
            assert gw.providers["rug"].quarantined("lookup")  # type: ignore[attr-defined]
            assert "rug_lookup" not in await tools_of(gw)
            await change_and_wait(gw, "rug_unrug", "restored")
            assert "rug_lookup" in await tools_of(gw)


async def test_pin_false_serves_a_change_at_once(tmp_path: Path) -> None:
    async with upstream_url() as url, Gateway(parse_config(config_data(url, tmp_path, pin=False))) as gw:
        changed = anyio.Event()
        gw.listeners.append(lambda event, data: changed.set() if event == "tools_changed" else None)
        assert (await call(gw, "rug_rug", {})).ok
        with anyio.fail_after(10):
            await changed.wait()
        spec = next(t for t in await gw.list_tools() if t.name == "rug_lookup")
        assert spec.description == RUG


async def _has(gw: Gateway, name: str) -> bool:
    return name in await tools_of(gw)


def stored_keys(data: dict[str, Any]) -> dict[str, Any]:
    data["server"]["key_store"] = {"enabled": True}  # the approval in the admin audit log too
    return data


async def test_the_cli_lists_and_approves_a_quarantined_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV, ADMIN)
    async with upstream_url() as url, running(parse_config(stored_keys(config_data(url, tmp_path)))) \
            as (gw, base):
        await change_and_wait(gw, "rug_rug", "changed")
        capsys.readouterr()
        assert await anyio.to_thread.run_sync(main, ["tools", "list", "--quarantined", "--url", base]) == 0
        (held,) = json.loads(capsys.readouterr().out)["tools"]
        assert held["id"] == "rug:lookup" and held["diff"]["description"]["now"] == RUG
        assert await anyio.to_thread.run_sync(main, ["tools", "approve", "rug:lookup", "--url", base]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "approved"
        async with httpx.AsyncClient() as http:
            logged = (await http.get(base + "/admin/audit",
                                     headers={"Authorization": f"Bearer {ADMIN}"})).json()
        (row,) = [r for r in logged["data"] if r["action"] == "mcp_tool.approve"]
        assert row["target"] == "rug:lookup" and row["actor"].startswith("admin:")
        assert await anyio.to_thread.run_sync(main, ["tools", "approve", "rug:gone", "--url", base]) == 1
        assert "404" in capsys.readouterr().err
        audit = ["tools", "audit", "--tool", "rug_rug", "--url", base]
        assert await anyio.to_thread.run_sync(main, audit) == 0
        assert json.loads(capsys.readouterr().out)["records"] == []  # called in-process, not over MCP


async def test_an_approval_on_one_replica_reaches_another_through_the_store(tmp_path: Path) -> None:
    """Two gateways on one store: both hold the changed tool; one approves; the other reads the
    approval from the store (its reload runs every few seconds while it holds a tool: here, once)."""
    async with upstream_url() as url, Gateway(parse_config(config_data(url, tmp_path))) as one, \
            Gateway(parse_config(config_data(url, tmp_path))) as two:
        heard = anyio.Event()
        two.listeners.append(lambda event, data: heard.set()
                             if event == "tool_pin" and data["action"] == "changed" else None)
        await change_and_wait(one, "rug_rug", "changed")
        with anyio.fail_after(10):
            await heard.wait()
        first, second = one.providers["rug"], two.providers["rug"]
        assert first.quarantined("lookup") and second.quarantined("lookup")  # type: ignore[attr-defined]
        assert first.approve_tool("lookup") is not None  # type: ignore[attr-defined]
        await first.pins.flush()  # type: ignore[attr-defined]
        await second.pins.reload()  # type: ignore[attr-defined]
        assert not second.quarantined("lookup")  # type: ignore[attr-defined]
        assert "rug_lookup" in await tools_of(two)
