"""Several replicas share provider limits through real Redis: exact, leased, and degraded."""

from __future__ import annotations

import time

import anyio
import pytest

from multiplexer.backends.redis_state import RedisState
from multiplexer.core.call import Call
from multiplexer.core.clock import ManualClock, MonotonicClock
from multiplexer.core.quota import Claim
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.state import Granted, Learned, LimitSpec
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from tests.redis_helpers import REDIS_URL as REDIS
from tests.redis_helpers import own_redis, prefix, redis_url
from tests.test_gateway import Gate

pytestmark = pytest.mark.anyio


async def replicas(n: int, url: str | None = None, lease_s: float = 30.0) -> list[RedisState]:
    url, pre = url or redis_url(), prefix()
    states = [RedisState(url, prefix=pre, lease_s=lease_s) for _ in range(n)]
    for s in states:
        await s.start()
    return states


async def close(states: list[RedisState]) -> None:
    for s in states:
        await s.aclose()


async def test_rpm_and_tpm_hold_for_all_replicas_together():
    a, b = states = await replicas(2)
    spec = LimitSpec(rpm=6, tpm=1000)
    try:
        start = time.monotonic()
        waits = [await (a if i % 2 else b).acquire("p", f"l{i}", 10, spec) for i in range(6)]
        assert waits == [(0.0, "")] * 6
        wait, which = await a.acquire("p", "l6", 10, spec)
        late = time.monotonic() - start  # refilling meanwhile: a busy host takes longer here
        assert which == "rpm" and 9.9 - late < wait <= 10.0  # 6 per minute: the next in 10 s, for both
        assert (await b.acquire("p", "l7", 10, spec))[1] == "rpm"
        assert (await b.acquire("q", "l8", 1000, spec)) == (0.0, "")  # another provider: its own
        assert (await a.acquire("q", "l9", 1, spec))[1] == "tpm"
        await b.settle("q", "l8", -600, [], spec)  # reserved 1000, used 400: 600 back for everyone
        assert await a.acquire("q", "l10", 600, spec) == (0.0, "")
    finally:
        await close(states)


async def test_learned_limits_reach_every_replica():
    a, b = states = await replicas(2)
    spec = LimitSpec()  # nothing configured: all from the headers
    try:
        assert await b.acquire("p", "x", 1, spec) == (0.0, "")
        start = time.monotonic()
        await a.settle("p", "", 0, [Learned("requests", 100, 0, 30.0)], spec)
        wait, which = await b.acquire("p", "y", 1, spec)
        late = time.monotonic() - start  # refilling meanwhile: a busy host takes longer here
        assert which == "rpm" and 0.29 - late < wait <= 0.31  # full again in 30 s: 100/30 per second
    finally:
        await close(states)


async def test_concurrency_slots_are_leases_a_dead_replica_loses():
    a, b = states = await replicas(2, lease_s=2.0)  # b renews every pass: a stall under 2 s loses nothing
    spec = LimitSpec(concurrency=2)
    try:
        assert await a.acquire("p", "a1", 0, spec) == (0.0, "")
        assert await a.acquire("p", "a2", 0, spec) == (0.0, "")
        assert (await b.acquire("p", "b1", 0, spec))[1] == "concurrency"
        await a.settle("p", "a1", 0, [], spec)
        assert await b.acquire("p", "b1", 0, spec) == (0.0, "")
        # a2's replica "dies" (no release, no renewal); b renews b1 and keeps it
        start = time.monotonic()
        while (await b.acquire("p", "b2", 0, spec))[1] == "concurrency":
            await b.renew("p", ["b1"])
            assert time.monotonic() - start < 15, "a dead replica's slot never came back"
            await anyio.sleep(0.05)
        assert time.monotonic() - start >= 1.8  # not before its lease ran out
        assert (await a.acquire("p", "a3", 0, spec))[1] == "concurrency"  # b1 was renewed: still held
    finally:
        await close(states)


async def test_redis_down_each_replica_enforces_its_share_and_shared_mode_comes_back():
    with own_redis() as server:
        a, _ = states = await replicas(2, url=server.url)
        assert a.live_replicas() == 2 or await a.heartbeat() == 2
        spec = LimitSpec(rpm=6000, concurrency=4)
        counted: list[str] = []
        limiter = SharedLimiter(MonotonicClock(), "p", spec, a, on_degraded=counted.append)
        try:
            lease = await limiter.acquire(1)
            assert lease.shared
            await limiter.release(lease)
            server.stop()
            leases = [await limiter.acquire(1) for _ in range(2)]
            assert not any(x.shared for x in leases) and counted == ["limits", "limits"]
            assert limiter._local.requests.capacity == 3000  # half of 6000: two replicas were alive
            assert limiter._slots == 2  # and half the slots
            with anyio.move_on_after(0.2):
                await limiter.acquire(1)  # a third slot: this replica's share is 2
                raise AssertionError("took more than its share of slots")
            for x in leases:
                await limiter.release(x)
            server.start()
            start = time.monotonic()
            while not (lease := await limiter.acquire(1)).shared:
                await limiter.release(lease)
                assert time.monotonic() - start < 5, "shared mode did not come back"
            await limiter.release(lease)
        finally:
            await close(states)


