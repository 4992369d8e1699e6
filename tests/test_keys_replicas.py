"""Keys as data across three replicas sharing PostgreSQL (the store) and Redis (invalidation):
made, rotated and revoked through the admin API and the CLI on one replica, in effect on every
replica within 2 s; no plaintext key in the database or the logs; a replica that cannot reach the
store keeps the keys it loaded and refuses unknown ones."""

from __future__ import annotations

import json
import logging
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.access.admin import ENV
from multiplexer.cli import main
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.redis_helpers import prefix, redis_url

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "r" * 28
A = {"authorization": f"Bearer {ADMIN}"}
WITHIN_S = 2.0


def replica(db: str, schema: str, state_prefix: str | None, n: int) -> Any:
    """A replica of the store's schema; with ``state_prefix`` None, none told of another's writes."""
    return parse_config({
        "server": {"admin_key": ADMIN},
        "store": {"url": f"{db}?application_name=keys{n}", "schema": schema},
        **({} if state_prefix is None else {"state": {"url": redis_url(), "prefix": state_prefix}}),
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}, "other": {"provider": "e"}},
    })


async def call(http: httpx.AsyncClient, url: str, key: str, method: str = "echo") -> dict[str, Any]:
    r = await http.post(url + "/rpc", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": {}},
                        headers={"authorization": f"Bearer {key}"})
    return r.json()  # type: ignore[no-any-return]


async def until_everywhere(http: httpx.AsyncClient, urls: list[str], key: str, accepted: bool,
                           method: str = "echo") -> float:
    """Seconds until every replica accepts (or refuses) ``key``: the figure the issue asks for.
    Measured by asking each replica every 5 ms, failing past ``WITHIN_S``. With ``method``
    "other" (outside the key's team's routes), accepted means refused as ``permission_denied``:
    the replica knows the key and its team."""
    start = time.perf_counter()
    pending = set(urls)
    while pending:
        for url in list(pending):
            got = await call(http, url, key, method)
            ok = "result" in got if method == "echo" else (
                got.get("error", {}).get("data", {}).get("reason") == "permission_denied")
            if ok == accepted:
                pending.discard(url)
        elapsed = time.perf_counter() - start
        assert elapsed < WITHIN_S, f"{sorted(pending)} still {'refuse' if accepted else 'accept'}"
        if pending:
            await anyio.sleep(0.005)
    return time.perf_counter() - start


async def cli(capsys: Any, *argv: str) -> dict[str, Any]:
    """``multiplexer ...`` in a worker thread (it blocks; the replicas run on this loop)."""
    code = await anyio.to_thread.run_sync(main, list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)  # type: ignore[no-any-return]


async def test_three_replicas_see_a_revocation_within_two_seconds(monkeypatch: Any, capsys: Any,
                                                                   caplog: Any) -> None:
    from tests.pg_helpers import throwaway_schema

    monkeypatch.setenv(ENV, ADMIN)
    caplog.set_level(logging.DEBUG)
    with throwaway_schema() as (db, schema, admin):
        pre = prefix()
        async with AsyncExitStack() as stack, httpx.AsyncClient() as http:
            gws, urls = [], []
            for n in range(3):
                gw, url = await stack.enter_async_context(running(replica(db, schema, pre, n), port=0))
                gws.append(gw)
                urls.append(url)
            teams = await cli(capsys, "teams", "create", "ops", "--routes", "echo*", "--url", urls[0])
            assert teams["routes"] == ["echo*"]
            made = await cli(capsys, "keys", "create", "--name", "ci", "--team", "ops", "--url", urls[0])
            key, kid = made["key"], made["id"]
            # the key counts as seen once its team's routes narrow it there (accepted alone
            # says the replica found it in the store, not that it loaded its team)
            created_s = await until_everywhere(http, urls, key, accepted=True, method="other")
            for url in urls:
                assert "result" in await call(http, url, key)  # and within them it is served

            r = await http.post(f"{urls[1]}/admin/keys/{kid}/rotate", json={"grace_s": 600}, headers=A)
            new = r.json()["key"]
            await until_everywhere(http, urls, new, accepted=True)
            for url in urls:  # the old key in its grace period
                assert "result" in await call(http, url, key)

            shown = await cli(capsys, "keys", "show", kid, "--url", urls[2])
            assert shown["prefix"] == new[:10] and "key" not in shown
            listed = await cli(capsys, "keys", "list", "--url", urls[2])
            assert [k["id"] for k in listed["data"]] == [kid]

            start = time.perf_counter()
            revoked = await cli(capsys, "keys", "revoke", kid, "--url", urls[2])
            assert revoked["revoked_at"] is not None
            revoke_s = await until_everywhere(http, urls, new, accepted=False)
            total_s = time.perf_counter() - start
            await until_everywhere(http, urls, key, accepted=False)
            print(f"\nnew key accepted on all 3 replicas {created_s * 1000:.1f} ms after its creation; "
                  f"revocation refused on all 3 {revoke_s * 1000:.1f} ms after the CLI returned "
                  f"({total_s * 1000:.1f} ms from the command's start)")

            audit = (await http.get(f"{urls[0]}/admin/audit", headers=A)).json()["data"]
            assert [e["action"] for e in audit][:3] == ["keys.revoke", "keys.rotate", "keys.create"]
            assert audit[0]["actor"].startswith("admin:")

            dump = []
            for table in ("access_keys", "access_teams", "access_audit"):
                rows = admin.execute(f"SELECT * FROM {schema}.{table}").fetchall()
                dump.append(repr(rows))
            assert not [s for s in (key, new, ADMIN) if s in "".join(dump)]
            assert not [s for s in (key, new, ADMIN) if s in caplog.text]
            for gw in gws:
                assert gw.keys.entry(kid) is None


