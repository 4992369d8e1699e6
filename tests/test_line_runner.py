"""The job engine's line runner on its own: no face, no database, a stub gateway. What a line is
as a call and what an outcome is as a row come from the callables a face would hand in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import invalid_params, rate_limited, shutting_down
from multiplexer.jobs.line_runner import LineRunner, Refused, Row

pytestmark = pytest.mark.anyio


@dataclass
class Record:
    id: str
    custom_ids: list[str]
    lane_lines: list[int]
    own_total: int
    cancelled_at: int | None = None
    errors: list[dict[str, Any]] | None = None
    held_until: float | None = None


@dataclass
class Store:
    """Rows and holds in memory, as the job store keeps them."""

    lease_s: float = 30.0
    rows: dict[int, Row] = field(default_factory=dict)
    holds: list[str] = field(default_factory=list)

    def shared(self) -> bool:
        return False

    def opened(self) -> bool:
        return True

    def close(self) -> None: ...

    async def batch(self, batch_id: str, owner: str | None, *, everyone: bool = False) -> Record | None:
        return None

    async def load_lines(self, record: Record) -> Record:
        return record

    async def owed(self) -> list[str]:
        return []

    async def hold(self, batch_id: str, renew: bool = False) -> bool:
        if not renew:
            self.holds.append(batch_id)
        return True

    async def release(self, batch_id: str) -> None:
        self.holds.remove(batch_id)

    async def add_results(self, batch_id: str, rows: Sequence[Row], *, held: bool = False) -> None:
        assert held, "a runner's rows are fenced by its hold"
        for row in rows:
            self.rows.setdefault(row[0], row)

    async def done_lines(self, batch_id: str) -> set[int]:
        return set(self.rows)

    async def result_counts(self, batch_id: str) -> tuple[int, int]:
        return len(self.rows), sum(1 for r in self.rows.values() if r[2] == 200)


class Gateway:
    """Answers ``x * 10``; ``busy`` is rate limited for 5 s once; ``late`` meets a stopping lane."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.sent: list[list[Any]] = []
        self.limited = False

    async def submit_many(self, calls: Sequence[Call]) -> list[Outcome]:
        self.sent.append([c.params["x"] for c in calls])
        out = []
        for c in calls:
            if c.method == "busy" and not self.limited:
                self.limited = True
                out.append(Outcome.fail(rate_limited("rpm", 5.0)))
            elif c.method == "late":
                out.append(Outcome.fail(shutting_down()))
            else:
                out.append(Outcome(result=c.params["x"] * 10))
        return out

    def start_background(self, fn: Any, *args: Any) -> None:
        raise AssertionError("not used here")


def plan(record: Record, body: dict[str, Any]) -> tuple[Call, Any]:
    if "x" not in body:
        raise Refused(invalid_params("no x"))
    return Call(body.get("method", "r"), {"x": body["x"]}), "shaped"


def answer(record: Record, outcome: Outcome, how: Any) -> tuple[int, Any]:
    if outcome.error is not None:
        return 400, {"error": outcome.error.message}
    return 200, {how: outcome.result}


async def no_bodies(record: Record) -> list[dict[str, Any]] | None:
    return None


async def test_the_runner_runs_the_lines_without_a_row_and_waits_out_a_rate_limit():
    clock = ManualClock()
    store, gw = Store(), Gateway(clock)
    store.rows[0] = (0, "a", 200, {"saved": True})  # ran before a restart: not again
    bodies = [{"x": 0}, {"x": 1, "method": "busy"}, {}, {"x": 3}]
    record = Record("b1", ["a", "b", "c", "d"], [0, 1, 2, 3], 4)
    runner = LineRunner(gw, store, plan, answer, no_bodies)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run_lines, record, bodies, runner.reserve(record))
        await anyio.wait_all_tasks_blocked()
        assert gw.sent == [[1, 3]] and "b1" in runner.live  # line 1 waits its retry_after
        await clock.advance(5.0)
    assert gw.sent == [[1, 3], [1]]
    assert store.rows == {0: (0, "a", 200, {"saved": True}), 1: (1, "b", 200, {"shaped": 10}),
                          2: (2, "c", 400, {"error": "Invalid params"}),
                          3: (3, "d", 200, {"shaped": 30})}
    assert runner.live == {} and store.holds == []  # its hold let go
    counts = await runner.counts(record)
    assert (counts.ended, counts.succeeded, counts.done) == (4, 3, True)
    assert not await runner.owes(record)


async def test_lines_a_stopping_gateway_did_not_run_are_left_without_a_row():
    store, gw = Store(), Gateway(ManualClock())
    record = Record("b2", ["a", "b"], [0, 1], 2)
    runner = LineRunner(gw, store, plan, answer, no_bodies)
    await runner.run_lines(record, [{"x": 1}, {"x": 2, "method": "late"}], runner.reserve(record))
    assert store.rows == {0: (0, "a", 200, {"shaped": 10})}
    assert await runner.owes(record) and not (await runner.counts(record)).done