def gateway_config(url: str, pre: str, **limits: object) -> object:
    return parse_config({
        "state": {"url": url, "prefix": pre},
        "providers": {"echo": {"kind": "echo", "limits": limits,
                               "batch": {"max_items": 1, "max_wait_ms": 0}}},
        "routes": {"echo": {"provider": "echo", "dedup": False}},
    })


async def test_two_gateways_share_one_rpm():
    config = gateway_config(redis_url(), prefix(), rpm=5)
    async with Gateway(config) as g1, Gateway(config) as g2:
        out: list[bool] = []

        async def call(gw: Gateway, i: int) -> None:
            out.append((await gw.submit(Call("echo", {"i": i}, timeout_ms=3000))).ok)

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(call, g1 if i % 2 else g2, i)
        upstream = [g.metrics.upstream_requests.labels("echo")._value.get() for g in (g1, g2)]
    assert sum(out) == 5 and sum(upstream) == 5  # one minute's 5 for both gateways, not 5 each


class Counting(Gate):
    """The test_gateway Gate, one per replica; all replicas' runs are counted together."""

    def __init__(self, runs: list[str], gate: anyio.Event) -> None:
        super().__init__()
        self.runs, self.gate = runs, gate


def dedup_config(url: str, pre: str, lease_s: float = 30.0, **route: object) -> object:
    return parse_config({
        "state": {"url": url, "prefix": pre, "lease_s": lease_s},
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1}}},
        "routes": {"r": {"provider": "p", "dedup": True, "dedup_scope": "global", **route}},
    })


async def test_identical_calls_on_two_replicas_run_once_and_each_caller_gets_its_answer():
    config = dedup_config(redis_url(), prefix())
    runs: list[str] = []
    gate = anyio.Event()
    async with Gateway(config, providers={"p": Counting(runs, gate)}) as g1, \
            Gateway(config, providers={"p": Counting(runs, gate)}) as g2:
        out: list[object] = []

        async def call(gw: Gateway) -> None:
            out.append((await gw.submit(Call("r", {"x": 1}))).result)

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(call, g1 if i % 2 else g2)
            hits = [g.metrics.dedup_hits.labels("r", "replica") for g in (g1, g2)]
            while sum(h._value.get() for h in hits) < 1:  # until one replica waits on the other's
                await anyio.sleep(0.01)
            gate.set()
    assert out == [{"x": 1}] * 10 and runs == ["r"]
    assert sum(h._value.get() for h in hits) == 1


async def test_a_dead_replicas_flight_is_taken_over_within_the_lease():
    from multiplexer.core.dedup import canonical
    from multiplexer.gateway.flights import flight_key

    url, pre = redis_url(), prefix()
    dead = RedisState(url, prefix=pre, lease_s=0.5)
    key = flight_key(("r", "r", None, canonical({"x": 2})))
    assert (await dead.claim(key, "dead-replica"))[0] == "won"  # then it "dies": never publishes
    await dead.aclose()
    runs: list[str] = []
    gate = anyio.Event()
    gate.set()
    async with Gateway(dedup_config(url, pre, lease_s=0.5),
                       providers={"p": Counting(runs, gate)}) as gw:
        start = time.monotonic()
        outcome = await gw.submit(Call("r", {"x": 2}))
        took = time.monotonic() - start
    assert outcome.result == {"x": 2} and runs == ["r"]
    assert 0.3 <= took < 10.0  # it waited for the dead replica's lease (not forever), then ran the call


async def test_a_flights_waiters_are_woken_by_its_end_not_after_their_timeout():
    """A replica waiting on another's flight is told when it ends: published (the result) or
    abandoned (``LookupError``: it claims the key itself), long before its 30 s wait is up."""
    a, b = states = await replicas(2)
    try:
        for key, end in (("k1", "publish"), ("k2", "abandon")):
            assert (await a.claim(key, "t"))[0] == "won"
            got: list[object] = []

            async def wait(key: str = key, got: list[object] = got) -> None:
                try:
                    got.append(await b.wait(key, "t", 30.0))
                except LookupError:
                    got.append("ended without a result")

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait)
                    for _ in range(3):  # its first look (held), then its blocking read
                        await anyio.wait_all_tasks_blocked()
                    if end == "publish":
                        await a.publish(key, "t", {"x": 1}, 0)
                    else:
                        await a.abandon(key, "t")
            assert got == [(True, {"x": 1})] if end == "publish" else ["ended without a result"]
    finally:
        await close(states)


async def test_the_ttl_cache_is_shared():
    config = dedup_config(redis_url(), prefix(), cache_ttl_s=30)
    runs: list[str] = []
    gate = anyio.Event()
    gate.set()
    async with Gateway(config, providers={"p": Counting(runs, gate)}) as g1, \
            Gateway(config, providers={"p": Counting(runs, gate)}) as g2:
        first = await g1.submit(Call("r", {"x": 3}))
        second = await g2.submit(Call("r", {"x": 3}))
    assert first.result == second.result == {"x": 3} and runs == ["r"]


def quota_config(url: str, pre: str, on_failure: str = "closed", **quota: object) -> object:
    return parse_config({
        "state": {"url": url, "prefix": pre, "on_failure": on_failure},
        "server": {"quotas": {"alice": quota}},
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1}}},
        "routes": {"r": {"provider": "p"}},
    })


