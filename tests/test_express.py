"""A lone call on an idle lane runs in its caller's task (``Lane.express``, ``tickets.run_here``):
the same outcome, deadline, limits and exactly-once end as a queued call, without the hand-over."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import pytest

from multiplexer.core.batching import CountFormation
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code
from multiplexer.core.provider import Provider, ProviderContext
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway

pytestmark = pytest.mark.anyio


class Recorder(Provider):
    """Notes the task each batch runs in; holds every batch until its gate opens."""

    def __init__(self, ctx: ProviderContext | None = None) -> None:
        self.name = "p"
        self.gate = anyio.Event()
        self.tasks: list[asyncio.Task | None] = []
        self.cancelled = 0
        self.started = anyio.Event()

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        self.tasks.append(asyncio.current_task())
        self.started.set()
        try:
            await self.gate.wait()
        except BaseException:
            self.cancelled += 1
            raise
        return [Outcome(result=i.params) for i in items]


def config(concurrency: int = 2, **route: object) -> object:
    return parse_config({
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1},
                            "limits": {"concurrency": concurrency}}},
        "routes": {"r": {"provider": "p", **route}},
    })


async def test_a_lone_call_runs_in_its_callers_task_and_a_second_one_queues() -> None:
    prov = Recorder()
    async with Gateway(config(), providers={"p": prov}) as gw:
        out: dict[str, tuple[Outcome, asyncio.Task | None]] = {}

        async def call(name: str) -> None:
            out[name] = (await gw.submit(Call("r", {"n": name}))), asyncio.current_task()

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "first")
            await prov.started.wait()
            tg.start_soon(call, "second")  # the lane is busy: it queues for a worker
            while len(prov.tasks) < 2:
                await anyio.sleep(0)
            prov.gate.set()
        assert out["first"][0].result == {"n": "first"} and out["second"][0].result == {"n": "second"}
        assert prov.tasks[0] is out["first"][1]
        assert prov.tasks[1] is not out["second"][1]
        lane = next(iter(gw.lanes.values()))
        assert lane.in_flight == 0 and gw.limiters["p"].in_flight == 0


async def test_a_deadline_ends_a_call_run_in_its_task_and_frees_its_slot() -> None:
    clock, prov = ManualClock(), Recorder()
    async with Gateway(config(concurrency=1), clock=clock, providers={"p": prov}) as gw:
        out: list[Outcome] = []

        async def call() -> None:
            out.append(await gw.submit(Call("r", {"n": 1}, timeout_ms=500)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await prov.started.wait()
            await clock.advance(0.5)
        assert out[0].error.code == Code.TIMEOUT and out[0].error.data == {"stage": "running"}
        assert prov.cancelled == 1  # the upstream work was cancelled, not left running
        assert gw.limiters["p"].in_flight == 0
        prov.gate.set()
        assert (await gw.submit(Call("r", {"n": 2}))).result == {"n": 2}  # the one slot is free again


async def test_a_caller_that_goes_away_cancels_its_run_and_ends_once() -> None:
    prov = Recorder()
    async with Gateway(config(concurrency=1), providers={"p": prov}) as gw:
        async with anyio.create_task_group() as tg:
            tg.start_soon(gw.submit, Call("r", {"n": 1}))
            await prov.started.wait()
            tg.cancel_scope.cancel()  # the client disconnected
        assert prov.cancelled == 1
        assert gw.limiters["p"].in_flight == 0 and next(iter(gw.lanes.values())).in_flight == 0
        assert gw.metrics.calls_in_flight.of("r").n == 0
        assert {k: c._value.get() for k, c in gw.metrics._calls.items()} == {("r", "-32004"): 1}  # ended once
        prov.gate.set()
        assert (await gw.submit(Call("r", {"n": 2}))).result == {"n": 2}


async def test_calls_of_one_array_and_shared_calls_still_go_through_the_queue() -> None:
    prov = Recorder()
    prov.gate.set()
    async with Gateway(config(concurrency=4), providers={"p": prov}) as gw:
        await anyio.sleep(0)  # the lane's loop is up: an idle lane
        here = asyncio.current_task()
        outs = await gw.submit_many([Call("r", {"n": 1}), Call("r", {"n": 2})])
        assert [o.result for o in outs] == [{"n": 1}, {"n": 2}]
        assert here not in prov.tasks  # an array's calls run at once, not one after the other here
    prov = Recorder()
    prov.gate.set()
    async with Gateway(config(dedup=True), providers={"p": prov}) as gw:
        await anyio.sleep(0)
        assert (await gw.submit(Call("r", {"n": 3}))).result == {"n": 3}
        assert prov.tasks[0] is not asyncio.current_task()  # a flight others may join: a worker runs it


async def test_a_lane_whose_formation_counts_its_running_batches_never_runs_one_in_the_caller() -> None:
    """A gated model's formation must see every batch that runs, so its lane hands none back."""
    from local_models.formation import GatedFormation

    prov = Recorder()
    prov.gate.set()
    gated = GatedFormation(lambda group: (CountFormation(1, 0.0), 1))
    prov.formation = lambda policy: gated  # type: ignore[method-assign]
    async with Gateway(config(), providers={"p": prov}) as gw:
        await anyio.sleep(0)  # the lane's loop is up: an idle lane
        assert (await gw.submit(Call("r", {"n": 1}))).result == {"n": 1}
        assert prov.tasks[0] is not asyncio.current_task()
        assert next(iter(gw.lanes.values())).formation is gated
