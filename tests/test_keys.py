"""Keys and teams as data on one gateway (SQLite): the admin API's life of a key, team defaults
that keys narrow, and what a key may see and call on every face (/rpc, /v1, /mcp in both protocol
eras, virtual MCP servers). The replicas' side is tests/test_keys_replicas.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import MCPError

from multiplexer.access.admin import ENV
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import mcp_http_client, stdio_upstream

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "k" * 28
A = {"authorization": f"Bearer {ADMIN}"}


def keys_config(store: Path, **extra: Any) -> dict[str, Any]:
    return {
        "server": {"admin_key": ADMIN},
        "store": {"path": str(store)},
        "providers": {"e": {"kind": "echo"}, "mock": {"kind": "mock"}, "tools": stdio_upstream()},
        "routes": {
            "echo": {"provider": "e"}, "other": {"provider": "e"}, "third": {"provider": "e"},
            "chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]},
            "chat2": {"provider": "mock", "operation": "chat", "models": ["mock-gpt-2"]},
            "claude": {"provider": "mock", "operation": "messages", "models": ["mock-claude"]},
            "tools_*": {"provider": "tools"},
        },
        **extra,
    }


@pytest.fixture(scope="module")
async def gw(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, str, Path]]:
    mp = pytest.MonkeyPatch()
    mp.delenv(ENV, raising=False)
    store = tmp_path_factory.mktemp("keys") / "jobs.db"
    config = parse_config(keys_config(store, mcp_servers={
        "mini": {"tools": ["tools_echo", "tools_add"]},
        "reds": {"tools": ["tools_*"], "teams": ["red"]}}))
    try:
        async with running(config, port=0) as (gateway, url):
            yield gateway, url, store
    finally:
        mp.undo()


async def rpc(http: httpx.AsyncClient, key: str, method: str = "echo", **params: Any) -> dict[str, Any]:
    r = await http.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                        headers={"authorization": f"Bearer {key}"})
    return r.json()  # type: ignore[no-any-return]


async def new_key(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await http.post("/admin/keys", json={"name": "test", **body}, headers=A)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


async def team(http: httpx.AsyncClient, name: str, **body: Any) -> None:
    r = await http.post("/admin/teams", json={"name": name, **body}, headers=A)
    assert r.status_code in (201, 409), r.text


async def test_a_key_is_created_used_rotated_with_grace_and_revoked(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        made = await new_key(http, metadata={"owner": "ana"})
        key, kid = made["key"], made["id"]
        assert key.startswith(made["prefix"]) and len(made["prefix"]) == 10
        assert (await rpc(http, key, a=1))["result"] == {"a": 1}
        shown = (await http.get(f"/admin/keys/{kid}", headers=A)).json()
        assert "key" not in shown and shown["metadata"] == {"owner": "ana"}
        assert kid in [k["id"] for k in (await http.get("/admin/keys", headers=A)).json()["data"]]

        rotated = (await http.post(f"/admin/keys/{kid}/rotate", json={"grace_s": 3600}, headers=A)).json()
        assert set(rotated) == {"id", "key", "prefix", "old_key_valid_until"} and rotated["key"] != key
        assert rotated["old_key_valid_until"] is not None
        assert "result" in await rpc(http, key) and "result" in await rpc(http, rotated["key"])
        again = (await http.post(f"/admin/keys/{kid}/rotate", json={"grace_s": 0}, headers=A)).json()
        assert again["old_key_valid_until"] is None
        assert (await rpc(http, rotated["key"]))["error"]["code"] == -32005
        assert (await rpc(http, key))["error"]["code"] == -32005  # the first key's grace went with it
        assert "result" in await rpc(http, again["key"])

        r = await http.delete(f"/admin/keys/{kid}", headers=A)
        assert r.status_code == 200 and r.json()["revoked_at"] is not None
        r0 = r.json()
        assert (await rpc(http, again["key"]))["error"]["data"]["detail"] == "unknown key"
        for r in (await http.patch(f"/admin/keys/{kid}", json={"rpm": 5}, headers=A),
                  await http.post(f"/admin/keys/{kid}/rotate", json={}, headers=A)):
            assert r.status_code == 409, r.text
            assert r.json()["error"] == {"message": f"key {kid} is revoked", "type": "conflict", "code": 409}
        again = await http.delete(f"/admin/keys/{kid}", headers=A)  # answered as it is, nothing written
        assert again.status_code == 200 and again.json()["revoked_at"] == r0["revoked_at"]
        assert (await http.patch("/admin/keys/key_nope", json={"rpm": 5}, headers=A)).status_code == 404
        assert (await http.post("/admin/keys/key_nope/rotate", json={}, headers=A)).status_code == 404
        assert (await http.delete("/admin/keys/key_nope", headers=A)).status_code == 404
        assert (await http.patch("/admin/teams/nope", json={"rpm": 5}, headers=A)).status_code == 404

        actions = [(e["action"], e["target"]) for e in
                   (await http.get("/admin/audit", params={"target": kid}, headers=A)).json()["data"]]
        assert actions == [("keys.revoke", kid), ("keys.rotate", kid), ("keys.rotate", kid),
                           ("keys.create", kid)]


async def test_expiry_and_bad_input_are_answered_precisely(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        made = await new_key(http, expires_at="2001-01-01T00:00:00Z")
        assert (await rpc(http, made["key"]))["error"]["data"]["detail"] == "key expired"
        r = await http.patch(f"/admin/keys/{made['id']}", json={"expires_at": None}, headers=A)
        assert r.status_code == 200 and "result" in await rpc(http, made["key"])
        for body, says in (({"name": "x", "rpm": -1}, "rpm"), ({"name": "x", "colour": 1}, "colour"),
                           ({"name": "x", "team": "nobody"}, "no team 'nobody'")):
            r = await http.post("/admin/keys", json=body, headers=A)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert (await http.get("/admin/keys/key_nope", headers=A)).status_code == 404
        await team(http, "dup")
        assert (await http.post("/admin/teams", json={"name": "dup"}, headers=A)).status_code == 409


async def test_team_defaults_are_narrowed_never_widened(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        await team(http, "narrow", routes=["echo", "other"])
        key = (await new_key(http, team="narrow", routes=["echo", "third"]))["key"]
        assert "result" in await rpc(http, key, method="echo")
        for method in ("other", "third"):  # refused by the key's list, and by the team's
            error = (await rpc(http, key, method=method))["error"]
            assert error["code"] == -32003 and error["data"]["reason"] == "permission_denied"
        r = await http.patch("/admin/teams/narrow", json={"routes": ["echo", "other", "third"]}, headers=A)
        assert r.status_code == 200
        assert "result" in await rpc(http, key, method="third")  # the team widened; the key allows it
        assert "error" in await rpc(http, key, method="other")


async def test_no_plaintext_key_in_the_database_or_the_logs(gw: Any, caplog: Any) -> None:
    _, url, store = gw
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(base_url=url) as http:
        made = await new_key(http)
        rotated = (await http.post(f"/admin/keys/{made['id']}/rotate", json={}, headers=A)).json()
        await rpc(http, made["key"])
        await rpc(http, rotated["key"])
        await http.delete(f"/admin/keys/{made['id']}", headers=A)
    secrets = [made["key"], rotated["key"], ADMIN]
    raw = b"".join(p.read_bytes() for p in store.parent.glob(store.name + "*"))
    assert raw and not [s for s in secrets if s.encode() in raw]
    assert not [s for s in secrets if s in caplog.text]


async def test_v1_models_and_calls_show_only_the_keys_models(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        key = (await new_key(http, models=["mock-gpt", "mock-gpt-*"], routes=["chat*"]))["key"]
        h = {"authorization": f"Bearer {key}"}
        listed = (await http.get("/v1/models", headers=h)).json()["data"]
        assert sorted(m["id"] for m in listed) == ["mock-gpt", "mock-gpt-2"]
        hidden = await http.get("/v1/models/mock-claude", headers=h)
        assert hidden.status_code == 404 and "mock-claude" not in str(hidden.json()["error"].get("known"))
        ask = [{"role": "user", "content": "hi"}]
        r = await http.post("/v1/chat/completions", json={"model": "mock-gpt", "messages": ask}, headers=h)
        assert r.status_code == 200, r.text
        r = await http.post("/v1/messages", json={"model": "mock-claude", "max_tokens": 5, "messages": ask},
                            headers={"x-api-key": key})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        narrow = (await new_key(http, models=["mock-gpt"]))["key"]
        r = await http.post("/v1/chat/completions", json={"model": "mock-gpt-2", "messages": ask},
                            headers={"authorization": f"Bearer {narrow}"})
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["type"] == "permission_denied" and "mock-gpt-2" in error["message"]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_mcp_lists_only_the_keys_tools_and_hides_the_rest(gw: Any, mode: str) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        key = (await new_key(http, tools=["tools_echo", "tools_add", "tools_grow_catalog"]))["key"]
        free = (await new_key(http))["key"]
    async with mcp_http_client(url + "/mcp", mode, key=key) as client:
        names = sorted(t.name for t in (await client.list_tools()).tools)
        assert names == ["tools_add", "tools_echo", "tools_grow_catalog"]
        assert (await client.call_tool("tools_add", {"a": 1, "b": 2})).content[0].text == "3"
        with pytest.raises(MCPError, match="Unknown tool: tools_pid"):
            await client.call_tool("tools_pid", {})
        with pytest.raises(MCPError, match="Unknown tool: echo"):  # an /rpc route, not its tool
            await client.call_tool("echo", {"text": "x"})
    async with mcp_http_client(url + "/mcp", mode, key=free) as client:
        assert "tools_pid" in [t.name for t in (await client.list_tools()).tools]


async def test_resources_and_prompts_follow_the_keys_tools(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        none = (await new_key(http, tools=["echo"]))["key"]
        free = (await new_key(http))["key"]
    async with mcp_http_client(url + "/mcp", key=free) as client:
        await client.call_tool("tools_grow_catalog", {})
        assert "news" in [r.name for r in (await client.list_resources()).resources]
        assert "tools_farewell" in [p.name for p in (await client.list_prompts()).prompts]
    async with mcp_http_client(url + "/mcp", key=none) as client:
        assert (await client.list_resources()).resources == []
        assert (await client.list_prompts()).prompts == []


async def test_a_virtual_server_shows_only_its_tools_to_its_keys(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        await team(http, "red")
        red = (await new_key(http, team="red"))["key"]
        blue = (await new_key(http))["key"]
        r = await http.post("/mcp/reds", json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                            headers={"authorization": f"Bearer {blue}", "accept": "application/json"})
        assert r.status_code == 403 and "may not use this MCP server" in r.text
    for mode in ("auto", "legacy"):
        async with mcp_http_client(url + "/mcp/mini", mode, key=blue) as client:
            assert sorted(t.name for t in (await client.list_tools()).tools) == ["tools_add", "tools_echo"]
            with pytest.raises(MCPError, match="Unknown tool"):
                await client.call_tool("tools_pid", {})
    async with mcp_http_client(url + "/mcp/reds", key=red) as client:
        assert "tools_pid" in [t.name for t in (await client.list_tools()).tools]


async def test_the_admin_api_describes_itself_as_openapi(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        doc = (await http.get("/admin/openapi.json", headers=A)).json()
        assert (await http.get("/admin/openapi.json")).status_code == 401
    assert {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops} == {
        ("POST", "/admin/keys"), ("GET", "/admin/keys"), ("GET", "/admin/keys/{id}"),
        ("PATCH", "/admin/keys/{id}"), ("POST", "/admin/keys/{id}/rotate"), ("DELETE", "/admin/keys/{id}"),
        ("POST", "/admin/teams"), ("GET", "/admin/teams"), ("PATCH", "/admin/teams/{id}"),
        ("POST", "/admin/mcp-servers"), ("GET", "/admin/mcp-servers"), ("PATCH", "/admin/mcp-servers/{id}"),
        ("DELETE", "/admin/mcp-servers/{id}"), ("GET", "/admin/audit")}
    assert "409" in doc["paths"]["/admin/keys/{id}"]["patch"]["responses"]
    assert "409" in doc["paths"]["/admin/keys/{id}/rotate"]["post"]["responses"]
    created = doc["components"]["schemas"]["KeyCreated"]["properties"]
    assert {"id", "key", "prefix", "models", "tools", "budget_usd"} <= set(created)
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(doc)


def test_config_keys_carry_their_teams_rules_limits_and_expiry() -> None:
    from multiplexer.access.compose import directory_for
    from multiplexer.core.errors import RpcError
    from multiplexer.faces.auth import Authenticator

    cfg = parse_config({
        "server": {"teams": {"red": {"routes": ["echo", "other"], "rpm": 60, "concurrency": 4}},
                   "api_keys": {"old": {"key": "old-key-0123456789", "expires_at": "2001-01-01T00:00:00Z"},
                                "bob": {"key": "bob-key-0123456789", "team": "red", "routes": ["echo*"],
                                        "rpm": 600}},
                   "key_store": {"enabled": False}},
        "providers": {"e": {"kind": "echo"}}, "routes": {"echo": {"provider": "e"}}})
    from multiplexer.core.clock import ManualClock
    from multiplexer.core.quota import Quotas

    limits = Quotas(ManualClock(), {})
    quotas = limits.quotas
    directory = directory_for(cfg, limits)
    auth = Authenticator(cfg.server.api_keys, directory)
    assert auth.identify("Bearer bob-key-0123456789") == "bob"
    with pytest.raises(RpcError, match="this key expired at 2001-01-01T00:00:00Z") as expired:
        auth.identify("Bearer old-key-0123456789")
    assert expired.value.data == {"detail": "key expired"}
    rules = directory.rules_of("bob")
    assert rules is not None and rules.refusal("echo", {}, "rpc") is None
    assert rules.refusal("other", {}, "rpc") is not None  # the team allows it, the key does not
    assert rules.refusal("echo2", {}, "rpc") is not None  # the key allows it, the team does not
    assert (quotas["bob"].rpm, quotas["bob"].concurrency) == (60, 4)  # narrowed by the team
    assert directory.rules_of("old") is None and "old" not in quotas


async def test_a_stored_keys_rpm_joins_the_per_key_quotas(gw: Any) -> None:
    gateway, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        made = await new_key(http, rpm=1)
        assert gateway.quotas.limits(made["id"]).rpm == 1
        assert "result" in await rpc(http, made["key"])
        error = (await rpc(http, made["key"]))["error"]
        assert error["code"] == -32003 and error["data"]["limit"] == "rpm"
        await http.patch(f"/admin/keys/{made['id']}", json={"rpm": 600}, headers=A)
        assert gateway.quotas.limits(made["id"]).rpm == 600
        assert "result" in await rpc(http, made["key"])  # a new bucket at the new rate
        await http.patch(f"/admin/keys/{made['id']}", json={"rpm": None}, headers=A)
        assert gateway.quotas.limits(made["id"]) is None


async def test_a_stored_keys_tpm_narrowed_by_its_team_joins_the_per_key_quotas(gw: Any) -> None:
    """A stored team's tpm caps its key's; each echo call is estimated at 1 token and reports no
    usage, so its estimate stands: two of 2, then a -32003 ``limit: tpm``."""
    gateway, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        await team(http, "tpm-team", tpm=2)
        made = await new_key(http, team="tpm-team", tpm=50)
        assert gateway.quotas.limits(made["id"]).tpm == 2
        assert "result" in await rpc(http, made["key"], i=1)
        assert "result" in await rpc(http, made["key"], i=2)
        error = (await rpc(http, made["key"], i=3))["error"]
        assert error["code"] == -32003 and error["data"]["limit"] == "tpm"
        assert error["data"]["retry_after"] > 29  # 1 token at 2 a minute


async def test_a_virtual_server_made_through_the_admin_api(gw: Any) -> None:
    _, url, _ = gw
    async with httpx.AsyncClient(base_url=url) as http:
        await team(http, "green")
        green = (await new_key(http, team="green"))["key"]
        other = (await new_key(http))["key"]
        r = await http.post("/admin/mcp-servers", json={"name": "adders", "tools": ["tools_add"],
                                                        "teams": ["green"]}, headers=A)
        assert r.status_code == 201, r.text
        taken = await http.post("/admin/mcp-servers", json={"name": "mini", "tools": ["x"]}, headers=A)
        assert taken.status_code == 409  # a config server's name
        listed = (await http.get("/admin/mcp-servers", headers=A)).json()["data"]
        assert [s["name"] for s in listed] == ["adders"]
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        r = await http.post("/mcp/adders", json=ping, headers={"authorization": f"Bearer {other}",
                                                               "accept": "application/json"})
        assert r.status_code == 403
        for mode in ("auto", "legacy"):
            async with mcp_http_client(url + "/mcp/adders", mode, key=green) as client:
                assert [t.name for t in (await client.list_tools()).tools] == ["tools_add"]
                with pytest.raises(MCPError, match="Unknown tool"):
                    await client.call_tool("tools_echo", {"text": "x"})
        r = await http.patch("/admin/mcp-servers/adders", json={"tools": ["tools_add", "tools_echo"]},
                             headers=A)
        assert r.status_code == 200 and r.json()["tools"] == ["tools_add", "tools_echo"]
        async with mcp_http_client(url + "/mcp/adders", key=green) as client:
            assert sorted(t.name for t in (await client.list_tools()).tools) == ["tools_add", "tools_echo"]
        assert (await http.delete("/admin/mcp-servers/adders", headers=A)).status_code == 200
        r = await http.post("/mcp/adders", json=ping, headers={"authorization": f"Bearer {green}",
                                                               "accept": "application/json"})
        assert r.status_code == 404 and "no MCP server 'adders'" in r.text
        assert (await http.delete("/admin/mcp-servers/adders", headers=A)).status_code == 404


async def test_callers_need_a_key_once_the_store_has_issued_one(tmp_path: Path, monkeypatch: Any) -> None:
    """An admin key alone (for /admin/ and the dashboard) leaves callers without a key served, as
    without api_keys; the first key the store issues ends that, and a revoked one keeps it ended
    (a gateway started later on the same store too)."""
    monkeypatch.delenv(ENV, raising=False)
    config = parse_config(keys_config(tmp_path / "jobs.db"))
    body = {"jsonrpc": "2.0", "id": 1, "method": "echo", "params": {"a": 1}}
    async with running(config, port=0) as (gateway, url), httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/rpc", json=body)).json()["result"] == {"a": 1}
        made = await new_key(http)
        await gateway.keys.wait_version(gateway.keys.version)
        refused = (await http.post("/rpc", json=body))
        assert refused.status_code == 401, refused.text
        assert (await http.delete(f"/admin/keys/{made['id']}", headers=A)).status_code == 200
    async with running(config, port=0) as (_, url), httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/rpc", json=body)).status_code == 401