async def test_a_keys_quotas_are_shared_by_the_replicas():
    from multiplexer.core.errors import Code, RpcError

    config = quota_config(redis_url(), prefix(), rpm=3, concurrency=1, batch_calls_per_day=5)
    runs: list[str] = []
    gate = anyio.Event()
    async with Gateway(config, providers={"p": Counting(runs, gate)}) as g1, \
            Gateway(config, providers={"p": Counting(runs, gate)}) as g2:
        held: list[object] = []
        async with anyio.create_task_group() as tg:
            async def hold() -> None:
                held.append(await g1.submit(Call("r", {"i": 0}, identity="alice")))

            tg.start_soon(hold)
            while not runs:
                await anyio.sleep(0.01)
            busy = await g2.submit(Call("r", {"i": 1}, identity="alice"))  # g1 holds alice's 1 slot
            gate.set()
        second = await g2.submit(Call("r", {"i": 2}, identity="alice"))
        third = await g1.submit(Call("r", {"i": 3}, identity="alice"))
        fourth = await g2.submit(Call("r", {"i": 4}, identity="alice"))  # 3 per minute, both together
        await g1.quotas.charge("alice", 3)
        with pytest.raises(RpcError) as batch:
            await g2.quotas.charge("alice", 3)  # 3 more > the 2 left of 5 today
    assert held[0].ok and busy.error.data["limit"] == "concurrency"
    assert second.ok and third.ok and fourth.error.code == Code.RATE_LIMITED
    assert fourth.error.data["limit"] == "rpm" and fourth.error.data["retry_after"] > 10
    assert batch.value.data["limit"] == "batch_calls_per_day" and batch.value.data["remaining"] == 2


@pytest.mark.parametrize("on_failure", ["closed", "open"])
async def test_quotas_when_redis_is_down(on_failure):
    with own_redis() as server:
        config = quota_config(server.url, prefix(), on_failure, rpm=100)
        async with Gateway(config) as gw:
            assert (await gw.submit(Call("r", {}, identity="alice"))).ok
            server.stop()
            down = await gw.submit(Call("r", {}, identity="alice"))
            free = await gw.submit(Call("r", {}, identity=None))  # no quota: unaffected
            counted = gw.metrics.state_degraded.labels("quota")._value.get()
    if on_failure == "closed":
        assert down.error.data["limit"] == "quota_unavailable"
    else:
        assert down.ok
    assert free.ok and counted >= 1


async def test_batch_jobs_in_postgres_any_replica_answers_and_one_drives_each_batch(tmp_path):
    from multiplexer.sdk.client import Client
    from multiplexer.server import running
    from tests.pg_helpers import throwaway_db
    from tests.remote_helpers import Events, fakes, remote_config_data, reply_text, user

    with throwaway_db() as db:
        async with fakes() as f:
            data = remote_config_data(f, tmp_path)
            data["store"] = {"url": db}
            config = parse_config(data)
            events = Events()
            async with running(config, port=0) as (g1, url1), running(config, port=0) as (g2, url2):
                g1.listeners.append(events)
                g2.listeners.append(events)
                async with Client(url1) as c1, Client(url2) as c2:
                    job = await c1.call("jobs.submit", {"calls": [
                        {"method": "chat", "params": {"model": "gpt-test", **user(f"q{i}")}}
                        for i in range(3)]})
                    seen = await c2.call("jobs.status", {"job_id": job["job_id"]})  # the other replica
                    await events.wait("batch_job_ended")
                    page = await c2.call("jobs.results", {"job_id": job["job_id"]})
                    listed = await c2.call("jobs.list", {})
    assert seen["total"] == 3
    assert [reply_text(r["result"]) for r in page["results"]] == ["echo: q0", "echo: q1", "echo: q2"]
    assert [j["job_id"] for j in listed["jobs"]] == [job["job_id"]]
    assert len(f.openai.batches) == 1  # driven by one replica, submitted once


async def test_a_replica_that_dies_with_a_batch_running_has_it_taken_over(tmp_path):
    from multiplexer.sdk.client import Client
    from multiplexer.server import running
    from tests.pg_helpers import throwaway_db
    from tests.remote_helpers import Events, fakes, remote_config_data, reply_text, user

    with throwaway_db() as db:
        async with fakes(polls_to_complete=10**9) as f:  # never done while the first replica lives
            data = remote_config_data(f, tmp_path)
            # long enough that a live replica whose loop a loaded host starves keeps its claim
            # while it submits (a lapsed lease mid-submit is a second upstream batch, by design)
            data["store"] = {"url": db, "lease_s": 2.0}
            config = parse_config(data)
            first, second = Events(), Events()
            async with running(config, port=0) as (g2, url2):
                g2.listeners.append(second)
                async with running(config, port=0) as (g1, url1):
                    g1.listeners.append(first)
                    async with Client(url1) as c1:
                        job = await c1.call("jobs.submit", {"calls": [
                            {"method": "chat", "params": {"model": "gpt-test", **user(f"d{i}")}}
                            for i in range(2)]})
                        await first.wait("batch_submitted")
                # the first replica is gone without a word to the database (as if killed)
                f.openai.polls_to_complete = 1
                await second.wait("batch_job_ended")  # the second took the batch over
                async with Client(url2) as c2:
                    page = await c2.call("jobs.results", {"job_id": job["job_id"]})
    assert [reply_text(r["result"]) for r in page["results"]] == ["echo: d0", "echo: d1"]
    assert len(f.openai.batches) == 1  # taken over where it stopped: polled, never resubmitted
    assert not any(e == "batch_submitted" for e, _ in second.seen)


