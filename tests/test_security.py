"""Client keys, identities, quotas, bind refusal, disconnect cancels, SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

from examples.jsonrpc_upstream import UpstreamState
from multiplexer import Client, RpcError
from multiplexer.access.admin import ENV
from multiplexer.gateway.config import ConfigError, parse_config
from multiplexer.server import check_bind, running
from tests.jsonrpc_helpers import gateway_with_upstream, post

pytestmark = pytest.mark.anyio
KEYS = {"api_keys": {"alice": "key-alice-123", "bob": "key-bob-456"},
        "quotas": {"bob": {"rpm": 3}}}
CALL = {"jsonrpc": "2.0", "method": "subtract", "params": [3, 1], "id": 1}


async def test_missing_wrong_and_malformed_keys_get_401_and_healthz_stays_open() -> None:
    async with gateway_with_upstream(server=KEYS) as (url, _, _):
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "key-alice-123"},
                        {"authorization": "Basic a2V5LWFsaWNlLTEyMw=="},
                        {"authorization": "Bearer"}):
            r = await post(url, CALL, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == -32005 and r.json()["id"] is None
            assert "key-alice-123" not in r.text
        r = await post(url, CALL, headers={"authorization": "Bearer key-alice-123"})
        assert r.status_code == 200 and r.json()["result"] == 2
        async with httpx.AsyncClient() as http:
            health = await http.get(f"{url}/healthz")
            metrics = await http.get(f"{url}/metrics")
        assert health.status_code == 200
        for text in (health.text, metrics.text):
            assert "key-alice" not in text and "key-bob" not in text


async def test_quota_per_key_is_enforced_with_retry_after() -> None:
    async with gateway_with_upstream(server=KEYS) as (url, _, _), \
            Client(url, api_key="key-bob-456") as bob, Client(url, api_key="key-alice-123") as alice:
            results = [await bob.call("subtract", [i, 0]) for i in range(3)]
            assert results == [0, 1, 2]
            with pytest.raises(RpcError) as err:
                await bob.call("subtract", [1, 0])
            assert err.value.code == -32003 and err.value.data["limit"] == "rpm"
            assert err.value.data["retry_after"] > 0
            assert await alice.call("subtract", [1, 0]) == 1  # alice has no quota


async def test_private_cached_results_never_cross_identities() -> None:
    routes = {"data": {"provider": "calc", "method": "echo", "dedup": True, "cache_ttl_s": 60}}
    async with gateway_with_upstream(server=KEYS, routes=routes) as (url, state, _), \
            Client(url, api_key="key-alice-123") as alice, Client(url, api_key="key-bob-456") as bob:
            assert await alice.call("data", {"q": 1}) == {"q": 1}
            assert await alice.call("data", {"q": 1}) == {"q": 1}
            assert state.executions["echo"] == 1  # alice's second call came from her cache
            assert await bob.call("data", {"q": 1}) == {"q": 1}
            assert state.executions["echo"] == 2  # bob never gets alice's entry


def test_refuses_public_bind_without_keys() -> None:
    keyless = parse_config({})
    for host in ("0.0.0.0", "::", "192.0.2.7", "example.org"):
        with pytest.raises(ConfigError, match="refusing to serve"):
            check_bind(keyless, host)
    check_bind(parse_config({"server": {"api_keys": {"a": "k"}}}), "0.0.0.0")
    check_bind(parse_config({"server": {"allow_public_without_keys": True}}), "0.0.0.0")
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(keyless, host)


async def test_every_way_of_choosing_the_address_is_checked() -> None:
    """The host override (``--host``) goes through the same check as ``server.host``: it was
    the config's host that was checked while the socket bound the override."""
    with pytest.raises(ConfigError, match=r"'0\.0\.0\.0'"):
        async with running(parse_config({"server": {"port": 0}}), host="0.0.0.0"):
            pass
    with pytest.raises(ConfigError, match=r"'0\.0\.0\.0'"):
        async with running(parse_config({"server": {"host": "0.0.0.0", "port": 0}})):
            pass
    proc = await anyio.run_process([sys.executable, "-m", "multiplexer", "serve", "--host", "0.0.0.0",
                                    "--port", "0"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip().splitlines() == [
        "refusing to serve on non-loopback address '0.0.0.0' without server.api_keys "
        "(set server.allow_public_without_keys: true to override)"]


async def test_oversized_body_gets_413_with_a_json_rpc_error() -> None:
    async with gateway_with_upstream(server={"max_body_bytes": 2048}) as (url, _, _):
        r = await post(url, b"[" + b" " * 4096 + b"]")
        assert r.status_code == 413 and r.json()["error"]["code"] == -32006
        assert r.json()["error"]["data"]["max_body_bytes"] == 2048
        assert (await post(url, CALL)).json()["result"] == 2


async def test_oversized_headers_get_431_on_every_endpoint() -> None:
    async with gateway_with_upstream(server={"max_header_bytes": 2048}) as (url, _, _):
        big = {"x-filler": "a" * 4096}
        r = await post(url, CALL, headers=big)
        assert r.status_code == 431 and r.json()["error"]["code"] == -32006
        assert r.json()["error"]["data"] == {"max_header_bytes": 2048}
        async with httpx.AsyncClient() as http:
            assert (await http.post(f"{url}/mcp", json=CALL, headers=big)).status_code == 431
        assert (await post(url, CALL)).json()["result"] == 2


async def test_client_disconnect_cancels_its_call_upstream() -> None:
    state = UpstreamState(gate=anyio.Event())
    async with gateway_with_upstream(state, provider={"batch": {"max_items": 1}}) \
            as (url, state, gateway):
        lane = gateway.lanes[("calc", None)]
        async with anyio.create_task_group() as tg:
            async def doomed() -> None:
                async with httpx.AsyncClient() as http:
                    await http.post(f"{url}/rpc", json={"jsonrpc": "2.0", "method": "wait",
                                                        "id": 1})

            tg.start_soon(doomed)
            with anyio.fail_after(10):
                while lane.in_flight == 0:
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()  # the client hangs up
        with anyio.fail_after(10):
            while lane.in_flight:
                await anyio.sleep(0.005)
        assert 'outcome="-32004"' in gateway.metrics.render().decode()
        state.gate.set()


def test_sigterm_drains_in_flight_calls_and_exits_zero(tmp_path: Path) -> None:
    from benchmarks._procs import child, free_port

    up, gw = free_port(), free_port()
    conf = tmp_path / "c.yaml"
    conf.write_text(f"""
server: {{port: {gw}, grace_period_s: 10}}
providers: {{calc: {{kind: jsonrpc, url: "http://127.0.0.1:{up}/"}}}}
routes: {{sleep: {{provider: calc}}}}
""")
    root = Path(__file__).parent.parent
    with child(["examples/jsonrpc_upstream.py", "--port", str(up)], f"http://127.0.0.1:{up}/"):
        proc = subprocess.Popen([sys.executable, "-m", "multiplexer", "serve", "--config",
                                 str(conf)], cwd=root, env=os.environ.copy(),
                                stderr=subprocess.PIPE, text=True)
        try:
            from benchmarks._procs import wait_http

            wait_http(f"http://127.0.0.1:{gw}/healthz")
            with httpx.Client(timeout=30) as http:
                import threading

                result: dict = {}

                def slow() -> None:
                    result["r"] = http.post(f"http://127.0.0.1:{gw}/rpc", json={
                        "jsonrpc": "2.0", "method": "sleep", "params": {"ms": 800}, "id": 7})

                t = threading.Thread(target=slow)
                t.start()
                while b"sleep" not in http.get(f"http://127.0.0.1:{gw}/metrics").content and \
                        t.is_alive():
                    pass  # wait until the call is admitted
                proc.send_signal(signal.SIGTERM)
                t.join(30)
            assert result["r"].json() == {"jsonrpc": "2.0", "result": "slept", "id": 7}
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


# -- a public bind needs callers to present a key ------------------------------------------

ADMIN = "adm-public-bind-" + "z" * 20
NO_CALLER_KEY = ("refusing to serve on non-loopback address '0.0.0.0': callers need no key "
                 "(the admin key guards only /admin/ and the dashboard, and the key store holds no live "
                 "key): set server.api_keys, create one with `multiplexer keys create`, or set "
                 "server.allow_public_without_keys: true to override")


def keyed_by_store(tmp_path: Path, **server: object) -> dict:
    return {"server": {"port": 0, **server}, "store": {"path": str(tmp_path / "jobs.db")},
            "providers": {"e": {"kind": "echo"}}, "routes": {"echo": {"provider": "e"}}}


def test_an_admin_key_alone_leaves_callers_keyless_so_a_public_bind_is_refused() -> None:
    with_admin = parse_config({"server": {"admin_key": ADMIN}})
    with pytest.raises(ConfigError) as err:
        check_bind(with_admin, "0.0.0.0", stored_keys=0)
    assert str(err.value) == NO_CALLER_KEY
    check_bind(with_admin, "0.0.0.0", stored_keys=1)
    check_bind(with_admin, "127.0.0.1", stored_keys=0)


def test_oauth_alone_leaves_rpc_and_v1_keyless_so_a_public_bind_is_refused() -> None:
    """``server.oauth`` guards ``/mcp``; ``/rpc`` and ``/v1`` still take keyless calls under it."""
    oauth = {"issuer": "https://issuer.example", "audience": "https://gw.example/mcp",
             "jwks_url": "https://issuer.example/jwks"}
    with pytest.raises(ConfigError) as err:
        check_bind(parse_config({"server": {"oauth": oauth}}), "0.0.0.0")
    assert str(err.value) == (
        "refusing to serve on non-loopback address '0.0.0.0': callers need no key (server.oauth "
        "guards only /mcp): set server.api_keys, or set server.allow_public_without_keys: true "
        "to override")
    check_bind(parse_config({"server": {"oauth": oauth, "api_keys": {"a": "k"}}}), "0.0.0.0")


async def test_the_cli_refuses_a_public_bind_with_only_the_admin_key(tmp_path: Path) -> None:
    conf = tmp_path / "gw.yaml"
    conf.write_text(json.dumps(keyed_by_store(tmp_path)))
    env = {**os.environ, ENV: ADMIN}
    with anyio.fail_after(60):  # a gateway that starts anyway serves until stopped here
        proc = await anyio.run_process([sys.executable, "-m", "multiplexer", "serve", "--config",
                                        str(conf), "--host", "0.0.0.0"], check=False, env=env)
    assert "Traceback" not in proc.stderr.decode()
    assert proc.stderr.decode().splitlines() == [NO_CALLER_KEY]
    assert proc.returncode == 2


async def test_a_stored_key_opens_a_public_bind_and_keyless_calls_stay_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    admin = {"authorization": f"Bearer {ADMIN}"}
    config = keyed_by_store(tmp_path, admin_key=ADMIN)
    with pytest.raises(ConfigError, match="the key store holds no live key"):
        async with running(parse_config(config), host="0.0.0.0"):
            pass
    async with running(parse_config(config)) as (_, url), httpx.AsyncClient(base_url=url) as http:
        made = await http.post("/admin/keys", json={"name": "ci"}, headers=admin)
        assert made.status_code == 201, made.text
    async with running(parse_config(config), host="0.0.0.0") as (_, url), \
            httpx.AsyncClient(base_url=url) as http:
        call = {"jsonrpc": "2.0", "method": "echo", "params": {"a": 1}, "id": 1}
        keyless = await http.post("/rpc", json=call)
        chat = await http.post("/v1/chat/completions", json={"model": "echo", "messages": []})
        keyed = await http.post("/rpc", json=call, headers={"authorization": f"Bearer {made.json()['key']}"})
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == -32005
    assert chat.status_code == 401
    assert keyed.json()["result"] == {"a": 1}


def test_a_revoked_or_expired_key_is_not_a_live_one(tmp_path: Path) -> None:
    from multiplexer.access.keystore import AuditRow, KeyRow, open_store
    from multiplexer.preflight import live_keys

    config = parse_config(keyed_by_store(tmp_path, admin_key=ADMIN))
    store = open_store(config.store.path, None, "multiplexer")
    now = time.time()

    def add(key_id: str, **fields: float) -> None:
        store.add_key(KeyRow(key_id, key_id, "sk-" + key_id, key_id.encode().hex().ljust(64, "0"), None,
                             {}, fields.get("expires_at"), now, now, fields.get("revoked_at")),
                      AuditRow("a-" + key_id, now, "admin", "key.create", key_id, {}))

    try:
        add("gone", revoked_at=now - 10)
        add("old", expires_at=now - 10)
        assert live_keys(config) == 0
        add("live", expires_at=now + 3600)
        assert live_keys(config) == 1
    finally:
        store.close()
