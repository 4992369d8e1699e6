"""A key is shown by its name beside its id wherever spend is read: `GET /admin/spend`'s rows,
`multiplexer spend`'s table, the admin's spend-by-key panel and a caller's own view. A stored
key's name is the one the admin API gave it (a rename shows at once); a config key's name is its
identity; the store is asked for names at most once per load of the key directory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer import cli
from multiplexer.access.admin import ENV
from multiplexer.access.names import KeyNames
from multiplexer.gateway.config import parse_config
from multiplexer.money.report import table
from multiplexer.server import running

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "n" * 28
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
ALICE = "sk-names-alice-0123456789"


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A priced mock route, a config key ``alice``, the key store on; spend written when the test
    says (flush_interval_s: an hour)."""
    config = parse_config({
        "server": {"admin_key": ADMIN, "api_keys": {"alice": ALICE}},
        "store": {"path": str(tmp_path / "jobs.db")}, "spend": {"flush_interval_s": 3600},
        "providers": {"m": {"kind": "mock", "price": {"input_per_mtok": 1000, "output_per_mtok": 2000}}},
        "routes": {"chat": {"provider": "m", "operation": "chat", "models": ["mock-gpt"]}}})
    async with running(config, port=0) as (gw, url), httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield gw, http


async def stored_key(http: httpx.AsyncClient, name: str) -> tuple[str, str]:
    """A key made through the admin API: (its id, its value)."""
    r = await http.post("/admin/keys", json={"name": name}, headers=AS_ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


async def call(http: httpx.AsyncClient, key: str) -> None:
    r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
        "model": "mock-gpt", "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text


async def by_key(http: httpx.AsyncClient, group_by: str = "key") -> list[dict[str, Any]]:
    r = await http.get(f"/admin/spend?group_by={group_by}", headers=AS_ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["rows"]  # type: ignore[no-any-return]


async def test_admin_spend_rows_name_each_key_beside_its_id(tmp_path: Path) -> None:
    async with serving(tmp_path) as (_, http):
        kid, key = await stored_key(http, "ci-bot")
        assert kid.startswith("key_")
        await call(http, key)
        await call(http, ALICE)
        rows = await by_key(http)
        by_route = await by_key(http, "key,route")
        plain = await by_key(http, "route")
        renamed = await http.patch(f"/admin/keys/{kid}", json={"name": "ci-robot"}, headers=AS_ADMIN)
        assert renamed.status_code == 200, renamed.text
        after_rename = await by_key(http)
        assert (await http.delete(f"/admin/keys/{kid}", headers=AS_ADMIN)).status_code == 200
        after_revoke = await by_key(http)
    names = {r["key"]: r["key_name"] for r in rows}
    assert names == {kid: "ci-bot", "alice": "alice"}  # a config key's name is its identity
    assert list(rows[0])[:2] == ["key", "key_name"]  # the name right beside the id
    assert {(r["key"], r["key_name"], r["route"]) for r in by_route} == {
        (kid, "ci-bot", "chat"), ("alice", "alice", "chat")}
    assert all("key_name" not in r for r in plain)  # no key, no name
    assert {r["key"]: r["key_name"] for r in after_rename}[kid] == "ci-robot"  # the name now
    assert {r["key"]: r["key_name"] for r in after_revoke}[kid] == "ci-robot"  # its spend stays named


async def test_the_spend_command_shows_name_and_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    async with serving(tmp_path) as (_, http):
        kid, key = await stored_key(http, "ci-bot")
        await call(http, key)
        await call(http, ALICE)
        monkeypatch.setenv("MULTIPLEXER_MASTER_KEY", ADMIN)
        url = str(http.base_url).rstrip("/")
        status = await anyio.to_thread.run_sync(cli.main, ["spend", "--by", "key,route", "--url", url])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[0].split() == ["key", "route", "calls", "cost_usd", "saved_usd", "unknown_cost_calls",
                                "cache_read_share"]
    lines = {line.split("  ")[0].strip(): line for line in out[1:-1]}
    assert set(lines) == {f"ci-bot ({kid})", "alice"}  # alice: its name is its id, shown once
    assert lines[f"ci-bot ({kid})"].split()[2:4] == ["chat", "1"]
    assert out[-1].split()[0] == "total"


def test_the_table_shows_an_unnamed_or_keyless_row_by_what_it_has() -> None:
    body = {"rows": [{"key": "key_0123", "key_name": None, "calls": 1},
                     {"key": None, "key_name": None, "calls": 2}], "total": {"calls": 3}}
    lines = table(body, ["key"]).splitlines()
    assert [line.split()[:2] for line in lines[1:3]] == [["key_0123", "1"], ["-", "2"]]


async def test_the_dashboard_names_keys_for_the_admin_and_the_key_itself(tmp_path: Path) -> None:
    async with serving(tmp_path) as (gw, http):
        kid, key = await stored_key(http, "ci-bot")
        await call(http, key)
        await call(http, ALICE)
        await gw.money.flush()
        admin = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()
        own = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {key}"})).json()
        alice = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {ALICE}"})).json()
        rows = await by_key(http)
    stored = admin["panels"]["spend"]["stored"]
    assert {k["key"]: k["key_name"] for k in stored["keys"]} == {kid: "ci-bot", "alice": "alice"}
    assert stored["keys"] == rows  # the same rows as GET /admin/spend's
    assert admin["key_name"] is None  # the admin's view is no key's
    assert (own["identity"], own["key_name"]) == (kid, "ci-bot")
    assert (own["panels"]["spend"]["key"], own["panels"]["spend"]["key_name"]) == (kid, "ci-bot")
    assert own["panels"]["spend"]["today"]["calls"] == 1
    assert (alice["key_name"], alice["panels"]["spend"]["key_name"]) == ("alice", "alice")
    assert "ci-bot" not in str(alice)  # a key sees no other key's name


class _Store:
    def __init__(self, rows: list[Any]) -> None:
        self.rows, self.reads = rows, 0

    async def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def keys(self) -> list[Any]:
        self.reads += 1
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows


class _Row:
    def __init__(self, id: str, name: str) -> None:
        self.id, self.name = id, name


class _Directory:
    def __init__(self, store: _Store | None) -> None:
        self.store, self.version = store, 1
        self.static = {"alice": object()}


async def test_names_are_read_once_per_directory_load_and_survive_a_store_failure() -> None:
    store = _Store([_Row("key_1", "ci-bot")])
    directory = _Directory(store)
    names = KeyNames(directory)
    async with anyio.create_task_group() as tg:  # pages asking at once: one read
        for _ in range(5):
            tg.start_soon(names.of, "key_1")
    assert store.reads == 1
    assert await names.of("key_1") == "ci-bot" and await names.of("alice") == "alice"
    assert await names.of("key_gone") is None and await names.of(None) is None
    assert store.reads == 1
    store.rows = [_Row("key_1", "ci-robot")]
    directory.version = 2  # the directory loaded again (a write, its ttl): names are read again
    assert await names.of("key_1") == "ci-robot" and store.reads == 2
    store.rows = OSError("the store went away")  # type: ignore[assignment]
    directory.version = 3
    assert await names.of("key_1") == "ci-robot"  # the last names stay
    assert store.reads == 3 and await names.of("key_1") == "ci-robot" and store.reads == 3
    assert await KeyNames(_Directory(None)).of("alice") == "alice"  # no store: config keys only