async def test_a_closing_gateway_hands_its_slots_back_at_once():
    a, b = states = await replicas(2)
    spec = LimitSpec(concurrency=1)
    limiter = SharedLimiter(MonotonicClock(), "p", spec, a)
    try:
        lease = await limiter.acquire(0)
        limiter.release_soon(lease)  # settled later by run(), which a closing gateway stops
        assert (await b.acquire("p", "b1", 0, spec))[1] == "concurrency"
        await limiter.drain()  # what Gateway.aclose does before it stops the tasks
        assert await b.acquire("p", "b1", 0, spec) == (0.0, "")
    finally:
        await close(states)


async def test_an_array_of_calls_asks_the_shared_quota_once_per_call_in_parallel():
    config = quota_config(redis_url(), prefix(), rpm=5)
    async with Gateway(config) as g1, Gateway(config) as g2:
        first = await g1.submit_many([Call("r", {"i": i}, identity="alice") for i in range(3)])
        second = await g2.submit_many([Call("r", {"i": i}, identity="alice") for i in range(3)])
    assert [o.ok for o in first] == [True] * 3
    assert sorted(o.ok for o in second) == [False, True, True]  # 5 a minute for both replicas


async def test_requests_a_provider_sends_beyond_its_batch_count_against_the_shared_rpm():
    a, b = states = await replicas(2)
    spec = LimitSpec(rpm=3, concurrency=1)
    limiter = SharedLimiter(MonotonicClock(), "p", spec, a)
    try:
        lease = await limiter.acquire(0)  # the batch: a request and the one slot
        await limiter.admit()  # two extra chunks of it: requests, no slot
        await limiter.admit()
        assert (await b.acquire("p", "b1", 0, LimitSpec(rpm=3)))[1] == "rpm"  # 3 of 3 used
        await limiter.release(lease)
    finally:
        await close(states)


def test_state_and_store_urls_are_checked_at_load():
    from multiplexer.gateway.config import ConfigError

    for data, where in (({"state": {"url": "http://127.0.0.1:6379"}}, "state.url"),
                        ({"store": {"url": "mysql://db/x"}}, "store.url"),
                        ({"state": {"url": "redis://x", "lease_s": 0}}, "lease_s")):
        with pytest.raises(ConfigError) as e:
            parse_config(data)
        assert where in str(e.value)


async def test_three_gateway_processes_share_concurrency_and_dedup():
    """A CI-sized bench_replicas: real `multiplexer serve` processes on one Redis."""
    from benchmarks import bench_replicas as bench

    redis_url()
    with bench.upstream() as (port, up), \
            bench.replicas(3, bench.config(port, REDIS, concurrency=4, prefix=prefix())) as gateways:
        load = bench.Load([g.url for g in gateways])
        async with anyio.create_task_group() as tg:
            for c in range(30):
                tg.start_soon(bench.calls, load, c, 1)
            for _ in range(60):  # 1.5 s upstream: long enough that all 60 overlap on a busy host
                tg.start_soon(load.call, "same", {"key": "d", "ms": 1500})
        await load.aclose()
        stats = bench.stats(up)
    assert load.ok == 90 and load.errors == load.lost == 0
    assert stats["max_in_flight"] <= 4
    assert stats["executions"]["d"] == 1


async def test_v1_quota_headers_come_from_the_shared_quota(tmp_path):
    """Two replicas share alice's 3 rpm: each answer's ``x-ratelimit-*`` counts the calls made
    through both, from the reply of the quota decision itself."""
    import openai

    from multiplexer.server import running
    from tests.remote_helpers import fakes
    from tests.test_v1_openai import KEY, ask, v1_config

    url, pre = redis_url(), prefix()

    def replica(f: object, n: int) -> object:
        data = v1_config(f, tmp_path / str(n), quotas={"alice": {"rpm": 3}})
        data["state"] = {"url": url, "prefix": pre}
        return parse_config(data)

    async def chat(client: openai.AsyncOpenAI, text: str) -> dict[str, str]:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=ask(text))
        assert raw.parse().choices[0].message.content == "echo: " + text
        return dict(raw.headers)

    async with (
        fakes() as f,
        running(replica(f, 1), port=0) as (_, url1),
        running(replica(f, 2), port=0) as (_, url2),
        openai.AsyncOpenAI(base_url=url1 + "/v1", api_key=KEY, max_retries=0) as one,
        openai.AsyncOpenAI(base_url=url2 + "/v1", api_key=KEY, max_retries=0) as two,
    ):
        first, second, third = await chat(one, "a"), await chat(two, "b"), await chat(one, "c")
        with pytest.raises(openai.RateLimitError) as refused:
            await chat(two, "d")
    assert [h["x-ratelimit-limit-requests"] for h in (first, second, third)] == ["3"] * 3
    assert [h["x-ratelimit-remaining-requests"] for h in (first, second, third)] == ["2", "1", "0"]
    reset = float(first["x-ratelimit-reset-requests"].removesuffix("s"))
    assert 0 < reset <= 20  # one request used of 3 per minute: full again within 20 s
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.value.response.headers["retry-after"]) >= 1


class Unreachable:
    """A shared state that never answers: every limit is decided on this replica."""

    replica_id = "down"
    lease_s = 30.0
    timeout_s = 0.5

    def live_replicas(self) -> int:
        return 1

    async def acquire_many(self, *args: object) -> Granted:
        from multiplexer.core.state import StateUnavailable

        raise StateUnavailable("down")


