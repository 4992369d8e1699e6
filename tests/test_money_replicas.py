"""A budget holds across replicas: three gateways sharing Redis, 64 callers at once."""

from __future__ import annotations

from contextlib import AsyncExitStack
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.money.budgets import usd
from tests.redis_helpers import prefix, redis_url
from tests.remote_helpers import fakes

pytestmark = pytest.mark.anyio

WORDS = " ".join(f"w{i}" for i in range(40))  # 40 words in, "echo: " + 40 words out
BUDGET = Decimal("0.01")
CALLERS, CALLS_EACH = 64, 4
FIGURES: dict[str, Any] = {}  # what the run measured, printed for the closing note


def config(f: Any, tmp_path: Path, i: int, url: str, pre: str) -> Any:
    return parse_config({
        "server": {"api_keys": {"alice": {"key": "k-alice-0123456789",
                                          "budget_usd": {"total": str(BUDGET)}}}},
        "state": {"url": url, "prefix": pre, "timeout_ms": 10_000},  # a busy test host is slow
        "store": {"path": str(tmp_path / f"r{i}.db")},
        "providers": {"oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up",
                              "retry": {"attempts": 1}}},
        "routes": {"chat": {"provider": "oai", "operation": "chat"}},
    })


async def test_a_budget_holds_on_three_replicas_under_64_callers(tmp_path: Path) -> None:
    url, pre = redis_url(), prefix()
    params = {"model": "gpt-4o", "max_tokens": 64, "messages": [{"role": "user", "content": WORDS}]}
    outcomes: list[Outcome] = []
    async with fakes() as f, AsyncExitStack() as stack:
        gws = [await stack.enter_async_context(Gateway(config(f, tmp_path, i, url, pre))) for i in range(3)]

        async def caller(n: int) -> None:
            for _ in range(CALLS_EACH):
                outcomes.append(await gws[n % 3].submit(Call("chat", dict(params), identity="alice")))

        async with anyio.create_task_group() as tg:
            for n in range(CALLERS):
                tg.start_soon(caller, n)
        for gw in gws:
            assert gw.money is not None
            await gw.money.budgets.flush()  # the last settlements
        reservation = gws[0].money.budgets.most(gws[0].admit(Call("chat", dict(params), identity="alice")))
        counters = gws[0].money.budgets.counters
        r = counters.r  # type: ignore[attr-defined]
        spent_in_redis = int(await r.get(counters.prefix + "key:alice:total:all"))  # type: ignore[attr-defined]
    ok = [o for o in outcomes if o.ok]
    refused = [o for o in outcomes if not o.ok]
    spent = sum((o.cost for o in ok), Decimal(0))
    assert all(o.cost is not None and o.cost > 0 for o in ok)
    # every refused call got the documented error, before anything was sent
    assert refused and all(o.error is not None and o.error.code == -32003
                           and o.error.data["limit"] == "budget_usd" for o in refused)
    assert f.openai.requests["/v1/chat/completions"] == len(ok)
    # total spend ends at most one call's reservation over the budget
    assert reservation is not None
    assert spent <= BUDGET + usd(reservation)
    # the shared counter holds exactly what the answered calls cost, once settled
    assert spent_in_redis == sum(int(o.cost * 10**9) for o in ok)  # type: ignore[operator]
    FIGURES.update(calls=len(outcomes), answered=len(ok), refused=len(refused), spent=str(spent),
                   budget=str(BUDGET), one_reservation=str(usd(reservation)),
                   one_call=str(ok[0].cost))
    print("budget across replicas:", FIGURES)