async def test_the_store_is_let_go_only_after_the_loops_beside_the_runner_have_stopped():
    """The retention purge runs beside the runner on the same store: at shutdown, a query of its
    still in a thread ends before the store closes (a closed SQLite connection refused it)."""
    import threading

    order: list[str] = []
    in_query, release, closed = threading.Event(), threading.Event(), threading.Event()

    class Closing(Store):
        def close(self) -> None:
            order.append("store closed")
            closed.set()

    def query() -> None:  # a purge's query, in the store's thread
        in_query.set()
        release.wait(5)
        order.append("query ended")

    async def purge() -> None:
        await anyio.to_thread.run_sync(query)
        await anyio.lowlevel.checkpoint()  # its next step: cancelled there
        order.append("purge went on")

    runner = LineRunner(Gateway(ManualClock()), Closing(), plan, answer, no_bodies)
    stop = anyio.CancelScope()

    async def gateway_lifetime() -> None:
        with stop:
            await runner.run(False, [purge])

    async with anyio.create_task_group() as tg:
        tg.start_soon(gateway_lifetime)
        assert await anyio.to_thread.run_sync(in_query.wait, 5)
        stop.cancel()  # the gateway closes while the query runs
        assert not await anyio.to_thread.run_sync(closed.wait, 0.5)  # the store stays open
        release.set()
    assert order == ["query ended", "store closed"]


class Stuck(Gateway):
    """A page that runs until cancelled: ``running`` once sent, ``cancelled`` once called off."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.running, self.cancelled = anyio.Event(), anyio.Event()

    async def submit_many(self, calls: Sequence[Call]) -> list[Outcome]:
        self.sent.append([c.params["x"] for c in calls])
        self.running.set()
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled.set()
        raise AssertionError("unreachable")


@dataclass
class Renewals(Store):
    """Renewals answer ``renewed`` in turn (an exception is raised: the store is away)."""

    renewed: list[bool | Exception] = field(default_factory=list)
    asked: int = 0

    async def hold(self, batch_id: str, renew: bool = False) -> bool:
        if not renew:
            return await super().hold(batch_id)
        answer = self.renewed[min(self.asked, len(self.renewed) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


async def settle(clock: ManualClock, seconds: float) -> None:
    """Move time on, then let every task it woke run until all wait again."""
    await clock.advance(seconds)
    await anyio.wait_all_tasks_blocked()


async def test_a_runner_whose_renewals_fail_stops_its_page_at_the_holds_deadline():
    """Its store connection broke while the database is up for the others: past the hold's
    deadline another replica may take the batch, so the running page is called off there."""
    clock = ManualClock()
    store, gw = Renewals(lease_s=30.0, renewed=[OSError("connection lost")]), Stuck(clock)
    record = Record("b3", ["a", "b"], [0, 1], 2)
    runner = LineRunner(gw, store, plan, answer, no_bodies)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run_lines, record, [{"x": 1}, {"x": 2}], runner.reserve(record))
        await gw.running.wait()
        await anyio.wait_all_tasks_blocked()  # its renewals are set for every 10 s
        await settle(clock, 10.0)
        await settle(clock, 10.0)
        assert store.asked == 2 and not gw.cancelled.is_set()  # two renewals failed: still held
        await settle(clock, 9.9)
        assert not gw.cancelled.is_set()
        await settle(clock, 0.1)  # the deadline: 30 s after the hold was asked for
        with anyio.fail_after(5):
            await gw.cancelled.wait()
    assert gw.sent == [[1, 2]] and store.rows == {}
    assert runner.live == {} and store.holds == []  # stopped, and let go


async def test_a_renewal_that_succeeds_moves_the_deadline_and_a_refused_one_stops_the_page():
    clock = ManualClock()
    store, gw = Renewals(lease_s=30.0, renewed=[OSError("away"), True, False]), Stuck(clock)
    record = Record("b4", ["a"], [0], 1)
    runner = LineRunner(gw, store, plan, answer, no_bodies)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run_lines, record, [{"x": 1}], runner.reserve(record))
        await gw.running.wait()
        await anyio.wait_all_tasks_blocked()  # its renewals are set for every 10 s
        for _ in range(2):  # at 10 s away, at 20 s renewed: the deadline is 50 s
            await settle(clock, 10.0)
        assert store.asked == 2
        await settle(clock, 9.5)  # 29.5 s
        store.renewed[2] = True  # (the 30 s renewal succeeds too)
        await settle(clock, 1.0)  # 30.5 s: past the first deadline, still held
        assert not gw.cancelled.is_set() and store.asked == 3
        store.renewed.append(False)  # the next renewal: the batch is another gateway's now
        await settle(clock, 10.0)
        with anyio.fail_after(5):
            await gw.cancelled.wait()
    assert store.asked == 4 and runner.live == {} and store.rows == {}


async def test_a_page_the_store_refuses_for_a_lost_hold_ends_the_run_without_failing_lines():
    """A fenced insert refused (``HoldLost``): the lines are another gateway's to answer, not
    failed here."""
    from multiplexer.jobs.line_runner import HoldLost

    class Lost(Store):
        async def add_results(self, batch_id: str, rows: Sequence[Row], *, held: bool = False) -> None:
            assert held
            raise HoldLost(batch_id)

    store, gw = Lost(), Gateway(ManualClock())
    record = Record("b5", ["a", "b"], [0, 1], 2)
    runner = LineRunner(gw, store, plan, answer, no_bodies)
    await runner.run_lines(record, [{"x": 1}, {"x": 2}], runner.reserve(record))
    assert gw.sent == [[1, 2]] and store.rows == {} and runner.live == {} and store.holds == []
