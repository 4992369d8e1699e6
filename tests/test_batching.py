"""Batch formation decisions (pure) and the lane loop driven by a manual clock."""

from __future__ import annotations

import math
from collections.abc import Sequence

import anyio
import pytest

from multiplexer.core.batching import CountFormation, GroupedQueue, Pending, choose
from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.lane import Lane
from multiplexer.core.limiter import RateLimiter

pytestmark = pytest.mark.anyio


def pend(t: float, priority: int = 0, group: object = None, tokens: int = 1) -> Pending:
    return Pending(Item("r", "call", "m", None, group=group, priority=priority, tokens=tokens), t)


def test_full_batch_leaves_at_once_partial_waits_for_oldest() -> None:
    f = CountFormation(max_items=3, max_wait=0.010)
    assert f.decide([pend(0.0), pend(0.001), pend(0.002)], 0.002).take == (0, 1, 2)
    d = f.decide([pend(0.0), pend(0.004)], 0.005)
    assert d.take == () and d.wait_until == pytest.approx(0.010)
    assert f.decide([pend(0.0), pend(0.004)], 0.010).take == (0, 1)
    assert f.decide([pend(0.0)] * 5, 0.0).take == (0, 1, 2)


def test_token_cap_splits_batches_but_never_starves_a_big_item() -> None:
    f = CountFormation(max_items=10, max_wait=1.0, max_tokens=100)
    q = [pend(0, tokens=60), pend(0, tokens=50), pend(0, tokens=10)]
    assert f.decide(q, 0.0).take == (0,)
    assert f.decide([pend(0, tokens=500)], 2.0).take == (0,)


def test_queue_orders_by_priority_then_arrival_and_groups_apart() -> None:
    q = GroupedQueue(10)
    low, high, late_high = pend(0.0, 0), pend(0.1, 5), pend(0.2, 5)
    other = pend(0.0, 9, group="g2")
    for p in (low, high, late_high, other):
        q.push(p)
    assert q.group(None) == [high, late_high, low]
    group, d = choose(q, CountFormation(2, 0.0), 1.0)
    assert group == "g2" and d.take == (0,)
    assert q.take(None, (0, 1)) == [high, late_high]
    # queued exactly while in the queue: what it hands out is running (formations read that)
    assert (high.state, late_high.state, low.state) == ("running", "running", "queued")
    assert q.remove(low) and len(q) == 1 and not q.remove(low)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = anyio.Event()
        self.block = False

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        self.batches.append([i.method for i in items])
        if self.block:
            await self.release.wait()
        return [Outcome(result=i.method.upper()) for i in items]


def item(name: str, priority: int = 0) -> Item:
    return Item("r", "call", name, None, priority=priority)


async def test_lane_waits_max_wait_then_sends_partial_batch() -> None:
    clock, rec = ManualClock(), Recorder()
    lane = Lane("p", rec.execute, CountFormation(3, 0.5), clock, RateLimiter(clock))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        a, b = lane.submit(item("a")), lane.submit(item("b"))
        await clock.advance(0.4)
        assert rec.batches == []
        await clock.advance(0.1)
        await a.future.wait()
        assert rec.batches == [["a", "b"]]
        assert (await b.future.wait()).result == "B"
        *_, e = (lane.submit(item(n)) for n in "cde")
        await e.future.wait()
        assert rec.batches[-1] == ["c", "d", "e"]  # full: no wait
        assert clock.now() == pytest.approx(1000.5)
        lane.close()


