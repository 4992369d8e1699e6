"""One limiter, charged once per upstream request, by the lane; providers only report to it.

A counting limiter shows a provider run on its own charges nothing, and that a batch run by
a lane takes exactly one rpm token per upstream request (packed chunks, retries, a refused
packed request resent per caller), locally and in the replicas' shared state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import respx

from multiplexer.core.call import Item, Outcome
from multiplexer.core.lane import Lane
from multiplexer.core.limiter import Limiter, OnWait, Permit, RateLimiter
from multiplexer.core.policy import BatchPolicy
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.state import LimitSpec
from providers.openai import OpenAIProvider
from tests.remote_helpers import InstantClock, body, chat_reply, embedding_reply, item, make_provider, started

pytestmark = pytest.mark.anyio
BASE = "http://oai.test/v1"
ROOT = Path(__file__).resolve().parent.parent
CHARGES = re.compile(r"limiter\.(admit|acquire|take|consume|ready)\(")


class Clock(InstantClock):
    """Time jumps to whatever is waited for, for the lane's timers too."""

    def wake_at(self, event: Any, deadline: float) -> Any:
        self.t = max(self.t, deadline)
        event.set()
        return self

    def cancel(self) -> None:
        pass


class Counting(RateLimiter):
    """A local limiter that records every charge: ``take`` (the lane's batch) and ``admit``."""

    def __init__(self, clock: Any, rpm: float) -> None:
        super().__init__(clock, rpm=rpm)
        self.charges = 0

    def take(self, tokens: int) -> Permit:
        self.charges += 1
        return super().take(tokens)

    async def admit(self, requests: int = 1, tokens: int = 0, on_wait: OnWait | None = None) -> None:
        self.charges += requests
        await super().admit(requests, tokens, on_wait)


def echo_embeddings(request: httpx.Request) -> httpx.Response:
    inputs = body(request)["input"]
    return httpx.Response(200, json=embedding_reply(inputs, body(request)["model"]))


def refusing_bad(request: httpx.Request) -> httpx.Response:
    if any("BAD" in x for x in body(request)["input"]):
        return httpx.Response(400, json={"error": {"message": "BAD", "type": "invalid_request_error"}})
    return echo_embeddings(request)


def provider(tmp_path: Path, clock: Any, limiter: Limiter, max_inputs: int = 2) -> Any:
    p = make_provider(OpenAIProvider, {"base_url": BASE, "max_inputs": max_inputs}, tmp_path, clock)
    p.ctx.limiter = limiter
    return p


def counted(tmp_path: Path) -> tuple[Clock, Counting, Any]:
    clock = Clock()
    limiter = Counting(clock, rpm=60)
    return clock, limiter, provider(tmp_path, clock, limiter)


async def embed_through_lane(p: Any, clock: Any, limiter: Limiter, handler: Any,
                             inputs: Sequence[Any]) -> tuple[list[Outcome], int]:
    """Embedding calls of ``inputs`` run by a lane against ``handler``: outcomes, requests sent."""
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/embeddings").mock(side_effect=handler)
        async with started(p):
            items = [item(p, "embeddings", {"model": "e", "input": x}) for x in inputs]
            out = await through_lane(p, clock, limiter, items)
    return out, route.call_count


async def through_lane(p: Any, clock: Any, limiter: Limiter, items: Sequence[Item]) -> list[Outcome]:
    policy = BatchPolicy(max_items=100)
    formation = p.formation(policy) or _count(policy)
    lane = Lane("p", p.execute, formation, clock, limiter)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        pending = [lane.submit(i) for i in items]
        out = [await x.future.wait() for x in pending]
        lane.close()
    return out


def test_no_provider_module_charges_a_limiter() -> None:
    sources = [*ROOT.joinpath("providers").rglob("*.py"), *ROOT.joinpath("local_models").rglob("*.py")]
    charging = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in sources
                for m in CHARGES.finditer(path.read_text())]
    assert charging == []