async def test_degraded_slot_waiters_all_get_a_slot_as_slots_free():
    from multiplexer.core.clock import ManualClock

    limiter = SharedLimiter(ManualClock(), "p", LimitSpec(concurrency=1), Unreachable())  # type: ignore[arg-type]
    first = await limiter.acquire(0)
    got: list[object] = []

    async def wait_for_slot() -> None:
        got.append(await limiter.acquire(0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_slot)
        tg.start_soon(wait_for_slot)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # this replica's one slot is held
        limiter.release_soon(first)
        await anyio.wait_all_tasks_blocked()
        assert len(got) == 1
        limiter.release_soon(got[0])  # type: ignore[arg-type]
        await anyio.wait_all_tasks_blocked()
        assert len(got) == 2, "a waiter never woke up although the slot was free"


async def test_a_lowered_batch_allowance_already_spent_today_refuses_more_calls():
    """Replicas restarted with a smaller ``batch_calls_per_day`` than a key already used today:
    nothing is left, so every further call is refused (with 0 remaining), never let through."""
    from multiplexer.core.errors import RpcError
    from multiplexer.core.policy import Quota
    from multiplexer.core.shared_quota import SharedQuotas

    old, new = states = await replicas(2)
    clock = MonotonicClock()
    day = int(clock.wall() // 86_400)
    quotas = SharedQuotas(clock, {"alice": Quota(batch_calls_per_day=3)}, new, fail_open=False,
                          degraded=lambda part: None)
    try:
        assert await old.batch_charge("alice", day, 5, 10) == -1  # under the old allowance of 10
        with pytest.raises(RpcError) as refused:
            await quotas.charge("alice", 1)
        assert refused.value.data["limit"] == "batch_calls_per_day"
        assert refused.value.data["remaining"] == 0
        assert await old.batch_charge("alice", day, 6, 10) == 5  # still 5 used: nothing was charged
    finally:
        await close(states)


async def test_a_batch_call_refused_by_the_keys_rpm_does_not_use_its_batch_allowance():
    """As on one gateway: a call the key's rpm refuses never runs, so it costs none of the key's
    batch calls for the day."""
    from multiplexer.core.errors import Code

    config = parse_config({
        "state": {"url": redis_url(), "prefix": prefix()},
        "server": {"quotas": {"alice": {"rpm": 1, "batch_calls_per_day": 5}}},
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1}}},
        "routes": {"r": {"provider": "p", "mode": "batch"}},
    })
    async with Gateway(config) as gw:
        outs = [await gw.submit(Call("r", {"i": i}, identity="alice")) for i in range(3)]
        day = int(gw.clock.wall() // 86_400)
        left = await gw.state.batch_charge("alice", day, 5, 5)  # type: ignore[union-attr]
    assert outs[0].ok
    assert [o.error.code for o in outs[1:]] == [Code.RATE_LIMITED] * 2  # type: ignore[union-attr]
    assert [o.error.data["limit"] for o in outs[1:]] == ["rpm"] * 2  # type: ignore[union-attr]
    assert left == 4  # one batch call used today: the one that ran


class Flaky(Unreachable):
    """A shared state a test takes down and brings back."""

    up = True

    async def acquire_many(self, provider: str, asks: list[tuple[str, int]], *args: object) -> Granted:
        if self.up:
            return Granted(len(asks), 0.0, "")
        return await super().acquire_many(provider, asks, *args)


async def test_every_redis_outage_starts_this_replicas_share_empty():
    """The shared bucket may have been spent when Redis goes away: the share a replica enforces
    alone starts empty at every outage, not only the first (a later one would send a burst)."""
    from multiplexer.core.clock import ManualClock

    clock, state = ManualClock(), Flaky()
    limiter = SharedLimiter(clock, "p", LimitSpec(rpm=60), state)  # type: ignore[arg-type]
    got: list[object] = []

    async def one() -> None:
        got.append(await limiter.acquire(0))

    async with anyio.create_task_group() as tg:
        for outage in range(2):
            state.up = False
            tg.start_soon(one)
            await anyio.wait_all_tasks_blocked()
            assert len(got) == outage, f"outage {outage + 1} admitted at once: its share was full"
            await clock.advance(1.0)  # one request a second
            await anyio.wait_all_tasks_blocked()
            assert len(got) == outage + 1
            state.up = True
            await clock.advance(1.0)  # past the retry: shared again
            assert (await limiter.acquire(0)).shared
            await clock.advance(120.0)  # shared traffic meanwhile: the local share refills unused
        tg.cancel_scope.cancel()


class Claims:
    """A shared state's single flight: every key is won, except that claiming ``stuck`` never
    answers; what is abandoned is recorded."""

    lease_s = 30.0

    def __init__(self, stuck: str) -> None:
        self.stuck = stuck
        self.abandoned: list[str] = []

    async def claim(self, key: str, token: str) -> tuple[str, object]:
        if key == self.stuck:
            await anyio.sleep_forever()
        return "won", token

    async def abandon(self, key: str, token: str) -> None:
        self.abandoned.append(key)

    async def keep(self, key: str, token: str) -> bool:
        return True


async def test_a_call_whose_callers_go_away_frees_the_key_it_won():
    """Its callers went away (one while its key was still being claimed, one while it ran): the
    key already won is freed at once, so the other replicas waiting on it run the call now, not
    after the lease; the key never won is not touched."""
    from multiplexer.core.batching import CountFormation
    from multiplexer.core.call import Item, Outcome
    from multiplexer.core.clock import ManualClock
    from multiplexer.core.errors import cancelled
    from multiplexer.core.lane import Lane
    from multiplexer.core.limiter import RateLimiter
    from multiplexer.core.metrics import Metrics
    from multiplexer.gateway.flights import SharedFlights, flight_key

    ran: list[object] = []

    async def execute(operation: str, items: object) -> list[Outcome]:
        ran.append(items)
        await anyio.sleep_forever()
        raise AssertionError("cancelled when its caller goes")

    state = Claims(stuck=flight_key(("k", 2)))
    clock = ManualClock()
    lane = Lane("p", execute, CountFormation(1, 0.0), clock, RateLimiter(clock))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        flights = SharedFlights(state, clock, Metrics(), tg.start_soon)  # type: ignore[arg-type]
        pending = [flights.start(("k", i), Item("r", "op", "m", {"i": i}), lane, 0.0)[0]
                   for i in (1, 2)]
        await anyio.wait_all_tasks_blocked()
        assert len(ran) == 1 and state.abandoned == []  # k1 runs, k2 is still being claimed
        for p in pending:
            lane.withdraw(p, Outcome.fail(cancelled("caller went away")))
        await anyio.wait_all_tasks_blocked()
        assert state.abandoned == [flight_key(("k", 1))]
        tg.cancel_scope.cancel()


async def test_a_raised_configured_limit_holds_for_the_shared_bucket_at_once():
    """The replicas restart with a provider's rpm raised from 6 to 600: the shared bucket takes
    the new limit (refilling at 10 a second), as a restarted gateway would, instead of keeping
    the old 6 a minute for as long as traffic keeps the bucket alive."""
    (a,) = states = await replicas(1)
    try:
        for i in range(6):
            assert await a.acquire("p", f"l{i}", 0, LimitSpec(rpm=6)) == (0.0, "")
        assert (await a.acquire("p", "l6", 0, LimitSpec(rpm=6)))[1] == "rpm"
        wait, which = await a.acquire("p", "l7", 0, LimitSpec(rpm=600))
        assert which == "rpm" and wait <= 0.1  # spent, but refilling at 600 a minute
        wait, which = await a.acquire("p", "l8", 0, LimitSpec(rpm=6))  # lowered again: 6 holds
        assert which == "rpm" and wait > 9.0
    finally:
        await close(states)


async def test_a_result_from_the_shared_cache_is_kept_locally_no_longer_than_it_had_left():
    """A replica that answers from the shared cache keeps the answer in its own cache only for
    what the shared entry had left, not for a whole ``cache_ttl_s`` more."""
    from multiplexer.core.clock import ManualClock
    from multiplexer.core.dedup import canonical
    from multiplexer.gateway.flights import flight_key

    url, pre = redis_url(), prefix()
    config = dedup_config(url, pre, cache_ttl_s=30)
    key = f"{pre}:{{f:{flight_key(('r', 'r', None, canonical({'x': 5})))}}}:cache"
    runs: list[str] = []
    gate = anyio.Event()
    gate.set()
    clock = ManualClock()
    async with Gateway(config, providers={"p": Counting(runs, gate)}) as g1, \
            Gateway(config, clock=clock, providers={"p": Counting(runs, gate)}) as g2:
        assert (await g1.submit(Call("r", {"x": 5}))).ok
        redis = g1.state.r  # type: ignore[union-attr]
        assert await redis.pexpire(key, 1000)  # the shared entry has 1 s left
        assert (await g2.submit(Call("r", {"x": 5}))).result == {"x": 5}  # from the shared cache
        assert runs == ["r"]
        await redis.delete(key)  # ... and is gone a second later
        await clock.advance(2.0)
        assert (await g2.submit(Call("r", {"x": 5}))).result == {"x": 5}
    assert runs == ["r", "r"]  # expired everywhere: run again, not answered from g2's cache


class SlowQuota:
    """A shared state that admits the first call of an array and never answers the second."""

    replica_id = "r"
    lease_s = 30.0

    def __init__(self) -> None:
        self.asked = 0
        self.released: list[str] = []

    async def quota(self, identity: str, rpm: float, concurrency: int, lease_id: str,
                    **tpm: object) -> object:
        from multiplexer.core.state import QuotaDecision

        self.asked += 1
        if self.asked > 1:
            await anyio.sleep_forever()
        return QuotaDecision(0.0, "", None, 0.0)

    async def quota_release(self, identity: str, lease_id: str, *tokens: object) -> None:
        self.released.append(lease_id)


async def test_an_array_cancelled_while_its_quota_is_decided_frees_the_slots_it_took():
    """The caller goes away while the shared quota still decides its array: the slots already
    taken for it are freed at once, not held against the key for the whole lease."""
    from multiplexer.core.policy import Quota
    from multiplexer.core.shared_quota import SharedQuotas

    state = SlowQuota()
    quotas = SharedQuotas(MonotonicClock(), {"alice": Quota(concurrency=2)}, state,  # type: ignore[arg-type]
                          fail_open=False, degraded=lambda part: None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(quotas.decide, [Claim("alice"), Claim("alice")])
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    await quotas.flush()
    # r:0 was taken; r:1's reply never came, and it may have taken the slot: both are freed
    assert sorted(state.released) == ["r:0", "r:1"]
    assert not quotas._leases["alice"]  # nothing is left held (or renewed) for the key


class LostReply(Unreachable):
    """A shared state that takes the slots asked for and answers only once the test lets it
    (never, unless it does); what is settled (lease id, requests given back) is recorded."""

    timeout_s = 0.01  # a round trip past twice this is lost

    def __init__(self) -> None:
        self.taken: list[str] = []
        self.settled: list[tuple[str, int]] = []
        self.answer = anyio.Event()

    async def acquire_many(self, provider: str, asks: list[tuple[str, int]], *args: object) -> Granted:
        self.taken += [lease for lease, _ in asks]
        await self.answer.wait()
        return Granted(len(asks), 0.0, "")

    async def settle(self, provider: str, lease_id: str, delta: float, learned: object,
                     spec: object, requests: int = 0) -> None:
        self.settled.append((lease_id, requests))


async def test_a_call_cancelled_while_its_slot_is_taken_gives_its_grant_back():
    """Cancelled during the round trip that takes its concurrency slot (the caller went away):
    the round trip ends all the same (it may carry other waiters' grants), and what it granted
    this caller goes back at once, the slot and the request, rather than held until its lease
    runs out."""
    state = LostReply()
    limiter = SharedLimiter(MonotonicClock(), "p", LimitSpec(rpm=60, concurrency=1), state)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, 0)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
        state.answer.set()
    await limiter.drain()
    assert len(state.taken) == 1 and state.settled == [(state.taken[0], 1)]
    assert not limiter._held and not limiter._queue


async def test_a_round_trip_that_never_ends_is_lost_and_its_slot_freed_later():
    """No answer within twice the state's timeout: the slot it may have taken is an orphan,
    freed once the shared state answers again (the call went away meanwhile)."""
    state = LostReply()
    limiter = SharedLimiter(MonotonicClock(), "p", LimitSpec(concurrency=1), state)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, 0)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert state.settled == []
    await limiter.free_orphans()
    assert state.settled == [(state.taken[0], 0)] and len(state.taken) == 1