async def test_shared_counters_refuse_settle_and_alert_once_per_period() -> None:
    from multiplexer.backends.redis_state import RedisState
    from multiplexer.money.budgets import Counter

    url, pre = redis_url(), prefix()
    a, b = RedisState(url, prefix=pre), RedisState(url, prefix=pre)
    await a.start()
    await b.start()
    try:
        ca, cb = a.budget_counters(), b.budget_counters()
        day = Counter("key:alice:daily:2026-12-03", limit=1000, alert=800, ttl_ms=60_000, scope="key",
                      name="alice", period="daily", reset=None)
        team = Counter("team:t:total:all", limit=10_000, alert=0, ttl_ms=0, scope="team", name="t",
                       period="total", reset=None)
        assert await ca.reserve([day, team], 700) == (0, 0, [])
        assert await cb.reserve([day, team], 700) == (0, 0, [0])  # crossed 800 of 1000: alert, once
        assert (await ca.reserve([day, team], 1))[:2] == (1, 1400)  # the day's cap is reached: refused
        await cb.settle([(day.key, -600), (team.key, -600)])  # the calls cost less than reserved
        assert await ca.reserve([day, team], 100) == (0, 0, [])  # room again; no second alert
        await ca.settle([("key:gone:daily:2026-01-01", -5)])  # a period that ended: nothing created
        assert await a.r.exists(ca.prefix + "key:gone:daily:2026-01-01") == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_total_budgets_alert_fires_once_not_every_second() -> None:
    """A ``total`` cap never resets, so neither does its alert: the flag that says it fired is
    kept as long as the counter (no expiry), and a later reservation past the share alerts no more."""
    from multiplexer.backends.redis_state import RedisState
    from multiplexer.core.policy import BudgetUsd
    from multiplexer.money.budgets import Budgets
    from multiplexer.money.settings import BudgetsConfig
    from tests.test_money import plan, prices

    url, pre = redis_url(), prefix()
    state = RedisState(url, prefix=pre)
    await state.start()
    alerts: list[tuple[str, str]] = []
    cap = BudgetUsd(total=Decimal("0.01"), alert_at=0.5)
    try:
        counters = state.budget_counters()
        budgets = Budgets(BudgetsConfig(), prices(), counters, lambda identity: [("key", "alice", cap)],
                          lambda: 1_796_335_200.0, lambda scope, period: None,
                          lambda scope, period: alerts.append((scope, period)))
        p = plan("r", "oai", {"model": "gpt-4o", "max_tokens": 300, "messages": []})
        p.item.tokens = 310  # type: ignore[union-attr]
        decided = [(await budgets.reserve([p], [[("key", "alice", cap)]]))[0] for _ in range(2)]
        assert alerts == [("key", "total")]  # $0.003025 each: the second crossed half the cap
        flag = counters.prefix + "key:alice:total:all:alerted"
        assert await state.r.pttl(flag) == -1  # kept, as the counter is: it never lapses
        decided += await budgets.reserve([p], [[("key", "alice", cap)]])  # past the share again
        assert [type(d).__name__ for d in decided] == ["Reservation"] * 3
        assert alerts == [("key", "total")]  # no second alert
    finally:
        await state.aclose()


async def test_a_cold_redis_starts_again_from_the_spend_the_store_recorded(tmp_path: Path) -> None:
    """Redis decides, the store keeps the record: a counter Redis lost (a restart without
    persistence) is set again from the spend the store recorded for its period before anything
    is decided on it, so the budget is not handed out a second time."""
    url, pre = redis_url(), prefix()
    conf = parse_config({
        "server": {"api_keys": {"alice": {"key": "k-alice-0123456789", "budget_usd": {"total": "0.03"}}}},
        "state": {"url": url, "prefix": pre, "timeout_ms": 10_000},
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"m": {"kind": "mock", "price": {"per_call": "0.008"}}},
        "routes": {"chat": {"provider": "m", "operation": "chat"}},
    })
    params = {"messages": [{"role": "user", "content": "hello"}]}
    async with Gateway(conf) as gw:
        assert gw.money is not None
        outcomes = [await gw.submit(Call("chat", dict(params), identity="alice")) for _ in range(5)]
        assert [o.ok for o in outcomes] == [True] * 4 + [False]  # $0.032 of $0.03
        await gw.money.flush()  # settled, and the spend written to the store
        counters = gw.money.budgets.counters
        key = counters.prefix + "key:alice:total:all"  # type: ignore[attr-defined]
        await state_client(counters).delete(key)  # Redis lost it
        again = await gw.submit(Call("chat", dict(params), identity="alice"))
        assert again.error is not None and again.error.code == -32003
        assert again.error.data["spend"] == "0.032"  # what the store recorded
        assert int(await state_client(counters).get(key)) == 32_000_000


def state_client(counters: Any) -> Any:
    return counters.r
