"""Budgets per key and per team: the most a call can cost is reserved before it goes, and
settled to what it cost once it is answered.

A reservation is one decision over every counter that applies to the caller (its key's and its
team's, daily, monthly and total), all or nothing: in this process (``LocalCounters``; kept in the
store's database behind the decisions by ``stored_counters.WriteBehindCounters``), in the store
itself for gateways that share it as workers (``stored_counters.StoreCounters``), or, with
``state.url``, in one Redis script shared by every replica. A call is refused while any of them
has nothing left; an admitted call reserves its whole estimate, so spend can pass a cap by at
most the reservations admitted while it still had room, and ends there. Amounts are integer
nano-dollars, so counters add exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_CEILING, Decimal
from typing import Any, Protocol, runtime_checkable
from zoneinfo import ZoneInfo

import anyio

from multiplexer.core.errors import Code, RpcError, rate_limited
from multiplexer.core.policy import BudgetUsd
from multiplexer.core.state import StateUnavailable
from multiplexer.money.prices import UNBILLED, Prices, out_budget
from multiplexer.money.settings import BudgetsConfig

log = logging.getLogger(__name__)

NANO = Decimal(1_000_000_000)
SETTLE_EVERY_S = 0.02  # settlements in the shared state (and counts to the store) go at most this often
SWEEP_EVERY = 1024  # settlements between two sweeps of the counters of ended periods
PERIODS = ("daily", "monthly", "total")
Scope = tuple[str, str, BudgetUsd]  # ("key" | "team", its name, its budget)


def nanos(usd: Decimal) -> int:
    return int((usd * NANO).to_integral_value(rounding=ROUND_CEILING))


def usd(n: int) -> Decimal:
    return (Decimal(n) / NANO).normalize()


def budgets_of_config(identity: str | None, api_keys: dict[str, Any],
                      teams: dict[str, Any]) -> list[Scope]:
    """The budgets a caller answers to, from ``server.api_keys`` entries and ``server.teams``:
    the key's own, then its team's. The key store (when there is one) extends this."""
    if identity is None:
        return []
    entry = api_keys.get(identity)
    out: list[Scope] = []
    own = getattr(entry, "budget_usd", None)
    if own is not None:
        out.append(("key", identity, own))
    team = getattr(entry, "team", None)
    team_budget = getattr(teams.get(team), "budget_usd", None) if team is not None else None
    if team is not None and team_budget is not None:
        out.append(("team", team, team_budget))
    return out


def team_of_config(identity: str | None, api_keys: dict[str, Any]) -> str | None:
    entry = api_keys.get(identity) if identity is not None else None
    team = getattr(entry, "team", None)
    return team if isinstance(team, str) else None


@dataclass(slots=True)
class Counter:
    """One cap's counter for the current period."""

    key: str
    limit: int  # nano-dollars
    alert: int  # nano-dollars at which the alert fires; 0: none
    ttl_ms: int  # kept a day past the period's end; 0: kept
    scope: str
    name: str
    period: str
    reset: float | None  # epoch seconds of the period's end; None: never


def expires_at(c: Counter) -> float | None:
    """When a counter may be forgotten: a day after its period ends (None: never)."""
    return None if c.reset is None else c.reset + 86_400


def period_days(c: Counter) -> tuple[str, str]:
    """The first and last day of a counter's period as the spend store writes days."""
    when = c.key.rsplit(":", 1)[1]
    if c.period == "daily":
        return when, when
    if c.period == "monthly":
        return f"{when}-01", f"{when}-31"
    return "0000-01-01", "9999-12-31"


@dataclass(slots=True, eq=False)
class Reservation:
    counters: list[Counter]
    amount: int  # nano-dollars reserved
    settled: bool = False


class Counters(Protocol):
    """Where counters live: this process or the shared state."""

    async def reserve(self, counters: Sequence[Counter], amount: int) -> tuple[int, int, list[int]]:
        """Add ``amount`` to every counter unless one has reached its limit: (0, 0, alerts) when
        added (``alerts``: indexes whose alert fired now, once per period), else (1-based index
        of the counter that refused, its spend)."""
        ...

    async def settle(self, changes: Sequence[tuple[str, int]]) -> None:
        """Add each (counter key, delta) to counters that still exist (a period that ended is gone)."""
        ...


@runtime_checkable
class Kept(Protocol):
    """Counters in a database: counters of ended periods pruned, the connection closed."""

    async def prune(self) -> None: ...

    async def aclose(self) -> None: ...