class Flapping(SlowQuota):
    """The shared state times out on the first decision of an array and refuses the second."""

    async def quota(self, identity: str, rpm: float, concurrency: int, lease_id: str,
                    **tpm: object) -> object:
        from multiplexer.core.state import QuotaDecision, StateUnavailable

        self.asked += 1
        if self.asked == 1:
            raise StateUnavailable("timeout")
        return QuotaDecision(5.0, "rpm", 0.0, 0.0)


async def test_each_call_of_an_array_gets_its_own_shared_quota_decision():
    """With ``on_failure: open`` the first call, which the shared state could not decide, is
    decided here; the second keeps the shared state's refusal instead of swapping with it."""
    from multiplexer.core.errors import RpcError
    from multiplexer.core.policy import Quota
    from multiplexer.core.shared_quota import SharedQuotas

    quotas = SharedQuotas(MonotonicClock(), {"alice": Quota(rpm=100)}, Flapping(),  # type: ignore[arg-type]
                          fail_open=True, degraded=lambda part: None)
    first, second = await quotas.decide([Claim("alice"), Claim("alice")])
    assert first.refusal is None and first.slot == "local"  # decided locally: admitted
    assert isinstance(second.refusal, RpcError) and second.refusal.data["limit"] == "rpm"


class Refilling(Unreachable):
    """A shared rpm bucket with no tokens until the test hands some out; counts the round trips
    in flight at once."""

    def __init__(self) -> None:
        self.tokens = 0
        self.asks = self.in_flight = self.most_in_flight = 0
        self.lease_s = 30.0

    async def acquire_many(self, provider: str, asks: list[tuple[str, int]], *args: object) -> Granted:
        self.asks += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await anyio.sleep(0)
        self.in_flight -= 1
        granted = min(self.tokens, len(asks))
        self.tokens -= granted
        return Granted(granted, 0.0 if self.tokens else 0.05, "" if self.tokens else "rpm")

    async def settle(self, *args: object) -> None: ...


