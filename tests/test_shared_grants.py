"""Several permits in one round trip: the shared script grants waiters in order, each all or
none, and a replica hands them out to its waiters; what is not used goes back."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.limiter import Permit, TokenBucket
from multiplexer.core.shared_limiter import MAX_GRANT, NEAR_S, SharedLimiter
from multiplexer.core.state import Granted, LimitSpec
from tests.test_replicas import close, replicas

pytestmark = pytest.mark.anyio


# -- the script, on real Redis ------------------------------------------------------------
async def test_one_script_call_grants_waiters_in_order_up_to_what_the_bucket_holds():
    a, b = states = await replicas(2)
    spec = LimitSpec(rpm=6)
    try:
        got = await a.acquire_many("p", [("", 0)] * 10, spec)
        assert got.granted == 6 and got.limit == "rpm"
        assert 9.0 < got.wait <= 10.0  # the 7th: one request at 6 a minute
        assert (await b.acquire_many("p", [("", 0)] * 3, spec)).granted == 0  # for both replicas
    finally:
        await close(states)


async def test_all_granted_the_answer_says_when_one_more_could_go():
    (a,) = states = await replicas(1)
    try:
        got = await a.acquire_many("p", [("", 0)] * 2, LimitSpec(rpm=3))
        assert (got.granted, got.wait, got.limit) == (2, 0.0, "")  # one request left
        got = await a.acquire_many("p", [("", 0)], LimitSpec(rpm=3))
        assert got.granted == 1 and got.limit == "rpm" and 19.0 < got.wait <= 20.0
    finally:
        await close(states)


async def test_a_waiter_that_must_wait_stops_the_ones_behind_it():
    """Order holds: the second waiter's tokens do not fit, so the third, which would, waits too."""
    (a,) = states = await replicas(1)
    try:
        got = await a.acquire_many("p", [("", 60), ("", 50), ("", 10)], LimitSpec(tpm=100))
        assert got.granted == 1 and got.limit == "tpm"
    finally:
        await close(states)


async def test_each_grant_takes_its_own_slot_and_extra_requests_take_none():
    a, b = states = await replicas(2)
    spec = LimitSpec(concurrency=2)
    try:
        got = await a.acquire_many("p", [("a1", 0), ("", 0), ("a2", 0), ("a3", 0)], spec)
        assert got.granted == 3 and got.limit == "concurrency"  # a1, the extra request, a2
        assert await b.acquire("p", "b1", 0, spec) == (0.001, "concurrency")
        await a.settle("p", "a1", 0.0, [], spec)
        assert await b.acquire("p", "b1", 0, spec) == (0.0, "")
    finally:
        await close(states)


async def test_requests_given_back_can_be_granted_again():
    a, b = states = await replicas(2)
    spec = LimitSpec(rpm=4, tpm=100)
    try:
        assert (await a.acquire_many("p", [("", 25)] * 4, spec)).granted == 4
        await a.settle("p", "", -50.0, [], spec, requests=2)  # two granted, never sent
        got = await b.acquire_many("p", [("", 25)] * 4, spec)
        assert got.granted == 2  # the requests and the tokens of two came back
        got = await b.acquire_many("p", [("", 0)], spec)
        assert got.granted == 0 and got.limit == "rpm"
    finally:
        await close(states)


# -- a replica's waiters, over a driven clock ------------------------------------------------
class Bucket:
    """The script's decision over one rpm bucket on the test's clock, shared by the limiters
    given it: grants in order while a request is left. Counts its calls and what it granted
    and got back, with the time of each."""

    replica_id = "r"
    lease_s = 30.0
    timeout_s = 0.5

    def __init__(self, clock: ManualClock, rpm: float) -> None:
        self.clock = clock
        self.bucket = TokenBucket.per_minute(rpm, clock.now())
        self.calls = 0
        self.granted: list[float] = []  # the time of each grant
        self.back: list[float] = []  # the time of each request given back
        self.freed: list[str] = []
        self.gate: anyio.Event | None = None  # set: the round trip waits for it

    def live_replicas(self) -> int:
        return 1

    async def acquire_many(self, provider: str, asks: Sequence[tuple[str, int]],
                           spec: LimitSpec) -> Granted:
        self.calls += 1
        await anyio.lowlevel.checkpoint()
        if self.gate is not None:
            await self.gate.wait()
        now, n = self.clock.now(), 0
        while n < len(asks) and self.bucket.delay(1, now) == 0:
            self.bucket.consume(1, now)
            self.granted.append(now)
            n += 1
        wait = self.bucket.delay(1, now)
        return Granted(n, wait, "rpm" if wait else "")

    async def settle(self, provider: str, lease_id: str, token_delta: float, learned: object,
                     spec: LimitSpec, requests: int = 0) -> None:
        now = self.clock.now()
        self.bucket.consume(-requests, now)
        self.back += [now] * requests
        if lease_id:
            self.freed.append(lease_id)

    def net_by(self, t: float) -> int:
        """Requests granted and not given back, up to ``t``."""
        return sum(g <= t for g in self.granted) - sum(b <= t for b in self.back)