class LocalCounters:
    """Counters in this process's memory, decided with no await (``reserve_now``)."""

    loaded = True  # nothing to read before deciding here

    def __init__(self, wall: Callable[[], float]) -> None:
        self.wall = wall
        self.spent: dict[str, int] = {}
        self.expires: dict[str, float] = {}
        self.alerted: set[str] = set()
        # what changed since a store that keeps these counts last took them (None: no store): the
        # counters that reserved or settled (a caller's one list, noted once in a row), and the
        # changes of ``settle_now``; the keys are gathered once per write, not per call
        self.touched: list[Sequence[Counter]] | None = None
        self.settled: list[Sequence[tuple[str, int]]] = []
        self.on_dirty: Callable[[], None] = lambda: None  # the first change since the last take
        self._settles = 0

    async def start(self) -> None:
        """Read what a store holds before this process decides alone (nothing, in memory)."""

    async def write(self) -> None:
        """Hand the changes since the last write to a store (nothing, in memory)."""

    async def reserve(self, counters: Sequence[Counter], amount: int) -> tuple[int, int, list[int]]:
        return self.reserve_now(counters, amount)

    def reserve_now(self, counters: Sequence[Counter], amount: int) -> tuple[int, int, list[int]]:
        held = self.spent
        for i, c in enumerate(counters):
            spent = held.get(c.key, 0)
            if spent >= c.limit:
                return i + 1, spent, []
        alerts = []
        for i, c in enumerate(counters):
            spent = held[c.key] = held.get(c.key, 0) + amount
            if c.reset is not None:
                self.expires[c.key] = c.reset + 86_400
            if c.alert and spent >= c.alert and c.key not in self.alerted:
                self.alerted.add(c.key)
                alerts.append(i)
        touched = self.touched
        if touched is not None and (not touched or touched[-1] is not counters):
            if not touched:
                self.on_dirty()
            touched.append(counters)
        return 0, 0, alerts

    async def settle(self, changes: Sequence[tuple[str, int]]) -> None:
        self.settle_now(changes)

    def settle_now(self, changes: Sequence[tuple[str, int]]) -> None:
        held = self.spent
        for key, delta in changes:
            if key in held:
                held[key] += delta
        if self.touched is not None:
            if not self.settled:
                self.on_dirty()
            self.settled.append(changes)
        self._sweep()

    def move(self, counters: Sequence[Counter], delta: int) -> None:
        """``settle_now`` of one reservation: ``delta`` added to each of its counters that exist."""
        held = self.spent
        for c in counters:
            if c.key in held:
                held[c.key] += delta
        touched = self.touched
        if touched is not None and (not touched or touched[-1] is not counters):
            if not touched:
                self.on_dirty()
            touched.append(counters)
        self._sweep()

    def _sweep(self) -> None:
        self._settles += 1
        if self._settles % SWEEP_EVERY == 0 and len(self.expires) >= 64:
            now = self.wall()
            self.forget([k for k, t in self.expires.items() if t < now])

    def forget(self, keys: Sequence[str]) -> None:
        """Drop the counters of periods that ended over a day ago."""
        for key in keys:
            self.spent.pop(key, None)
            self.expires.pop(key, None)
            self.alerted.discard(key)


class Periods:
    """The current day's and month's ids and ends in the budgets' time zone, recomputed only when
    the day ends (one comparison per call)."""

    def __init__(self, zone: str) -> None:
        self.zone = ZoneInfo(zone)
        self._until = -math.inf
        self.day = self.month = ""
        self.day_end = self.month_end = 0.0

    def at(self, wall: float) -> Periods:
        if wall >= self._until:
            now = datetime.fromtimestamp(wall, self.zone)
            start = now.replace(hour=0, minute=0, second=0, microsecond=0)
            day_end = (start + timedelta(days=1)).replace(tzinfo=None)
            day_end_at = datetime.combine(day_end.date(), day_end.time(), self.zone)
            first = start.replace(day=1)
            month_end = (first + timedelta(days=32)).replace(day=1)
            self.day, self.month = start.strftime("%Y-%m-%d"), start.strftime("%Y-%m")
            self.day_end = day_end_at.timestamp()
            self.month_end = datetime.combine(month_end.date(), month_end.time(), self.zone).timestamp()
            self._until = self.day_end
        return self


