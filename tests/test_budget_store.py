"""Budgets without ``state.url`` hold in the store's database (SQLite at ``store.path`` or
PostgreSQL at ``store.url``): a restart keeps the count, gateways that share the store as workers
decide on one count, and the count equals the spend ``/admin/spend`` reports.

Every call costs exactly its reservation (a mock model priced per call, $0.008), so a $0.03 total
admits exactly four calls ($0.032) and nothing after, whatever the interleaving."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import AsyncExitStack
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running

pytestmark = pytest.mark.anyio
KEY = "sk-budget-store-0123456789"
ADMIN = "adm-budget-" + "s" * 24
PER_CALL = Decimal("0.008")
CAP = Decimal("0.03")
ADMITTED = 4  # 0, .008, .016, .024 are under the cap; .032 is not
NANO = 10**9


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The ``store:`` of a config: a SQLite file, or a schema of the test PostgreSQL database."""
    if request.param == "sqlite":
        yield {"path": str(tmp_path / "jobs.db")}
        return
    from tests.pg_helpers import throwaway_schema

    with throwaway_schema() as (url, schema, _):
        yield {"url": url, "schema": schema}


def config(store: dict[str, Any], workers: int = 1) -> Any:
    return parse_config({
        "server": {"api_keys": {"alice": {"key": KEY, "budget_usd": {"total": str(CAP)}}},
                   "admin_key": ADMIN, "workers": workers},
        "store": store,
        "spend": {"flush_interval_s": 0.05},
        "providers": {"m": {"kind": "mock", "price": {"per_call": str(PER_CALL)}}},
        "routes": {"chat": {"provider": "m", "operation": "chat"}},
    })


def params() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello there"}]}


async def rpc(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "chat", "params": params()},
                          headers={"authorization": f"Bearer {KEY}"})
    return r.json()  # type: ignore[no-any-return]