async def test_a_provider_run_alone_charges_nothing(tmp_path: Path) -> None:
    _, limiter, p = counted(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/embeddings").mock(side_effect=echo_embeddings)
        async with started(p):
            out = await p.execute("embeddings", [item(p, "embeddings", {"model": "e", "input": x})
                                                 for x in (["a", "b", "c"], "d")])
    assert all(o.ok for o in out) and route.call_count == 2
    assert limiter.charges == 0 and limiter.requests is not None
    assert limiter.requests.level == 60


@pytest.mark.parametrize(("handler", "inputs", "requests"), [
    (echo_embeddings, [["a", "b", "c"], "d", "e"], 3),  # packed two a request: three chunks
    (refusing_bad, [["good"], ["BAD"], ["fine"]], 4),  # the packed two refused, then one each
])
async def test_each_upstream_request_of_a_lane_batch_takes_one_rpm_token(
        tmp_path: Path, handler: Any, inputs: list[Any], requests: int) -> None:
    clock, limiter, p = counted(tmp_path)
    _, sent = await embed_through_lane(p, clock, limiter, handler, inputs)
    assert sent == requests
    assert limiter.charges == requests
    assert limiter.requests is not None
    assert 60 - limiter.requests.level == pytest.approx(requests, abs=0.1)


async def test_a_retry_is_an_upstream_request_and_takes_its_token(tmp_path: Path) -> None:
    clock, limiter, p = counted(tmp_path)
    replies = iter([httpx.Response(429, headers={"retry-after": "0"}, json={"error": {}}),
                    httpx.Response(200, json=chat_reply("ok"))])
    with respx.mock(base_url=BASE) as mock:
        route = mock.post("/chat/completions").mock(side_effect=lambda r: next(replies))
        async with started(p):
            chat = item(p, "chat", {"model": "g", "messages": [{"role": "user", "content": "hi"}]})
            (out,) = await through_lane(p, clock, limiter, [chat])
    assert out.ok and route.call_count == 2
    assert limiter.charges == 2


class CountedState:
    """A shared state that counts its charges (one request each permit granted)."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.acquired = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    async def acquire_many(self, *args: Any) -> Any:
        got = await self._state.acquire_many(*args)
        self.acquired += got.granted
        return got


async def test_each_upstream_request_takes_one_shared_rpm_token(tmp_path: Path) -> None:
    from tests.test_replicas import close, replicas

    a, b = states = await replicas(2)
    counted = CountedState(a)
    clock = Clock()
    limiter = SharedLimiter(clock, "p", LimitSpec(rpm=3, concurrency=4), counted)  # type: ignore[arg-type]
    p = provider(tmp_path, clock, limiter)
    try:
        with anyio.fail_after(10):
            out, sent = await embed_through_lane(p, clock, limiter, echo_embeddings,
                                                 (["a", "b", "c"], "d", "e"))
        assert all(o.ok for o in out)
        assert sent == 3 and counted.acquired == 3
        assert (await b.acquire("p", "b1", 0, LimitSpec(rpm=3)))[1] == "rpm"  # 3 of 3 spent
        assert limiter.in_flight == 0  # the batch's slot is back
    finally:
        await close(states)


async def test_one_concurrency_cap_for_every_lane_of_a_provider() -> None:
    clock = Clock()
    limiter = RateLimiter(clock, concurrency=1)
    release = anyio.Event()
    ran: list[str] = []

    async def execute(operation: str, items: Sequence[Item]) -> list[Outcome]:
        ran.append(items[0].method)
        await release.wait()
        return [Outcome(result=1) for _ in items]

    policy = BatchPolicy()
    lanes = [Lane(n, execute, _count(policy), clock, limiter) for n in ("p:a", "p:b")]
    async with anyio.create_task_group() as tg:
        for lane in lanes:
            tg.start_soon(lane.run)
        first = lanes[0].submit(Item("a", "call", "a", None))
        second = lanes[1].submit(Item("b", "call", "b", None))
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        assert ran == ["a"] and lanes[1].holding() == "concurrency"  # one slot for both lanes
        release.set()
        await first.future.wait()
        await second.future.wait()
        assert ran == ["a", "b"]
        for lane in lanes:
            lane.close()


def _count(policy: BatchPolicy) -> Any:
    from multiplexer.core.batching import CountFormation

    return CountFormation(policy.max_items, policy.max_wait_ms / 1000.0, policy.max_tokens)


async def test_a_jsonrpc_array_refused_then_sent_singly_takes_a_token_a_request(tmp_path: Path) -> None:
    from providers.jsonrpc import JsonRpcProvider
    from tests.test_jsonrpc_provider import URL, Upstream, items

    clock = Clock()
    limiter = Counting(clock, rpm=60)
    p = make_provider(JsonRpcProvider, {"url": URL, "transport": "httpx"}, tmp_path, clock)
    p.ctx.limiter = limiter
    upstream = Upstream()
    with respx.mock() as mock:
        mock.post(URL).mock(side_effect=upstream)
        async with started(p):
            out = await through_lane(p, clock, limiter, items(3))
    assert [o.result for o in out] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert upstream.shapes == ["array", "single", "single", "single"]
    assert limiter.charges == 4


async def test_a_durable_jobs_tasks_are_not_charged_to_the_lane_batch_that_started_them() -> None:
    """A batch-mode call's job outlives nothing of the lane's charge: the tasks that drive it
    (uploads, polls) start uncharged, and only what opens its own ``Upstream`` is charged."""
    from multiplexer.core.limiter import Upstream, charging, uncharged, upstream_request

    clock = Clock()
    limiter = Counting(clock, rpm=60)
    polled = anyio.Event()

    async def drive() -> None:
        await upstream_request()  # a poll, long after: charges nothing
        with charging(Upstream(limiter, [], paid=False)):  # one request run synchronously
            await upstream_request()
        polled.set()

    async with anyio.create_task_group() as jobs:
        with charging(Upstream(limiter, [])):
            await upstream_request()  # the batch's own request: the lane's permit paid it
            await upstream_request()  # a second request of the batch: charged here
            with uncharged():
                jobs.start_soon(drive)
        await polled.wait()
    assert limiter.charges == 2