def budget_refusal(c: Counter, spent: int, wall: float) -> RpcError:
    """-32003 with ``limit: budget_usd``: which cap, its period, what was spent and when it resets,
    in ``data`` and in one sentence (``Budget exceeded: key alice's daily budget of $5 is spent
    ($5.0012); it resets at 2026-12-07T00:00:00Z``)."""
    data: dict[str, Any] = {"limit": "budget_usd", "scope": c.scope, "name": c.name, "period": c.period,
                            "budget_usd": str(usd(c.limit)), "spend": str(usd(spent))}
    if c.reset is not None:
        data["reset"] = datetime.fromtimestamp(c.reset, ZoneInfo("UTC")).isoformat().replace("+00:00", "Z")
        data["retry_after"] = round(max(c.reset - wall, 1.0), 3)
        when = f"it resets at {data['reset']}"
    else:
        data["reset"] = None
        when = "it never resets (an admin may raise it)"
    left = c.limit - spent
    state = f"is spent (${usd(spent):f})" if left <= 0 else f"has ${usd(left):f} left (${usd(spent):f} spent)"
    return RpcError(Code.RATE_LIMITED, f"Budget exceeded: {c.scope} {c.name}'s {c.period} budget of "
                                       f"${usd(c.limit):f} {state}; {when}", data)


