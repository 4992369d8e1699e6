"""Admin writes racing each other on a running gateway, on SQLite and on PostgreSQL: a revocation
is never undone by a PATCH that read the key before it, and the revoked key is refused once the
revocation has answered (through the admin operations, 100 rounds, and through the HTTP API);
PATCHes that race on different fields of one key, team or virtual MCP server all land (each
writes only the fields it names)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.access.admin import ENV
from multiplexer.access.admin_ops import Conflict, KeyAdmin
from multiplexer.access.api import KeyIn, KeyPatch
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fuzz_budget import examples

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "z" * 28
A = {"authorization": f"Bearer {ADMIN}"}
ROUNDS = examples(100)  # 98-99 of 100 rounds undid the revocation before the fix
HTTP_ROUNDS = 10
PATCHES = 50


@contextlib.contextmanager
def store_of(kind: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    if kind == "sqlite":
        yield {"path": str(tmp_path / "jobs.db")}
        return
    from tests.pg_helpers import throwaway_schema

    with throwaway_schema() as (url, schema, _):
        yield {"path": str(tmp_path / "jobs.db"), "url": url, "schema": schema}


@pytest.fixture(params=["sqlite", "postgres"])
async def gw(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: Any) -> AsyncIterator[tuple[Any, str]]:
    monkeypatch.delenv(ENV, raising=False)
    with store_of(request.param, tmp_path) as store:
        config = parse_config({
            "server": {"admin_key": ADMIN},
            "store": store,
            "providers": {"e": {"kind": "echo"}},
            "routes": {"echo": {"provider": "e"}},
        })
        async with running(config, port=0) as (gateway, url):
            yield gateway, url


async def rpc_status(http: httpx.AsyncClient, key: str) -> int:
    r = await http.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "echo", "params": {}},
                        headers={"authorization": f"Bearer {key}"})
    return r.status_code


async def race(patch: Callable[[int], Coroutine[Any, Any, None]],
               revoke: Callable[[], Coroutine[Any, Any, None]], revoke_at: int) -> None:
    """``PATCHES`` patches and one revocation, all started at once (the revocation ``revoke_at``-th)."""
    async with anyio.create_task_group() as tg:
        for i in range(PATCHES + 1):
            if i == revoke_at:
                tg.start_soon(revoke)
            else:
                tg.start_soon(patch, i)


async def test_a_revocation_is_never_undone_by_patches_racing_it(gw: tuple[Any, str]) -> None:
    """Each round: a new key, then 50 PATCHes and one revocation started at once through the admin
    operations, each store write in its own worker thread. The revocation answers with
    ``revoked_at`` set; each PATCH lands before it or is refused as a conflict; the key stays
    revoked and the gateway refuses it with 401."""
    gateway, url = gw
    ops: KeyAdmin = gateway.keys.admin
    rng = random.Random(7)
    undone: list[int] = []
    outcomes = {"patched": 0, "conflict": 0}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for n in range(ROUNDS):
            made = await ops.create_key(KeyIn(name=f"race{n}"), "test")
            revoked: list[Any] = []

            async def patch(i: int, key_id: str = made.id) -> None:
                try:
                    await ops.update_key(key_id, KeyPatch(rpm=i + 1, metadata={"i": i}), "test")
                    outcomes["patched"] += 1
                except Conflict:
                    outcomes["conflict"] += 1

            async def revoke(key_id: str = made.id, revoked: list[Any] = revoked) -> None:
                revoked.append(await ops.revoke_key(key_id, "test"))

            await race(patch, revoke, rng.randrange(PATCHES + 1))
            assert revoked[0].revoked_at is not None
            if (await ops.key(made.id)).revoked_at is None or await rpc_status(http, made.key) != 401:
                undone.append(n)
    assert not undone, f"revocation undone in {len(undone)} of {ROUNDS} rounds: {undone[:10]}"
    assert outcomes["conflict"] > 0 and outcomes["patched"] > 0, outcomes  # the race happened


async def test_over_http_a_patch_after_the_revocation_is_a_409(gw: tuple[Any, str]) -> None:
    """The same race through the admin HTTP API: the DELETE answers 200, each PATCH 200 or 409
    in the admin error shape, and the key is refused with 401 afterwards."""
    _, url = gw
    rng = random.Random(11)
    statuses: dict[int, int] = {}
    limits = httpx.Limits(max_connections=PATCHES + 1, max_keepalive_connections=PATCHES + 1)
    async with httpx.AsyncClient(base_url=url, headers=A, limits=limits, timeout=30) as http:
        for n in range(HTTP_ROUNDS):
            made = (await http.post("/admin/keys", json={"name": f"race{n}"})).json()
            path = f"/admin/keys/{made['id']}"
            deleted: list[httpx.Response] = []

            async def patch(i: int, path: str = path, key_id: str = made["id"]) -> None:
                r = await http.patch(path, json={"rpm": i + 1})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 409:
                    assert r.json() == {"error": {"message": f"key {key_id} is revoked",
                                                  "type": "conflict", "code": 409}}

            async def revoke(path: str = path, deleted: list[httpx.Response] = deleted) -> None:
                deleted.append(await http.delete(path))

            await race(patch, revoke, rng.randrange(PATCHES + 1))
            assert deleted[0].status_code == 200 and deleted[0].json()["revoked_at"] is not None
            assert (await http.get(path)).json()["revoked_at"] is not None, n
            assert await rpc_status(http, made["key"]) == 401, n
            rotated = await http.post(path + "/rotate", json={})
            assert rotated.status_code == 409 and rotated.json()["error"]["type"] == "conflict"
    assert set(statuses) == {200, 409}, statuses


async def test_patches_of_different_fields_all_land(gw: tuple[Any, str]) -> None:
    """Concurrent PATCHes, each naming one field of the same key, team and MCP server: every
    field ends as its PATCH set it (none is overwritten by a write of the whole settings)."""
    fields = {"rpm": 5.0, "tpm": 1000.0, "concurrency": 3, "models": ["m*"], "routes": ["echo"],
              "tools": ["t*"], "metadata": {"owner": "ana"}, "budget_usd": {"daily": "2.5"}}
    _, url = gw
    async with httpx.AsyncClient(base_url=url, headers=A, timeout=30) as http:
        for n in range(10):
            key = (await http.post("/admin/keys", json={"name": "k", "rpm": 1, "models": ["x"]})).json()
            assert (await http.post("/admin/teams", json={"name": f"t{n}"})).status_code == 201
            made = await http.post("/admin/mcp-servers", json={"name": f"s{n}", "tools": ["a"]})
            assert made.status_code == 201, made.text
            server_fields = {"tools": ["b*"], "keys": ["k"], "teams": [f"t{n}"]}
            answers: list[int] = []

            async def patch(path: str, body: dict[str, Any], answers: list[int] = answers) -> None:
                answers.append((await http.patch(path, json=body)).status_code)

            async with anyio.create_task_group() as tg:
                for field, value in fields.items():
                    tg.start_soon(patch, f"/admin/keys/{key['id']}", {field: value})
                    tg.start_soon(patch, f"/admin/teams/t{n}", {field: value})
                for field, value in server_fields.items():
                    tg.start_soon(patch, f"/admin/mcp-servers/s{n}", {field: value})
            assert set(answers) == {200}, answers
            got_key = (await http.get(f"/admin/keys/{key['id']}")).json()
            got_team = next(t for t in (await http.get("/admin/teams")).json()["data"] if t["id"] == f"t{n}")
            got_server = next(s for s in (await http.get("/admin/mcp-servers")).json()["data"]
                              if s["id"] == f"s{n}")
            for field, value in fields.items():
                for what, got in (("key", got_key), ("team", got_team)):
                    shown = got[field]
                    if field == "budget_usd":  # shown with its unset caps
                        shown = {k: v for k, v in shown.items() if v is not None}
                    assert shown == value, (n, what, field, got)
            for field, value in server_fields.items():
                assert got_server[field] == value, (n, "server", field, got_server)
