"""The gateway's call path with an injected clock and provider: deadlines, dedup, cache, shutdown."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code, invalid_params
from multiplexer.core.provider import Provider, ProviderContext
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway

pytestmark = pytest.mark.anyio


class Gate(Provider):
    """Runs nothing until the test opens the gate; counts executions per method."""

    def __init__(self, ctx: ProviderContext | None = None) -> None:
        self.name = "p"
        self.gate = anyio.Event()
        self.runs: list[str] = []

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        self.runs.extend(i.method for i in items)
        await self.gate.wait()
        return [Outcome.fail(invalid_params("bad")) if i.method == "bad"
                else Outcome(result=i.params) for i in items]


def config(**route: object) -> object:
    return parse_config({
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1},
                            "limits": {"concurrency": 1}}},
        "routes": {"r": {"provider": "p", **route}, "bad": {"provider": "p", "dedup": True},
                   "*": {"provider": "p"}},
    })


async def test_deadline_in_queue_and_in_flight_report_their_stage() -> None:
    clock, prov = ManualClock(), Gate()
    async with Gateway(config(), clock=clock, providers={"p": prov}) as gw:
        out: dict[str, Outcome] = {}

        async def call(name: str, timeout: float) -> None:
            out[name] = await gw.submit(Call("r", {"n": name}, timeout_ms=timeout))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "first", 1000)
            await clock.advance(0)
            tg.start_soon(call, "second", 500)
            await clock.advance(0)
            await clock.advance(0.5)
            await clock.advance(0.5)
        assert out["second"].error.code == Code.TIMEOUT  # it waited for the one slot
        assert out["second"].error.data == {"stage": "rate_limit", "limit": "concurrency",
                                            "provider": "p"}
        assert out["first"].error.data == {"stage": "running"}
        assert prov.runs == ["r"]  # the queued call never went upstream


async def test_dedup_waiters_share_one_run_errors_reach_all_and_timeouts_are_per_caller() -> None:
    clock, prov = ManualClock(), Gate()
    async with Gateway(config(dedup=True), clock=clock, providers={"p": prov}) as gw:
        results: list[Outcome] = []

        async def call(method: str, timeout: float) -> None:
            results.append(await gw.submit(Call(method, {"x": 1}, timeout_ms=timeout)))

        async with anyio.create_task_group() as tg:
            for timeout in (10_000, 10_000, 100):
                tg.start_soon(call, "r", timeout)
            await clock.advance(0)
            await clock.advance(0.1)  # the impatient caller leaves; the run goes on
            assert [o.error.code for o in results] == [Code.TIMEOUT]
            prov.gate.set()
        assert [o.result for o in results[1:]] == [{"x": 1}, {"x": 1}]
        assert prov.runs == ["r"]
        results.clear()
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(call, "bad", 10_000)
        assert [o.error.code for o in results] == [Code.INVALID_PARAMS] * 3
        assert prov.runs == ["r", "bad"]


async def test_ttl_cache_serves_until_expiry() -> None:
    clock, prov = ManualClock(), Gate()
    prov.gate.set()
    async with Gateway(config(dedup=True, cache_ttl_s=10), clock=clock,
                       providers={"p": prov}) as gw:
        for _ in range(3):
            assert (await gw.submit(Call("r", {"k": 1}))).result == {"k": 1}
        assert prov.runs == ["r"]
        await clock.advance(11)
        await gw.submit(Call("r", {"k": 1}))
        assert prov.runs == ["r", "r"]
        assert (await gw.submit(Call("r", {"k": 2}))).ok and prov.runs == ["r", "r", "r"]


async def test_shutdown_fails_what_cannot_finish_and_refuses_new_calls() -> None:
    clock, prov = ManualClock(), Gate()
    gw = Gateway(config(), clock=clock, providers={"p": prov})
    out: list[Outcome] = []
    async with anyio.create_task_group() as tg:
        await gw.__aenter__()

        async def call() -> None:
            out.append(await gw.submit(Call("r", {})))

        for _ in range(3):
            tg.start_soon(call)
        await clock.advance(0)
        await gw.aclose(grace=0)
    assert len(out) == 3 and all(o.error.code == Code.SHUTTING_DOWN for o in out)
    late = await gw.submit(Call("r", {}))
    assert late.error.code == Code.SHUTTING_DOWN


@pytest.mark.parametrize("finish_in_time", [True, False])
async def test_shutdown_waits_the_grace_period_on_the_clock_for_in_flight_calls(finish_in_time: bool) -> None:
    """aclose waits for each lane to say it drained, against the injected clock (no polling)."""
    clock, prov = ManualClock(), Gate()
    gw = Gateway(config(), clock=clock, providers={"p": prov})
    out: list[Outcome] = []
    closed = anyio.Event()
    async with anyio.create_task_group() as tg:
        await gw.__aenter__()

        async def call() -> None:
            out.append(await gw.submit(Call("r", {"n": 1})))

        async def drive() -> None:
            await clock.advance(4.9)
            assert not closed.is_set() and out == []  # still within the grace period
            if finish_in_time:
                prov.gate.set()
            else:
                await clock.advance(0.2)

        tg.start_soon(call)
        await clock.advance(0)
        tg.start_soon(drive)
        started = anyio.current_time()
        await gw.aclose(grace=5)
        # the grace period is 5 s of the manual clock: no real time passes waiting for it
        assert anyio.current_time() - started < 3
        closed.set()
    assert len(out) == 1
    if finish_in_time:
        assert out[0].result == {"n": 1}
    else:
        assert out[0].error.code == Code.SHUTTING_DOWN


async def test_wildcard_route_and_unknown_method() -> None:
    prov = Gate()
    prov.gate.set()
    async with Gateway(config(), providers={"p": prov}) as gw:
        assert (await gw.submit(Call("anything", [1]))).result == [1]
        assert prov.runs == ["anything"]
        tools = {t.name for t in await gw.list_tools()}
        assert {"r", "bad"} <= tools
    exact_only = parse_config({"providers": {"p": {"kind": "echo"}}, "routes": {"r": {"provider": "p"}}})
    async with Gateway(exact_only, providers={"p": prov}) as gw:
        unknown = await gw.submit(Call("anything", [1]))
    assert unknown.error.code == Code.METHOD_NOT_FOUND
    assert prov.runs == ["anything"]  # never reached the provider


async def test_the_jobs_face_housekeeping_runs_on_the_gateways_clock() -> None:
    """The idle-job closer and the retention purge wake on the injected clock (no wall sleeps)."""
    from multiplexer.faces.jobs import JobFace

    clock = ManualClock(start=0.0, wall=1_700_000_000.0)
    prov = Gate()
    async with Gateway(config(), clock=clock, providers={"p": prov}) as gw:
        face = JobFace(gw, {})
        seen: list[tuple[str, float, float]] = []

        async def closing(idle_s: float, now: float | None = None) -> list[str]:
            seen.append(("close", idle_s, clock.wall()))
            return []

        async def purging(retention_s: float, now: float | None = None) -> list[str]:
            seen.append(("purge", retention_s, clock.wall()))
            return []

        face.close_idle, face.purge = closing, purging  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(face.close_idle_forever, 100.0)  # every 25 s
            tg.start_soon(face.purge_forever, 4 * 86_400.0)  # every hour
            await clock.advance(0)
            for _ in range(4):
                await clock.advance(25)
            tg.cancel_scope.cancel()
    wall = 1_700_000_000.0
    assert [s for s in seen if s[0] == "close"] == [("close", 100.0, wall + t) for t in (0, 25, 50, 75, 100)]
    assert [s for s in seen if s[0] == "purge"] == [("purge", 4 * 86_400.0, wall)]


async def test_one_gateway_admits_exactly_its_rpm_bucket_under_five_times_the_load() -> None:
    """rpm 600 offered 50 calls/s for 60 s of the manual clock: the upstream sees the bucket's
    bound in any 60-s window (600 at once, then 10/s: 1,199 after the first), never more, and
    the lane's waits lose no capacity (the bench's replicas are compared with this)."""
    clock, prov = ManualClock(start=0.0), Gate()
    prov.gate.set()
    seen: list[float] = []
    run = prov.execute

    async def execute(operation: str, items: Sequence[Item]) -> list[Outcome]:
        seen.extend(clock.now() for _ in items)
        return await run(operation, items)

    prov.execute = execute  # type: ignore[method-assign]
    conf = parse_config({"providers": {"p": {"kind": "echo", "limits": {"rpm": 600, "concurrency": 64}}},
                         "routes": {"r": {"provider": "p", "timeout_ms": 3000}}})
    async with Gateway(conf, clock=clock, providers={"p": prov}) as gw, anyio.create_task_group() as tg:
        for _ in range(3000):
            tg.start_soon(gw.submit, Call("r", {}))
            await clock.advance(0.02)
        await clock.advance(5)
    seen.sort()
    window = max(sum(1 for t in seen if start <= t < start + 60) for start in seen[:50])
    assert window == 1199 and len(seen) == 1199


def test_an_outcomes_later_result_is_built_once_on_first_read() -> None:
    built: list[int] = []

    def later() -> dict:
        built.append(1)
        return {"n": len(built)}

    outcome = Outcome(result_json=b'{"n":1}', later=later)
    assert built == [] and outcome.ok
    assert outcome.result == {"n": 1} and outcome.result is outcome.result
    assert built == [1]
    assert Outcome(result=[1]).result == [1] and Outcome().result is None


class Ungrouped(Gate):
    """Lets any calls share a batch, as the JSON-RPC provider does (``item.group = None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.batches: list[list[str | None]] = []

    def prepare(self, route: object, item: Item) -> None:
        item.group = None

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        self.batches.append([i.identity for i in items])
        return await super().execute(operation, items)


async def test_a_batch_route_keeps_each_owners_calls_apart_whatever_group_its_provider_sets() -> None:
    """On a ``mode: batch`` route the owner joins the item's group; a provider's group that is not a
    tuple (None: any calls may share a batch) is kept whole, not unpacked."""
    prov = Ungrouped()
    conf = parse_config({"providers": {"p": {"kind": "echo", "batch": {"max_items": 2, "max_wait_ms": 20}}},
                         "routes": {"r": {"provider": "p", "mode": "batch"}}})
    async with Gateway(conf, providers={"p": prov}) as gw:
        out: list[Outcome] = []

        async def call(identity: str) -> None:
            out.append(await gw.submit(Call("r", {"who": identity}, identity=identity)))

        async with anyio.create_task_group() as tg:
            for identity in ("a", "b", "a"):
                tg.start_soon(call, identity)
    assert [o.error for o in out] == [None] * 3
    assert sorted(o.result["who"] for o in out) == ["a", "a", "b"]
    assert sorted(prov.batches) == [["a", "a"], ["b"]]