async def test_one_replica_asks_once_for_the_burst_then_once_per_refill():
    clock = ManualClock()
    state = Bucket(clock, rpm=60)
    limiter = SharedLimiter(clock, "p", LimitSpec(rpm=60), state)  # type: ignore[arg-type]
    order: list[int] = []

    async def one(k: int) -> None:
        await limiter.acquire(0, slot=False)
        order.append(k)

    async with anyio.create_task_group() as tg:
        for k in range(100):
            tg.start_soon(one, k)
        await anyio.wait_all_tasks_blocked()
        # the first waiter asked alone (none behind it yet), the next for MAX_GRANT at once:
        # the rest of the full bucket
        assert MAX_GRANT >= 60 and state.calls == 2 and len(order) == 60
        for _ in range(30 * 4):
            await clock.advance(0.25)
            await anyio.wait_all_tasks_blocked()
        assert len(order) == 90 and state.calls == 2 + 30  # a request a second, one call each
        tg.cancel_scope.cancel()
    assert order == list(range(90))  # in arrival order


async def test_replicas_together_never_exceed_the_bucket_and_lose_none_of_it():
    """Three replicas, 300 waiters, one in seven going away while it waits: at every step the
    requests granted and not given back stay within the bucket (60 at once, then one a second),
    and the waiters left get all of it."""
    clock = ManualClock()
    start = clock.now()
    state = Bucket(clock, rpm=60)
    limiters = [SharedLimiter(clock, "p", LimitSpec(rpm=60), state) for _ in range(3)]  # type: ignore[arg-type]
    received: list[Permit] = []

    async def one(limiter: SharedLimiter, k: int) -> None:
        with anyio.CancelScope() as scope:
            if k % 7 == 3:
                clock.wake_at(_Canceller(scope), start + k / 2)  # gone after k/2 s
            received.append(await limiter.acquire(0))

    async with anyio.create_task_group() as tg:
        for k in range(300):
            tg.start_soon(one, limiters[k % 3], k)
        await anyio.wait_all_tasks_blocked()
        for step in range(1, 120 * 4 + 1):
            await clock.advance(0.25)
            await anyio.wait_all_tasks_blocked()
            assert state.net_by(clock.now()) <= 60 + step * 0.25 + 1e-9
        tg.cancel_scope.cancel()
    assert len(received) == state.net_by(clock.now()) == 60 + 120  # none lost, none over
    # each replica: its first waiter alone, then the burst, then once per refill at most
    assert state.calls <= 3 * (2 + 120)


class _Canceller:
    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope = scope

    def set(self) -> None:
        self.scope.cancel()


async def test_a_waiter_gone_during_the_round_trip_gives_its_grant_back():
    """The first waiter asks for all three; the second goes away before the answer: its
    permit goes back (request and slot), the others get theirs in order."""
    clock = ManualClock()
    state = Bucket(clock, rpm=60)
    state.bucket.consume(60, clock.now())  # empty: the first answer is a wait
    limiter = SharedLimiter(clock, "p", LimitSpec(rpm=60, concurrency=8), state)  # type: ignore[arg-type]
    got: dict[int, Permit] = {}
    scopes = [anyio.CancelScope() for _ in range(3)]

    async def one(k: int) -> None:
        with scopes[k]:
            got[k] = await limiter.acquire(0)

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(one, k)
        await anyio.wait_all_tasks_blocked()
        assert state.calls == 1 and not got
        state.gate = anyio.Event()
        await clock.advance(3.0)  # three requests refilled: the first waiter asks for all three
        await anyio.wait_all_tasks_blocked()
        assert state.calls == 2
        scopes[1].cancel()
        await anyio.wait_all_tasks_blocked()
        state.gate.set()
    await limiter.drain()
    assert sorted(got) == [0, 2] and state.calls == 2
    assert len(state.granted) == 3 and len(state.back) == 1 and state.net_by(clock.now()) == 2
    assert len(state.freed) == 1 and state.freed[0] not in (got[0].id, got[2].id)
    assert limiter._held == {got[0].id, got[2].id}


async def test_a_waiter_whose_callers_give_up_soon_is_served_after_those_with_time():
    """Under overload the oldest waiter is the one about to time out: a permit handed to it is
    mostly a request no one waits for. First in line but within ``NEAR_S`` of its deadline, it
    goes after the others, and is not starved: it is asked for once they have theirs."""
    clock = ManualClock()
    state = Bucket(clock, rpm=60)
    state.bucket.consume(60, clock.now())  # empty: one request a second from now
    limiter = SharedLimiter(clock, "p", LimitSpec(rpm=60), state)  # type: ignore[arg-type]
    order: list[str] = []

    async def one(name: str, deadline: float | None) -> None:
        await limiter.acquire(0, slot=False, deadline=deadline)
        order.append(name)

    now = clock.now()
    async with anyio.create_task_group() as tg:
        for name, deadline in (("soon", now + 1.0 + NEAR_S / 2), ("later", now + 30.0), ("none", None)):
            tg.start_soon(one, name, deadline)
            await anyio.wait_all_tasks_blocked()
        for _ in range(3):
            await clock.advance(1.0)
            await anyio.wait_all_tasks_blocked()
    assert order == ["later", "none", "soon"]
