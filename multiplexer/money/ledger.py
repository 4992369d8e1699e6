"""The money side of one gateway: the meter, budgets, and the writer that keeps the spend.

``Money`` is built from the config by the gateway; its ``run`` task (in the gateway's task
group) writes what the meter recorded every ``spend.flush_interval_s`` and sends budget
settlements as calls end. ``report`` answers ``GET /admin/spend``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import anyio

from multiplexer.core.after import after
from multiplexer.core.call import Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError
from multiplexer.core.metrics import Metrics
from multiplexer.money.budgets import Budgets, Counters, Kept, LocalCounters, Reservation, Scope
from multiplexer.money.meter import BATCH, CACHE, INFLIGHT, SEMANTIC, Meter, MoneyMetrics, Record
from multiplexer.money.own import KeySpend
from multiplexer.money.prices import Prices
from multiplexer.money.report import sums_json
from multiplexer.money.settings import BudgetsConfig, SpendConfig
from multiplexer.money.spend_store import COLUMNS, GROUPS, SUMS, PgSpendStore, SpendStore

log = logging.getLogger(__name__)

_HOW_COLUMN = {BATCH: 4, INFLIGHT: 5, CACHE: 6, SEMANTIC: 14}  # index in SUMS of saved_<how>
OVERVIEW_S = 5.0  # the admin dashboard's spend by day and key: read at most this often
OVERVIEW_DAYS = 14


def rows_json(group_by: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """The store's sums by ``group_by`` as `GET /admin/spend` writes its rows (an empty group: null)."""
    n = len(group_by)
    return [{**{g: (v if v != "" else None) for g, v in zip(group_by, r[:n], strict=True)},
             **sums_json(r[n:])} for r in rows]


class JobHold:
    """A batch job's reservation and how many of its priced lines have not settled yet."""

    __slots__ = ("left", "reservation")

    def __init__(self, reservation: Reservation, lines: int) -> None:
        self.reservation, self.left = reservation, lines

    def share(self) -> int:
        """The next line's part of what is still held (the rest split evenly)."""
        part = self.reservation.amount // max(self.left, 1)
        self.left = max(self.left - 1, 0)
        return part


