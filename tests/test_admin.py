"""`/admin/`: served only with an admin key, and only to its holder.

The admin endpoints are enumerated from what the running gateway mounts, so an endpoint added
later that forgets the guard fails here."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from multiplexer.access.admin import ENV, AdminKey
from multiplexer.access.secrets import hashed
from multiplexer.core.errors import Code, RpcError
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.test_entry_points import mounted

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "x" * 28
KEY = "caller-key-0123456789"


def config(admin_key: str | None) -> Any:
    # keys in the store are tests/test_keys.py's: here no database is opened
    server: dict[str, Any] = {"api_keys": {"alice": KEY}, "key_store": {"enabled": False}}
    if admin_key is not None:
        server["admin_key"] = admin_key
    return parse_config({"server": server, "providers": {"e": {"kind": "echo"}},
                         "routes": {"echo": {"provider": "e"}}})


def admin_paths(app: Any) -> set[tuple[str, str]]:
    return {(m, p) for m, p in mounted(app) if p.startswith("/admin/")}


def concrete(path: str) -> str:
    return path.replace("{", "").replace("}", "").replace(":path", "")


@pytest.mark.parametrize("written", [ADMIN, hashed(ADMIN)])
async def test_every_admin_endpoint_answers_only_the_admin_key(written: str, monkeypatch: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)
    async with running(config(written), port=0) as (gw, url), httpx.AsyncClient(base_url=url) as http:
        paths = admin_paths(gw.faces["app"])
        assert ("GET", "/admin/whoami") in paths
        for method, path in sorted(paths):
            for headers in ({}, {"authorization": f"Bearer {KEY}"}, {"authorization": "Basic abc"}):
                r = await http.request(method, concrete(path), headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["type"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
        r = await http.get("/admin/whoami", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200 and r.json()["admin"] is True


async def test_without_an_admin_key_nothing_admin_is_served(monkeypatch: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)
    async with running(config(None), port=0) as (gw, url), httpx.AsyncClient(base_url=url) as http:
        for method, path in sorted(admin_paths(gw.faces["app"])):
            r = await http.request(method, concrete(path), headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 404, (method, path)
            assert "server.admin_key" in r.json()["error"]["message"]


async def test_the_environment_key_wins_over_the_config(monkeypatch: Any) -> None:
    monkeypatch.setenv(ENV, "from-env-key-0123456789")
    async with running(config(ADMIN), port=0) as (_, url), httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/admin/whoami", headers={
            "authorization": f"Bearer {ADMIN}"})).status_code == 401
        assert (await http.get("/admin/whoami", headers={
            "authorization": "Bearer from-env-key-0123456789"})).status_code == 200


def test_the_admin_key_is_kept_as_a_digest_only() -> None:
    admin = AdminKey(SecretStr(ADMIN), environ={})
    assert ADMIN not in repr(vars(admin)) and ADMIN.encode() not in repr(vars(admin)).encode()
    assert admin.is_admin(f"Bearer {ADMIN}") and not admin.is_admin(f"Bearer {ADMIN}x")
    with pytest.raises(RpcError) as off:
        AdminKey(None, environ={}).check(f"Bearer {ADMIN}")
    assert off.value.code == Code.NOT_FOUND


def test_a_key_may_be_written_as_its_digest_and_carry_its_team_and_budget() -> None:
    from multiplexer.faces.auth import Authenticator

    data = {"server": {"api_keys": {"alice": hashed(KEY), "bob": {"key": "bob-key-0123456789",
                                                                  "team": "red",
                                                                  "budget_usd": {"daily": "2.5"}}},
                       "teams": {"red": {"models": ["gpt-*"]}}},
            "providers": {"e": {"kind": "echo"}}, "routes": {"echo": {"provider": "e"}}}
    cfg = parse_config(data)
    auth = Authenticator(cfg.server.api_keys)
    assert auth.identify(f"Bearer {KEY}") == "alice"
    assert auth.identify("Bearer bob-key-0123456789") == "bob"
    with pytest.raises(RpcError):
        auth.identify(f"Bearer {hashed(KEY)}")  # the digest itself is not a key
    data["server"]["api_keys"]["bob"]["team"] = "blue"
    with pytest.raises(Exception, match="no team 'blue'"):
        parse_config(data)
