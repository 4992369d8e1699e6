"""One key's own spend, for its own dashboard view: today and this month (days in
``budgets.timezone``), by route and model, and its own budget's use; never another key's figures.

Read from the spend store plus what the writer has not written yet (``Money.key_rows``), and kept
per key for ``ttl_s`` on the gateway's clock: every open page of a key, each tick, shares one read.
A team budget's use is the team's spend, other keys' included, so it is not shown here.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date
from typing import Any, Protocol

import anyio

from multiplexer.core.clock import Clock
from multiplexer.money.budgets import PERIODS, Budgets, nanos
from multiplexer.money.report import dollars, sums_json
from multiplexer.money.spend_store import SUMS

TTL_S = 2.0  # a key's figures are at most this old (the writer's own default interval)
KEPT = 10_000  # cached keys before the expired ones are dropped
COST = SUMS.index("cost")


class Ledger(Protocol):
    """What this reads of ``ledger.Money``."""

    clock: Clock
    budgets: Budgets

    async def key_rows(self, identity: str, group_by: Sequence[str], since: date,
                       until: date) -> list[tuple[Any, ...]]: ...

    def today(self) -> date: ...


def _add(into: list[int], values: Sequence[Any]) -> None:
    for i, v in enumerate(values):
        into[i] += int(v or 0)


class KeySpend:
    def __init__(self, money: Ledger, ttl_s: float = TTL_S) -> None:
        self.money = money
        self.ttl_s = ttl_s
        self.reads = 0  # reads of the store, all keys together
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}  # key -> (when read, figures)
        self._lock = anyio.Lock()

    def _fresh(self, identity: str) -> dict[str, Any] | None:
        hit = self._cache.get(identity)
        return hit[1] if hit is not None and self.money.clock.now() < hit[0] + self.ttl_s else None

    async def of(self, identity: str) -> dict[str, Any]:
        """The key's figures, read at most once per ``ttl_s``."""
        found = self._fresh(identity)
        if found is not None:
            return found
        async with self._lock:  # pages of one key asking at once: one read
            found = self._fresh(identity)
            if found is None:
                found = await self._read(identity)
                now = self.money.clock.now()
                if len(self._cache) >= KEPT:
                    self._cache = {k: v for k, v in self._cache.items() if now < v[0] + self.ttl_s}
                self._cache[identity] = (now, found)
            return found

    async def _read(self, identity: str) -> dict[str, Any]:
        self.reads += 1
        m = self.money
        today = m.today()
        first = today.replace(day=1)
        day = today.isoformat()
        rows = await m.key_rows(identity, ["day", "route", "model"], first, today)
        totals = {"today": [0] * len(SUMS), "this_month": [0] * len(SUMS)}
        by: dict[tuple[str, str], dict[str, list[int]]] = {}
        for d, route, model, *values in rows:
            mine = by.setdefault((route, model), {"today": [0] * len(SUMS), "this_month": [0] * len(SUMS)})
            for period in ("today", "this_month") if d == day else ("this_month",):
                _add(totals[period], values)
                _add(mine[period], values)
        return {"configured": True, "day": day, "month": first.isoformat()[:7],
                "today": sums_json(totals["today"]), "this_month": sums_json(totals["this_month"]),
                "routes": [{"route": r, "model": mdl or None, "today": sums_json(s["today"]),
                            "this_month": sums_json(s["this_month"])} for (r, mdl), s in sorted(by.items())],
                "budgets": await self._budgets(identity, totals["today"][COST],
                                               totals["this_month"][COST], today)}

    async def _budgets(self, identity: str, day: int, month: int, today: date) -> list[dict[str, Any]]:
        """The key's own caps: what it spent in each period against it (what the store has; the
        budget's counter also holds the reservations of calls still running)."""
        out = []
        p = self.money.budgets.periods.at(self.money.clock.wall())
        for scope, _name, budget in self.money.budgets.budgets_of(identity):
            if scope != "key":
                continue
            for period in PERIODS:
                cap = getattr(budget, period)
                if cap is None:
                    continue
                if period == "total":
                    ever = await self.money.key_rows(identity, [], date(1970, 1, 1), today)
                    spent, reset = (int(ever[0][COST]) if ever else 0), None
                else:
                    spent, reset = (day, p.day_end) if period == "daily" else (month, p.month_end)
                limit = nanos(cap)
                out.append({"period": period, "budget_usd": float(cap), "spent_usd": dollars(spent),
                            "used": round(spent / limit, 4) if limit else None,
                            "alert_at": budget.alert_at, "reset_at": reset})
        return out