async def test_a_replica_without_its_store_keeps_loaded_keys_and_refuses_unknown_ones(
        monkeypatch: Any) -> None:
    from tests.pg_helpers import throwaway_schema

    monkeypatch.delenv(ENV, raising=False)
    with throwaway_schema() as (db, schema, _):
        async with (running(replica(db, schema, prefix(), 0), port=0) as (gw, url),
                    httpx.AsyncClient() as http):
            key = (await http.post(url + "/admin/keys", json={"name": "x"}, headers=A)).json()["key"]
            store = gw.keys.store

            async def down(*args: Any) -> Any:
                raise OSError("connection refused")

            monkeypatch.setattr(store, "run", down)  # every store round trip fails from here
            with pytest.raises(OSError):
                await gw.keys.load()  # what the reload loop meets: the last snapshot stays
            assert "result" in await call(http, url, key)
            assert (await call(http, url, "mx-never-made"))["error"]["data"]["detail"] == "unknown key"
            r = await http.post(url + "/admin/keys", json={"name": "y"}, headers=A)
            assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
            later = time.time() + gw.keys.settings.stale_s + 1
            monkeypatch.setattr(gw.keys, "wall", lambda: later)
            error = (await call(http, url, key))["error"]
            assert error["data"]["detail"] == "the key store is unreachable"


async def test_a_replica_that_was_never_told_still_needs_the_stores_keys(monkeypatch: Any) -> None:
    """Two replicas on one PostgreSQL store and no state.url: nothing tells the second of the
    first's writes before its reload (key_store.ttl_s), yet the store's first key ends keyless
    service there at once, and a key made later is served there on its first call (asked of the
    store, then loaded)."""
    from tests.pg_helpers import throwaway_schema

    monkeypatch.delenv(ENV, raising=False)
    keyless = {"jsonrpc": "2.0", "id": 1, "method": "echo", "params": {}}
    with throwaway_schema() as (db, schema, _):
        async with (running(replica(db, schema, None, 0), port=0) as (_, one),
                    running(replica(db, schema, None, 1), port=0) as (gw, two),
                    httpx.AsyncClient() as http):
            assert "result" in (await http.post(two + "/rpc", json=keyless)).json()
            first = (await http.post(one + "/admin/keys", json={"name": "a"}, headers=A)).json()["key"]
            version = gw.keys.version
            refused = (await http.post(two + "/rpc", json=keyless)).json()["error"]
            assert refused["data"]["detail"] == "missing bearer key"
            assert gw.keys.version == version + 1  # loaded once, by the keyless caller's check
            assert "result" in await call(http, two, first)
            second = (await http.post(one + "/admin/keys", json={"name": "b"}, headers=A)).json()["key"]
            assert "result" in await call(http, two, second)
            assert gw.keys.version == version + 2  # its first call asked the store, then loaded
            assert (await call(http, two, "mx-never-made"))["error"]["data"]["detail"] == "unknown key"