class Money:
    def __init__(self, spend: SpendConfig, budgets: BudgetsConfig, prices: Prices, clock: Clock,
                 metrics: Metrics, *, budgets_of: Callable[[str | None], list[Scope]],
                 team_of: Callable[[str | None], str | None], store_path: Any, store_url: str | None,
                 store_schema: str, counters: Counters | None = None, prefix: str = "",
                 fail_open: bool = False) -> None:
        self.config = spend
        self.clock = clock
        self.metrics = MoneyMetrics(metrics)
        self.meter = Meter(prices, clock, self.metrics)
        self.team_of = team_of
        self.zone = ZoneInfo(budgets.timezone)
        self.budgets = Budgets(
            budgets, prices, counters or LocalCounters(clock.wall), budgets_of, clock.wall,
            lambda scope, period: self.metrics.child(self.metrics.budget_refused, scope, period).inc(),
            lambda scope, period: self.metrics.child(self.metrics.budget_alerts, scope, period).inc(),
            prefix, fail_open)
        self._store_args = (store_path, store_url, store_schema)
        self.store: SpendStore | None = None
        self._lock = anyio.Lock()
        self.own = KeySpend(self)  # a key's own figures, for its dashboard view
        self._overview: tuple[float, dict[str, Any]] | None = None  # (read at, figures)
        self.jobs: dict[str, JobHold] = {}  # batch jobs' budget reservations, settled line by line

    def finish(self, plan: Any, outcome: Outcome, answer: Outcome, shared: str | None,
               went_upstream: bool = False) -> Outcome:
        """A call's last step: its answer priced and its budget reservation settled to what it
        cost. A call that failed before anything reached the provider cost nothing: its
        reservation is refunded. One that failed after it went upstream (a stream its caller
        abandoned, a call cancelled or timed out while it ran) is booked at what it used: the
        chunks a stream handed over, else the most it could cost (``Budgets.most``); never a
        silent refund."""
        cost: int | None = 0
        if answer.error is None:
            answer, cost = self.meter.price(plan, outcome, answer, shared)
        elif went_upstream and shared is None:
            reservation = plan.reservation
            most = reservation.amount if reservation is not None else self.budgets.most(plan)
            cost = self.meter.used(plan, None if most is None else most * 1000)
        reservation = plan.reservation
        if reservation is not None:  # once the answer is written (core/after.py)
            after(self.budgets.settle, reservation, cost)
        return answer

    async def _store(self) -> SpendStore:
        if self.store is not None:
            return self.store
        return await anyio.to_thread.run_sync(self.open_store)

    async def hold_job(self, job_id: str, identity: str | None, lines: Sequence[int | None]) -> None:
        """A batch job's budget, reserved whole before it is stored: each line's most (nano-dollars,
        ``Budgets.most_of``; None: unpriced, nothing held). Raises the refusal, naming the shortfall."""
        priced = [n for n in lines if n is not None]
        if not priced:
            return
        found = await self.budgets.hold(identity, sum(priced))
        if isinstance(found, RpcError):
            raise found
        if found is not None:
            self.jobs[job_id] = JobHold(found, len(priced))

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        """A gateway listener: a client's batch job's lines are priced as they finish, each settling
        its share of the job's reservation; what is left when the job ends (lines that failed or
        were cancelled before the provider ran them, which it does not bill) is given back."""
        if event == "batch_results":
            costs = self.meter.lines(data.get("identity"), data.get("provider", ""),
                                     bool(data.get("batch")), data.get("lines") or [])
            data["costs"] = costs  # for the request log's records, a listener after this one
            held = self.jobs.get(data.get("job_id", ""))
            if held is not None:
                for cost in costs:
                    self.budgets.settle_part(held.reservation, held.share(), cost)
        elif event == "batch_job_ended":
            held = self.jobs.pop(data.get("job_id", ""), None)
            if held is not None:
                self.budgets.settle(held.reservation, 0)  # the lines that never ran

    def open_store(self) -> SpendStore:
        if self.store is None:
            path, url, schema = self._store_args
            self.store = PgSpendStore(url, schema) if url else SpendStore(path)
        return self.store

    async def run(self) -> None:
        """The writer and the settler, for the gateway's lifetime."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.budgets.run)
            pruned = swept = ""
            while True:
                await self.clock.sleep_until(self.clock.now() + self.config.flush_interval_s)
                await self.flush()
                today = self.today()
                if isinstance(self.budgets.counters, Kept) and swept != today.isoformat():
                    swept = today.isoformat()  # counters of periods that ended, once a day
                    try:
                        await self.budgets.counters.prune()
                    except Exception:
                        log.exception("old budget counters could not be deleted")
                if self.config.retention_days is not None and self.store is not None \
                        and pruned != today.isoformat():
                    pruned = today.isoformat()
                    first = (today - timedelta(days=self.config.retention_days)).isoformat()
                    try:
                        await anyio.to_thread.run_sync(self.store.prune, first)
                    except Exception:
                        log.exception("old spend could not be deleted")

    async def flush(self) -> None:
        """Write what was recorded since the last flush (one batch), and settle budgets."""
        await self.budgets.flush()
        async with self._lock:
            records = self.meter.take()
            if not records:
                return
            try:
                store = await self._store()
                # summed on the writer's thread too: a 2 s batch is thousands of records
                await anyio.to_thread.run_sync(lambda: store.add(self.rows(records)))
            except Exception:
                log.exception("spend could not be written (%d calls); /metrics counts it", len(records))

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.flush()
            if isinstance(self.budgets.counters, Kept):  # the last counts written, then closed
                await self.budgets.counters.aclose()
            if self.store is not None:
                await anyio.to_thread.run_sync(self.store.close)

    def rows(self, records: Sequence[Record]) -> list[tuple[Any, ...]]:
        """Records summed by (day, key, team, route, model); pico-dollars summed, then nano."""
        sums: dict[tuple[str, str, str, str, str], list[int]] = {}
        days: dict[int, str] = {}
        teams: dict[str | None, str] = {}
        for at, key, route, _provider, model, cost, saved, how, prompt_saved, requests_saved, writes, \
                moved, move_cost, sent, read in records:
            minute = int(at // 60)  # a zone's midnight falls on a whole minute
            day = days.get(minute)
            if day is None:
                day = days[minute] = datetime.fromtimestamp(at, self.zone).strftime("%Y-%m-%d")
            team = teams.get(key)
            if team is None:
                team = teams[key] = self.team_of(key) or ""
            group = (day, key or "", team, route, model)
            row = sums.get(group)
            if row is None:
                row = sums[group] = [0] * len(SUMS)
            row[0] += 1
            if cost is None:
                row[3] += 1
            else:
                row[1] += cost
            if saved:
                row[2] += saved
                column = _HOW_COLUMN.get(how)
                if column is not None:
                    row[column] += saved - (prompt_saved if how == BATCH else 0)
            if prompt_saved and how != INFLIGHT and how != CACHE and how != SEMANTIC:
                row[7] += prompt_saved
            if requests_saved:
                row[8] += round(requests_saved * 1_000_000)
            row[9] += sent
            row[10] += read
            row[11] += writes
            row[12] += moved
            row[13] += move_cost
        out = []
        for g, s in sums.items():  # pico-dollars to nano, requests to thousandths; tokens as they are
            out.append((*g, s[0], *(-(-v // 1000) for v in s[1:3]), s[3], *(-(-v // 1000) for v in s[4:8]),
                        -(-s[8] // 1000), s[9], s[10], -(-s[11] // 1000), s[12], -(-s[13] // 1000),
                        -(-s[14] // 1000)))
        return out

    async def report(self, group_by: Sequence[str], since: date | None, until: date | None) -> dict[str, Any]:
        """``GET /admin/spend``'s body: rows by the groups asked for, and the total."""
        await self.flush()  # what this replica has not written yet counts too
        today = self.today()
        first = (since or date(1970, 1, 1)).isoformat()
        last = (until or today + timedelta(days=1)).isoformat()
        store = await self._store()
        rows = await anyio.to_thread.run_sync(store.query, list(group_by), first, last)
        total = await anyio.to_thread.run_sync(store.query, [], first, last)
        return {"rows": rows_json(group_by, rows),
                "total": sums_json(total[0] if total else (0,) * len(SUMS))}

    async def key_rows(self, identity: str, group_by: Sequence[str], since: date,
                       until: date) -> list[tuple[Any, ...]]:
        """One key's sums by ``group_by`` (among day, route, model) over ``since``..``until``: what
        the store has plus what the writer has not written yet, so the figure is current without a
        write. Under the writer's lock: no batch is between the buffer and the store meanwhile."""
        first, last = since.isoformat(), until.isoformat()
        at = [COLUMNS.index(g) for g in group_by]
        async with self._lock:
            pending = self.rows([r for r in self.meter.records if r[1] == identity])
            store = await self._store()
            found = await anyio.to_thread.run_sync(store.query, list(group_by), first, last, identity)
        n = len(group_by)
        sums = {tuple(r[:n]): [int(v or 0) for v in r[n:]] for r in found}
        for row in pending:
            if first <= row[0] <= last:
                into = sums.setdefault(tuple(row[i] for i in at), [0] * len(SUMS))
                for i, v in enumerate(row[len(COLUMNS) - len(SUMS):]):
                    into[i] += v
        return [(*g, *v) for g, v in sorted(sums.items())]

    async def overview(self, days: int = OVERVIEW_DAYS) -> dict[str, Any]:
        """Spend by day (the last ``days``) and by key (this month), every key together: the
        admin's dashboard. Read from the store (what the writer has written, at most its
        ``flush_interval_s`` behind) at most once per ``OVERVIEW_S``, whatever the pages."""
        now = self.clock.now()
        if self._overview is not None and now < self._overview[0] + OVERVIEW_S:
            return self._overview[1]
        today = self.today()
        store = await self._store()
        first, month, last = ((today - timedelta(days=days - 1)).isoformat(),
                              today.replace(day=1).isoformat(), today.isoformat())
        by_day = await anyio.to_thread.run_sync(store.query, ["day"], first, last)
        by_key = await anyio.to_thread.run_sync(store.query, ["key"], month, last)
        out = {"since": first, "month": month[:7], "days": rows_json(["day"], by_day),
               "keys": rows_json(["key"], by_key)}
        self._overview = (now, out)
        return out

    def today(self) -> date:
        """Today in ``budgets.timezone`` (where a daily budget's midnight is)."""
        return datetime.fromtimestamp(self.clock.wall(), self.zone).date()


__all__ = ["GROUPS", "Money"]