class Budgets:
    def __init__(self, config: BudgetsConfig, prices: Prices, counters: Counters,
                 budgets_of: Callable[[str | None], list[Scope]], wall: Callable[[], float],
                 on_refused: Callable[[str, str], None], on_alert: Callable[[str, str], None],
                 prefix: str = "", fail_open: bool = False) -> None:
        self.config = config
        self.prices = prices
        self.counters = counters
        self.budgets_of = budgets_of
        self.wall = wall
        self.periods = Periods(config.timezone)
        self.prefix = prefix
        self.fail_open = fail_open  # the shared state unreachable: admit (open) or refuse (closed)
        self.on_refused, self.on_alert = on_refused, on_alert
        self._changes: list[tuple[str, int]] = []
        self._wake = anyio.Event()
        self._counters: dict[int, tuple[list[Scope], str, list[Counter]]] = {}
        # decided at once, no round trip (counters read from a store: once they are read)
        self.local = isinstance(counters, LocalCounters) and counters.loaded
        if isinstance(counters, LocalCounters):
            counters.on_dirty = self._wake_up

    def applies(self, identity: str | None) -> bool:
        return bool(self.budgets_of(identity))

    def counters_for(self, scopes: list[Scope], wall: float) -> list[Counter]:
        """The counters of ``scopes`` in the current periods (made once per caller and day)."""
        p = self.periods.at(wall)
        # by the scopes list's identity: ``budgets_of`` hands out one list per caller until the
        # keys change (the list is kept in the entry, so its id cannot be reused meanwhile)
        held = self._counters.get(id(scopes))
        if held is not None and held[0] is scopes and held[1] == p.day:
            return held[2]
        if len(self._counters) >= 10_000:
            self._counters.clear()
        found = self._make_counters(scopes, wall, p)
        self._counters[id(scopes)] = (scopes, p.day, found)
        return found

    def _make_counters(self, scopes: list[Scope], wall: float, p: Periods) -> list[Counter]:
        out = []
        for scope, name, budget in scopes:
            for period in PERIODS:
                cap = getattr(budget, period)
                if cap is None:
                    continue
                when, reset = {"daily": (p.day, p.day_end), "monthly": (p.month, p.month_end),
                               "total": ("all", None)}[period]
                limit = nanos(cap)
                alert = nanos(cap * Decimal(str(budget.alert_at))) if budget.alert_at else 0
                ttl = int((reset - wall + 86_400) * 1000) if reset is not None else 0
                out.append(Counter(f"{self.prefix}{scope}:{name}:{period}:{when}", limit, alert, ttl,
                                   scope, name, period, reset))
        return out

    def most(self, plan: Any) -> int | None:
        """Nano-dollars the call can cost at most (None: its model has no price, nothing reserved)."""
        item, route = plan.item, plan.route
        if item is None or route is None:
            return None
        return self.most_of(plan.label, route, item, item.options.get("mode") == "batch")

    def most_of(self, label: str, route: Any, item: Any, batch: bool) -> int | None:
        """``most`` of an item on route ``label``; ``batch``: at the batch API's price."""
        if item.operation in UNBILLED:
            return None
        params = item.params
        model = params.get("model") if isinstance(params, dict) else None
        rates = self.prices.rates(label, route.provider, model if isinstance(model, str) else None)
        if rates is None:
            return None
        estimate = item.options.get("tokens", item.tokens) if batch else item.tokens
        given = out_budget(params)
        out = given if given is not None else self.config.default_max_output_tokens
        inp = max(int(estimate or 0) - (given or 0), 1)
        n = params.get("n") if isinstance(params, dict) else None
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
        pico = inp * max(rates.p_input, rates.p_write) + n * out * rates.p_output + rates.p_call
        if batch:
            num, den = self.prices.batch_kept(label, route.provider)
            pico = pico * num // den
        return -(-pico // 1000)  # nano-dollars, rounded up

    def reserve_here(self, plan: Any, scopes: list[Scope]) -> Reservation | RpcError | None:
        """One plan's ``reserve`` when the counters are in this process (``local``): no await."""
        assert isinstance(self.counters, LocalCounters)
        amount = self.most(plan)
        if amount is None:
            return None
        wall = self.wall()
        counters = self.counters_for(scopes, wall)
        if not counters:
            return None
        return self._decided(counters, amount, self.counters.reserve_now(counters, amount), wall)

    async def reserve(self, plans: Sequence[Any],
                      scopes_of: Sequence[list[Scope]]) -> list[Reservation | RpcError | None]:
        """Each plan's reservation, refusal, or None (nothing to reserve: its model has no price)
        under its budgets (``scopes_of``, one list per plan, from ``budgets_of``)."""
        if self.local:  # in this process: decided at once, in order
            return [self.reserve_here(p, s) for p, s in zip(plans, scopes_of, strict=True)]
        if isinstance(self.counters, LocalCounters):  # read from the store first, once
            await self.counters.start()
            self.local = True
            return [self.reserve_here(p, s) for p, s in zip(plans, scopes_of, strict=True)]
        out: list[Reservation | RpcError | None] = [None] * len(plans)
        wall = self.wall()
        asks: list[tuple[int, list[Counter], int]] = []
        for i, plan in enumerate(plans):
            amount = self.most(plan)
            if amount is None:
                continue
            counters = self.counters_for(scopes_of[i], wall)
            if counters:
                asks.append((i, counters, amount))
        limiter = anyio.CapacityLimiter(16)  # an array's reservations, a few round trips at once

        async def one(i: int, counters: list[Counter], amount: int) -> None:
            async with limiter:
                try:
                    answer = await self.counters.reserve(counters, amount)
                except StateUnavailable:
                    out[i] = None if self.fail_open else rate_limited(
                        "budget_unavailable", 1.0, detail="the shared budget state is unreachable")
                    return
                out[i] = self._decided(counters, amount, answer, wall)

        try:
            async with anyio.create_task_group() as tg:
                for ask in asks:
                    tg.start_soon(one, *ask)
        except BaseException:  # the caller went away: what was reserved for it is given back
            for r in out:
                if isinstance(r, Reservation):
                    self.settle(r, 0)
            raise
        return out

    def _decided(self, counters: list[Counter], amount: int, answer: tuple[int, int, list[int]],
                 wall: float) -> Reservation | RpcError:
        refused, spent, alerts = answer
        if refused:
            c = counters[refused - 1]
            self.on_refused(c.scope, c.period)
            return budget_refusal(c, spent, wall)
        for k in alerts:
            c = counters[k]
            self.on_alert(c.scope, c.period)
            log.warning("budget alert: %s %s has spent %s%% of its %s budget of $%s", c.scope, c.name,
                        int(Decimal(c.alert) * 100 / Decimal(c.limit)), c.period, usd(c.limit))
        return Reservation(counters, amount)

    def settle(self, r: Reservation, cost: int | None) -> None:
        """The call ended costing ``cost`` pico-dollars (None: unknown, the reservation stands; 0
        when it failed or never ran): its counters move by the difference."""
        if r.settled:
            return
        r.settled = True
        if cost is None:
            return
        delta = -(-cost // 1000) - r.amount
        if delta:
            self._move(r.counters, delta)

    async def hold(self, identity: str | None, amount: int) -> Reservation | RpcError | None:
        """A whole batch's reservation (``amount`` nano-dollars: its lines' ``most_of`` summed),
        admitted only if every budget of ``identity`` has room for all of it: else refused whole,
        naming what is missing (``needed``, ``shortfall``). None: no budget applies. Two steps on
        any counters (add it; then refused if a counter is now at its cap, and given back), so a
        concurrent call may see the batch's amount for a moment, never pass the cap for it."""
        scopes = self.budgets_of(identity)
        if not scopes or amount <= 0:
            return None
        wall = self.wall()
        counters = self.counters_for(scopes, wall)
        if not counters:
            return None
        try:
            refused, spent, _ = await self.counters.reserve(counters, amount)
            if not refused:
                refused, spent, _ = await self.counters.reserve(counters, 0)
                if refused:  # over a cap with all of it: given back, refused whole
                    await self.counters.settle([(c.key, -amount) for c in counters])
                    spent -= amount
        except StateUnavailable:
            return None if self.fail_open else rate_limited(
                "budget_unavailable", 1.0, detail="the shared budget state is unreachable")
        if refused:
            c = counters[refused - 1]
            self.on_refused(c.scope, c.period)
            error = budget_refusal(c, spent, wall)
            assert error.data is not None
            error.data.update(needed=str(usd(amount)),
                              shortfall=str(usd(max(spent + amount - c.limit, 0))))
            return error
        return Reservation(counters, amount)

    @staticmethod
    def draw(held: Reservation, amount: int | None) -> Reservation | None:
        """A line's own reservation out of its batch's (``hold``): up to ``amount`` of what the
        batch still holds, moved to the line, which settles it as any call's. None: unpriced."""
        if amount is None:
            return None
        part = min(amount, held.amount)
        held.amount -= part
        return Reservation(held.counters, part)

    def settle_part(self, r: Reservation, part: int, cost: int | None) -> None:
        """Part of a batch's reservation ended (a line answered): ``part`` nano-dollars of it
        settled to ``cost`` pico-dollars (None: unknown, the part stands); the rest stays held."""
        part = min(part, r.amount)
        r.amount -= part
        if r.settled or cost is None:
            return
        delta = -(-cost // 1000) - part
        if delta:
            self._move(r.counters, delta)

    def _move(self, counters: list[Counter], delta: int) -> None:
        """``delta`` added to a reservation's counters: at once in this process's, else sent with
        the next batch of settlements."""
        if isinstance(self.counters, LocalCounters):  # in this process: at once, nothing to send
            self.counters.move(counters, delta)
            return
        self._changes.extend((c.key, delta) for c in counters)
        if not self._changes[len(counters):]:  # the first since the last batch went
            self._wake.set()

    def rereserve(self, plan: Any) -> RpcError | None:
        """A call moved to another route (a fallback, a group's next member): its reservation
        becomes the most that route can cost. More is asked of the counters as a reservation is
        (refused while one has nothing left); less is given back. In the shared state the
        difference is sent with the settlements, unchecked (no round trip in the attempt loop)."""
        amount = self.most(plan)
        r = plan.reservation
        if r is None:
            scopes = self.budgets_of(plan.call.identity)
            if amount is None or not scopes:
                return None
            if self.local:
                found = self.reserve_here(plan, scopes)
                if isinstance(found, RpcError):
                    return found
                plan.reservation = found
                return None
            counters = self.counters_for(scopes, self.wall())
            plan.reservation = r = Reservation(counters, 0)
        if amount is None or r.settled:
            return None  # an unpriced route: what was reserved stands
        delta, wall = amount - r.amount, self.wall()
        if delta > 0 and isinstance(self.counters, LocalCounters):
            decided = self._decided(r.counters, delta, self.counters.reserve_now(r.counters, delta), wall)
            if isinstance(decided, RpcError):
                return decided
        elif delta:
            self._move(r.counters, delta)
        r.amount = amount
        return None

    def _wake_up(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Send the settlements of ended calls (or the counts kept in memory, to the store), a
        batch at a time, for the gateway's lifetime. Counters a store keeps are read when the
        first call needs them (``reserve``), so a gateway without budgets never opens it."""
        while True:
            await self._wake.wait()
            await anyio.sleep(SETTLE_EVERY_S)  # a batch: the calls ending meanwhile go in one script run
            self._wake = anyio.Event()
            await self.flush()

    async def flush(self) -> None:
        changes, self._changes = self._changes, []
        if changes:
            merged: dict[str, int] = {}
            for key, delta in changes:
                merged[key] = merged.get(key, 0) + delta
            try:
                await self.counters.settle(list(merged.items()))
            except Exception:
                log.exception("budget settlements could not be sent; the reservations stand")
        if isinstance(self.counters, LocalCounters):
            await self.counters.write()