async def test_eager_lane_sends_at_once_when_idle_and_batches_while_busy() -> None:
    clock, rec = ManualClock(), Recorder()
    rec.block = True
    lane = Lane("p", rec.execute, CountFormation(10, 5.0), clock, RateLimiter(clock, concurrency=1),
                eager=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        first = lane.submit(item("a"))
        await clock.advance(0)
        assert rec.batches == [["a"]]
        rest = [lane.submit(item(n)) for n in "bcd"]
        await clock.advance(0)
        assert rec.batches == [["a"]]  # one in flight: the others wait and gather
        rec.release.set()
        await first.future.wait()
        await rest[-1].future.wait()
        assert rec.batches == [["a"], ["b", "c", "d"]]
        lane.close()


async def test_arrivals_at_the_lanes_concurrency_cap_do_not_wake_it() -> None:
    """Nothing can leave while the one batch allowed runs: arrivals do not wake the lane's loop
    (counted by its steps), and the batch's end sends them together."""
    clock, rec = ManualClock(), Recorder()
    rec.block = True
    lane = Lane("p", rec.execute, CountFormation(10, 0.0), clock, RateLimiter(clock, concurrency=1))
    steps = []
    step = lane._step

    def counted(tg: anyio.abc.TaskGroup) -> float:
        steps.append(len(lane.queue))
        return step(tg)

    lane._step = counted  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        first = lane.submit(item("a"))
        await clock.advance(0)
        assert rec.batches == [["a"]]
        before = len(steps)
        rest = []
        for n in "bcdef":  # one by one, each given a turn of the loop, as callers arrive
            rest.append(lane.submit(item(n)))
            await clock.advance(0)
        assert len(steps) == before
        rec.release.set()
        await first.future.wait()
        assert [(await p.future.wait()).result for p in rest] == list("BCDEF")
        assert rec.batches == [["a"], ["b", "c", "d", "e", "f"]]
        lane.close()


async def test_a_worker_starts_the_next_batch_before_the_callers_it_answered_run() -> None:
    """A batch that ends answers its callers, but their replies wait on the event loop: the next
    batch starts first, so the model does not idle while they are written."""
    clock, log, release = ManualClock(), [], anyio.Event()

    async def execute(operation: str, items: Sequence[Item]) -> list[Outcome]:
        log.append(f"start {items[0].method}")
        if items[0].method == "a":
            await release.wait()
        return [Outcome(result=i.method) for i in items]

    async def caller(p: Pending) -> None:
        await p.future.wait()
        log.append(f"answered {p.item.method}")

    lane = Lane("p", execute, CountFormation(1, 0.0), clock, RateLimiter(clock, concurrency=1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        a = lane.submit(item("a"))
        await clock.advance(0)
        b = lane.submit(item("b"))
        tg.start_soon(caller, a)
        tg.start_soon(caller, b)
        await clock.advance(0)
        assert log == ["start a"]  # one in flight: b waits
        release.set()
        await b.future.wait()
        await clock.advance(0)
        assert log == ["start a", "start b", "answered a", "answered b"]
        lane.close()


async def test_full_queue_rejects_with_retry_after_and_close_fails_queued() -> None:
    clock, rec = ManualClock(), Recorder()
    lane = Lane("p", rec.execute, CountFormation(10, 60.0), clock, RateLimiter(clock),
                max_queue=2)
    lane.submit(item("a"))
    queued = lane.submit(item("b"))
    with pytest.raises(RpcError) as err:
        lane.submit(item("c"))
    assert err.value.code == Code.OVERLOADED and err.value.data["retry_after"] > 0
    lane.close(fail_queued=True)
    assert queued.future.outcome().error.code == Code.SHUTTING_DOWN
    with pytest.raises(RpcError) as err:
        lane.submit(item("d"))
    assert err.value.code == Code.SHUTTING_DOWN


async def test_rate_limit_holds_batches_until_tokens_refill() -> None:
    clock, rec = ManualClock(), Recorder()
    limiter = RateLimiter(clock, rpm=60)  # one request a second, burst 60
    limiter.requests.level = 1
    lane = Lane("p", rec.execute, CountFormation(1, 0.0), clock, limiter)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        a, b = lane.submit(item("a")), lane.submit(item("b"))
        await a.future.wait()
        await clock.advance(0.5)
        assert rec.batches == [["a"]] and not b.future.done()
        await clock.advance(0.5)
        await b.future.wait()
        assert rec.batches == [["a"], ["b"]]
        lane.close()


async def test_a_queued_call_past_its_deadline_is_never_sent_even_when_the_lane_wakes_first() -> None:
    """The lane can wake (tokens refilled) before the caller's own timeout fires: what it would
    send then has no caller left to answer, so it leaves the queue unsent; calls still in time go."""
    clock, rec = ManualClock(), Recorder()
    limiter = RateLimiter(clock, rpm=60)  # one request a second
    limiter.requests.level = 1
    lane = Lane("p", rec.execute, CountFormation(1, 0.0), clock, limiter)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        first = lane.submit(item("a"))
        await first.future.wait()
        late = lane.submit(Item("r", "call", "late", None, deadline=clock.now() + 0.5))
        in_time = lane.submit(Item("r", "call", "in_time", None, deadline=clock.now() + 10))
        await clock.advance(2.0)  # two tokens: both would fit, but "late" is past its deadline
        await in_time.future.wait()
        assert rec.batches == [["a"], ["in_time"]]
        assert late.state == "done" and not late.future.done()  # its caller's timeout answers it
        assert len(lane.queue) == 0
        lane.close()


async def test_priority_jumps_the_queue() -> None:
    clock, rec = ManualClock(), Recorder()
    lane = Lane("p", rec.execute, CountFormation(2, 1.0), clock, RateLimiter(clock))
    for name, prio in (("low1", 0), ("low2", 0), ("high", 9)):
        lane.submit(item(name, prio))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        await clock.advance(1.0)
        await clock.advance(1.0)
        assert rec.batches[0] == ["high", "low1"]
        lane.close()


async def test_withdrawn_batch_is_cancelled_upstream() -> None:
    clock, rec = ManualClock(), Recorder()
    rec.block = True
    lane = Lane("p", rec.execute, CountFormation(1, 0.0), clock, RateLimiter(clock))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        p = lane.submit(item("a"))
        await clock.advance(0)
        assert p.state == "running"
        lane.withdraw(p, Outcome.fail(RpcError(Code.CANCELLED, "gone")))
        await clock.advance(0)
        assert lane.in_flight == 0 and p.future.outcome().error.code == Code.CANCELLED
        lane.close()


def test_force_decision_takes_partial_batch() -> None:
    q = GroupedQueue(5)
    q.push(pend(0.0))
    assert choose(q, CountFormation(5, 10.0), math.inf)[1].take == (0,)


async def run_one_slow_batch(lane: Lane, clock: ManualClock, rec: Recorder,
                             seconds: float) -> None:
    """Send one batch that takes ``seconds``, so the lane's moving average has a pace."""
    first = lane.submit(item("a"))
    await clock.advance(0)
    await clock.advance(seconds)
    rec.release.set()
    await first.future.wait()
    rec.release = anyio.Event()


async def test_retry_after_follows_how_fast_the_queue_drains() -> None:
    clock, rec = ManualClock(), Recorder()
    rec.block = True
    lane = Lane("p", rec.execute, CountFormation(1, 0.0), clock, RateLimiter(clock, concurrency=1),
                max_queue=4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        await run_one_slow_batch(lane, clock, rec, 2.0)
        for n in "bcde":
            lane.submit(item(n))
        await clock.advance(0)  # b goes upstream, c d e wait
        lane.submit(item("f"))
        with pytest.raises(RpcError) as err:
            lane.submit(item("g"))
        # four queued, one batch at a time, ~0.4 s a batch on the moving average: >= 1.6 s
        assert err.value.data["retry_after"] == pytest.approx(4 * 0.4, rel=0.01)
        rec.release.set()
        lane.close()


async def test_a_call_the_queue_cannot_serve_before_its_deadline_is_refused_at_once() -> None:
    clock, rec = ManualClock(), Recorder()
    rec.block = True
    lane = Lane("p", rec.execute, CountFormation(1, 0.0), clock, RateLimiter(clock, concurrency=1),
                max_queue=100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        await run_one_slow_batch(lane, clock, rec, 5.0)  # the moving average learns 1 s
        for n in "bcd":  # b runs, c and d wait: about 2 s of queue ahead
            lane.submit(item(n))
        await clock.advance(0)
        patient = Item("r", "call", "e", None, deadline=clock.now() + 10)
        lane.submit(patient)  # fits its deadline: admitted
        hasty = Item("r", "call", "f", None, deadline=clock.now() + 0.5)
        with pytest.raises(RpcError) as err:
            lane.submit(hasty)
        assert err.value.code == Code.OVERLOADED
        assert err.value.data["retry_after"] == pytest.approx(3.0, rel=0.01)
        rec.release.set()
        lane.close()