async def reported(client: httpx.AsyncClient) -> Decimal:
    r = await client.get("/admin/spend", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return Decimal(str(r.json()["total"]["cost_usd"]))


def counted(store: dict[str, Any]) -> dict[str, int]:
    """The budget counters as the store holds them: {counter key: nano-dollars}."""
    if "path" in store:
        with sqlite3.connect(store["path"]) as conn:
            return dict(conn.execute("SELECT key, spent FROM budget_counters").fetchall())
    import psycopg

    with psycopg.connect(store["url"]) as conn:
        return dict(conn.execute(f"SELECT key, spent FROM {store['schema']}.budget_counters").fetchall())


async def test_a_restart_keeps_the_count(store: dict[str, Any]) -> None:
    async with running(config(store), port=0) as (_, url), httpx.AsyncClient(base_url=url) as client:
        replies = [await rpc(client) for _ in range(ADMITTED + 2)]
        assert ["result" in r for r in replies] == [True] * ADMITTED + [False] * 2
        assert replies[-1]["error"]["data"]["limit"] == "budget_usd"
    async with running(config(store), port=0) as (_, url), httpx.AsyncClient(base_url=url) as client:
        again = await rpc(client)
        assert again.get("error", {}).get("code") == -32003, again  # refused: the count survived
        assert Decimal(again["error"]["data"]["spend"]) == ADMITTED * PER_CALL
        # once settled, the count is what the spend report says was spent
        assert await reported(client) == ADMITTED * PER_CALL
    assert counted(store) == {"key:alice:total:all": int(ADMITTED * PER_CALL * NANO)}


async def test_workers_on_one_store_decide_on_one_count(store: dict[str, Any]) -> None:
    """Two gateways as the workers of ``serve --workers 2`` (each its own connection to the
    store), 24 callers at once: the cap admits four calls in all, not four each."""
    outcomes: list[Outcome] = []
    async with AsyncExitStack() as stack:
        gws = [await stack.enter_async_context(Gateway(config(store, workers=2))) for _ in range(2)]

        async def caller(n: int) -> None:
            outcomes.append(await gws[n % 2].submit(Call("chat", params(), identity="alice")))

        async with anyio.create_task_group() as tg:
            for n in range(24):
                tg.start_soon(caller, n)
        for gw in gws:
            assert gw.money is not None
            await gw.money.flush()  # the last settlements and spend, each worker's
        assert gws[0].money is not None
        report = await gws[0].money.report([], None, None)
    answered = [o for o in outcomes if o.ok]
    assert len(answered) == ADMITTED, [o.error for o in outcomes if not o.ok][:2]
    assert {o.error.code for o in outcomes if o.error is not None} == {-32003}
    assert sum((o.cost or Decimal(0) for o in answered), Decimal(0)) <= CAP + PER_CALL
    spent = counted(store)["key:alice:total:all"]
    assert spent == int(ADMITTED * PER_CALL * NANO)
    assert Decimal(str(report["total"]["cost_usd"])) == Decimal(spent) / NANO


async def test_a_gateway_without_budgets_never_opens_the_counters(tmp_path: Path) -> None:
    """The counters are read when the first call under a budget needs them: a gateway whose keys
    have none adds no table, no connection and no write to the store."""
    data = {"store": {"path": str(tmp_path / "jobs.db")}, "spend": {"flush_interval_s": 0.05},
            "providers": {"m": {"kind": "mock", "price": {"per_call": str(PER_CALL)}}},
            "routes": {"chat": {"provider": "m", "operation": "chat"}}}
    async with Gateway(parse_config(data)) as gw:
        assert (await gw.submit(Call("chat", params(), identity=None))).ok
        assert gw.money is not None
        await gw.money.flush()
    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        assert not conn.execute("SELECT name FROM sqlite_master WHERE name = 'budget_counters'").fetchall()


async def test_serve_workers_2_spend_one_cap_across_a_restart(tmp_path: Path) -> None:
    """``multiplexer serve --workers 2`` on one SQLite store: callers on both worker processes
    get four calls in all, and after a restart both workers still refuse."""
    import yaml

    from tests.test_workers import connections_to_both, supervised

    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"port": 0, "grace_period_s": 5, "access_log": False, "admin_key": ADMIN,
                   "api_keys": {"alice": {"key": KEY, "budget_usd": {"total": str(CAP)}}}},
        "store": {"path": str(tmp_path / "jobs.db")},
        "spend": {"flush_interval_s": 0.05},
        "providers": {"m": {"kind": "mock", "price": {"per_call": str(PER_CALL)}}},
        "routes": {"chat": {"provider": "m", "operation": "chat"}},
    }))
    body = {"jsonrpc": "2.0", "id": 1, "method": "chat", "params": params()}
    for run in range(2):
        async with supervised(path) as (_, url, _):
            conns = await connections_to_both(url, 12, headers={"authorization": f"Bearer {KEY}"})
            replies: list[tuple[int, dict[str, Any]]] = []

            async def one(client: httpx.AsyncClient, pid: int,
                          replies: list[tuple[int, dict[str, Any]]] = replies) -> None:
                replies.append((pid, (await client.post(f"{url}/rpc", json=body)).json()))

            async with anyio.create_task_group() as tg:
                for client, pid in conns:
                    tg.start_soon(one, client, pid)
            for client, _ in conns:
                await client.aclose()
            answered = [r for _, r in replies if "result" in r]
            assert len({pid for pid, _ in replies}) == 2  # both workers were asked
            assert len(answered) == (ADMITTED if run == 0 else 0)
            assert all(r["error"]["code"] == -32003 for _, r in replies if "error" in r)
            async with httpx.AsyncClient(base_url=url) as admin:  # each worker writes its own
                with anyio.fail_after(10):  # spend within spend.flush_interval_s
                    while await reported(admin) != ADMITTED * PER_CALL:
                        await anyio.sleep(0.02)
    assert counted({"path": str(tmp_path / "jobs.db")}) == {"key:alice:total:all":
                                                            int(ADMITTED * PER_CALL * NANO)}


# -- the table itself, on both databases --------------------------------------------------------

def open_store(store: dict[str, Any]) -> Any:
    from multiplexer.money.stored_counters import budget_store_for

    return budget_store_for(store.get("path"), store.get("url"), store.get("schema", ""))()