async def test_one_waiter_per_replica_asks_the_shared_state_while_a_limit_holds():
    """Forty batches waiting for the shared rpm: one of them asks at each refill, in turn, not
    all forty (a herd that stalled busy replicas and then let saved-up tokens go in a burst)."""
    clock = ManualClock()
    state = Refilling()
    limiter = SharedLimiter(clock, "p", LimitSpec(rpm=60), state)  # type: ignore[arg-type]
    got: list[int] = []

    async def one(k: int) -> None:
        await limiter.acquire(0, slot=False)
        got.append(k)

    async with anyio.create_task_group() as tg:
        for k in range(40):
            tg.start_soon(one, k)
        await anyio.wait_all_tasks_blocked()
        first_asks = state.asks
        for _ in range(3):
            state.tokens = 1
            await clock.advance(0.05)
            await anyio.wait_all_tasks_blocked()
        assert got == [0, 1, 2] and state.most_in_flight == 1
        assert state.asks - first_asks == 3  # once per refill: its answer says when the next is
        state.tokens = 10**6
        await clock.advance(0.05)
    assert got == list(range(40)) and state.asks - first_asks == 4  # the rest in one round trip


class TimesOut(Unreachable):
    """An acquire whose answer is lost to a timeout (it may have taken the slot)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.settled: list[str] = []
        self.lease_s = 30.0

    async def acquire_many(self, provider: str, asks: list[tuple[str, int]], *args: object) -> Granted:
        from multiplexer.core.state import StateUnavailable

        self.asked += [lease for lease, _ in asks]
        raise StateUnavailable("timeout")

    async def settle(self, provider: str, lease_id: str, *args: object) -> None:
        self.settled.append(lease_id)

    def live_replicas(self) -> int:
        return 1


async def test_a_timed_out_acquire_runs_locally_and_its_shared_slot_is_freed_later():
    """Taken locally, never held in both places: the slot the lost answer may have taken there
    is freed once the shared state answers again (and the call, were it to ask again, asks under
    a new lease id, which that freeing cannot touch)."""
    state = TimesOut()
    limiter = SharedLimiter(MonotonicClock(), "p", LimitSpec(concurrency=4), state)  # type: ignore[arg-type]
    permit = await limiter.acquire(0)
    assert not permit.shared and state.settled == [] and len(state.asked) == 1
    assert permit.id != state.asked[0]
    await limiter.free_orphans()
    assert state.settled == state.asked
    await limiter.free_orphans()
    assert state.settled == state.asked  # once


async def test_a_batch_call_a_lane_refuses_after_its_shared_flight_won_gives_back_its_batch_charge():
    """As on one gateway: a deduplicable batch call whose claim this replica won, then refused by
    its lane (closed here, a full queue alike), never ran, so its batch charge goes back."""
    from multiplexer.core.errors import Code

    config = parse_config({
        "state": {"url": redis_url(), "prefix": prefix()},
        "server": {"quotas": {"alice": {"batch_calls_per_day": 5}}},
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1}}},
        "routes": {"r": {"provider": "p", "mode": "batch", "dedup": True, "dedup_scope": "global"}},
    })
    async with Gateway(config) as gw:
        for lane in gw.lanes.values():
            lane.close()
        refused = [await gw.submit(Call("r", {"i": i}, identity="alice")) for i in range(2)]
        day = int(gw.clock.wall() // 86_400)
        left = await gw.state.batch_charge("alice", day, 6, 5)  # type: ignore[union-attr]
    assert [o.error.code for o in refused] == [Code.SHUTTING_DOWN] * 2  # type: ignore[union-attr]
    assert left == 5  # refused, reporting all 5 left today: none was used


class Unanswered:
    """A shared state whose claims never answer (Redis slow to reply)."""

    lease_s = 30.0

    async def claim(self, key: str, token: str) -> tuple[str, object]:
        await anyio.sleep_forever()
        raise AssertionError("never answers")


async def test_a_call_timed_out_in_a_shared_flight_reports_the_stage_it_was_in():
    """The deadline's ``stage`` says where the call was: still claiming its key, waiting for the
    replica that runs it, or running here as the flight's leader."""
    config = dedup_config(redis_url(), prefix())
    runs: list[str] = []
    gate = anyio.Event()
    clock = ManualClock()
    out: dict[str, object] = {}
    async with Gateway(config, clock=clock, providers={"p": Counting(runs, gate)}) as g1, \
            Gateway(config, clock=clock, providers={"p": Counting(runs, gate)}) as g2, \
            Gateway(config, clock=clock, providers={"p": Counting(runs, gate)}) as g3:
        g3.flights.state = Unanswered()  # type: ignore[attr-defined]

        async def call(name: str, gw: Gateway) -> None:
            out[name] = await gw.submit(Call("r", {"x": 9}, timeout_ms=1000))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "leader", g1)
                while not runs:  # g1 won the key and runs the call
                    await anyio.sleep(0.01)
                tg.start_soon(call, "follower", g2)
                tg.start_soon(call, "claiming", g3)
                while g2.metrics.dedup_hits.labels("r", "replica")._value.get() < 1:
                    await anyio.sleep(0.01)  # until g2 waits on g1's flight
                await anyio.wait_all_tasks_blocked()
                await clock.advance(2.0)  # every deadline passes
                while len(out) < 3:
                    await anyio.sleep(0.01)
                gate.set()
    stages = {name: o.error.data["stage"] for name, o in out.items()}  # type: ignore[attr-defined]
    assert stages == {"leader": "running", "follower": "replica", "claiming": "claiming"}


class Down(SlowQuota):
    """A shared state that never answers a quota decision."""

    async def quota(self, identity: str, rpm: float, concurrency: int, lease_id: str,
                    **tpm: object) -> object:
        from multiplexer.core.state import StateUnavailable

        raise StateUnavailable("down")


async def test_a_keys_tpm_decided_here_while_the_shared_state_is_down_and_quotas_fail_open():
    from multiplexer.core.policy import Quota
    from multiplexer.core.quota import LOCAL
    from multiplexer.core.shared_quota import SharedQuotas

    quotas = SharedQuotas(ManualClock(), {"alice": Quota(tpm=100)}, Down(),  # type: ignore[arg-type]
                          fail_open=True, degraded=lambda part: None)
    first, second = await quotas.decide([Claim("alice", tokens=60), Claim("alice", tokens=60)])
    assert first.refusal is None and (first.slot, first.tokens) == (LOCAL, 60)
    assert second.refusal is not None and second.refusal.data["limit"] == "tpm"
    quotas.release(first, 10)  # settled on this replica's own bucket: 90 left
    assert (await quotas.decide([Claim("alice", tokens=60)]))[0].refusal is None