def test_a_reservation_is_all_or_nothing_and_alerts_once(store: dict[str, Any]) -> None:
    s = open_store(store)
    try:
        day = ("key:alice:daily:2026-12-03", 1000, 800, 2_000_000_000.0)
        team = ("team:t:total:all", 10_000, 0, None)
        assert s.reserve([day, team], 700) == (0, 0, [])
        assert s.reserve([day, team], 700) == (0, 0, [0])  # crossed 800 of 1000: alert, once
        assert s.reserve([day, team], 1) == (1, 1400, [])  # the day's cap is reached: refused
        assert s.reserve([team, day], 1) == (2, 1400, [])  # whichever place it has in the ask
        s.settle([(day[0], -600), (team[0], -600)])  # the calls cost less than reserved
        assert s.reserve([day, team], 100) == (0, 0, [])  # room again; no second alert
        s.settle([("key:gone:daily:2026-01-01", -5)])  # a period that ended: nothing created
        rows = {k: (spent, alerted) for k, spent, alerted, _ in s.load(0.0)}
        assert rows == {day[0]: (900, 1), team[0]: (900, 0)}  # the refusals added nothing
    finally:
        s.close()


def test_counters_of_ended_periods_are_not_read_and_go_in_steps(store: dict[str, Any]) -> None:
    s = open_store(store)
    try:
        s.add([(f"key:k{i}:daily:2026-01-01", 5, 0, 100.0) for i in range(7)])
        counts = s.add([("key:alice:monthly:2026-12", 5, 1, 300.0), ("key:alice:total:all", 9, 0, None)])
        assert counts == {"key:alice:monthly:2026-12": (5, 1), "key:alice:total:all": (9, 0)}
        assert s.add([("key:alice:total:all", -4, 0, None)]) == {"key:alice:total:all": (5, 0)}
        assert sorted(r[0] for r in s.load(200.0)) == ["key:alice:monthly:2026-12", "key:alice:total:all"]
        assert [s.prune(200.0, step=3) for _ in range(4)] == [3, 3, 1, 0]  # expired ones only
        assert len(s.load(0.0)) == 2
    finally:
        s.close()


# -- write-behind: decided in memory, kept in the store -----------------------------------------

async def test_decisions_never_wait_for_the_store_and_the_count_lands_after(tmp_path: Path) -> None:
    """While another connection holds the SQLite file's write lock, calls are still decided in
    memory (no await); the count reaches the store once the lock is let go."""
    from multiplexer.money.budget_store import BudgetStore
    from multiplexer.money.budgets import Counter
    from multiplexer.money.stored_counters import WriteBehindCounters

    path = tmp_path / "jobs.db"
    first = WriteBehindCounters(lambda: 0.0, lambda: BudgetStore(path))
    await first.start()
    total = Counter("key:alice:total:all", limit=100, alert=0, ttl_ms=0, scope="key", name="alice",
                    period="total", reset=None)
    blocker = sqlite3.connect(str(path), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the file's write lock, held by someone else
    try:
        assert [first.reserve_now([total], 40)[0] for _ in range(4)] == [0, 0, 0, 1]  # 120: refused
        first.settle_now([(total.key, -30)])
        assert first.dirty() == {total.key} and first.spent[total.key] == 90
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    await first.write()
    assert counted({"path": str(path)}) == {total.key: 90} and not first.dirty()
    # a second process on the file starts from the store, and each sees the other's spend once
    # it writes: a count kept per process would let both spend the cap
    second = WriteBehindCounters(lambda: 0.0, lambda: BudgetStore(path))
    await second.start()
    assert second.reserve_now([total], 5) == (0, 0, [])
    await second.write()
    assert second.spent[total.key] == 95
    assert first.reserve_now([total], 5) == (0, 0, [])
    await first.write()
    assert first.spent[total.key] == 100 and counted({"path": str(path)}) == {total.key: 100}
    assert second.reserve_now([total], 0)[0] == 0  # stale until it writes: 95 here
    await second.write()
    assert second.reserve_now([total], 0)[:2] == (1, 100)  # 100 of 100: refused
    await first.aclose()
    await second.aclose()
