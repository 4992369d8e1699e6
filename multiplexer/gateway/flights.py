"""Single flight, decided at admission: one run per dedup key, in this process or across replicas.

``Gateway.enqueue`` asks ``start`` for every deduplicable call that the cache did not answer:
an identical call in flight here is joined; otherwise ``Flights`` queues the item on its
lane. ``SharedFlights`` (``state.url`` set) first claims the key in the shared state, in a
task of the gateway's: a cached answer ends the call, a won claim queues it here (and then
publishes its result, or frees the key), a held one waits for the replica that runs it (the
state's notify, no polling). If that replica dies or fails its claim ends without a result
and this one claims the key again. Unreachable state: the call runs here (counted).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Hashable
from typing import Any

import anyio

from multiplexer.core.batching import Pending
from multiplexer.core.call import Future, Item, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.dedup import InFlight, canonical
from multiplexer.core.errors import RpcError, shutting_down
from multiplexer.core.lane import Lane
from multiplexer.core.metrics import Metrics
from multiplexer.core.state import SharedState, StateUnavailable
from multiplexer.gateway.idempotency import IdempotencyKey, IdempotencyKeys

Spawn = Callable[..., None]  # runs a coroutine function for the gateway's lifetime


class CachedOutcome(Outcome):
    """An answer from the shared cache: a replica keeps it no longer than it had left there."""

    __slots__ = ("ttl_s",)
    shared = "cache"  # what the caller's call saved: all of it (money/meter.py)

    def __init__(self, result: Any, ttl_s: float) -> None:
        super().__init__(result=result)
        self.ttl_s = ttl_s


class Followed(Outcome):
    """The answer of the identical call another replica ran: this caller's call cost nothing."""

    __slots__ = ()
    shared = "dedup"


def flight_key(key: Hashable) -> str:
    """The dedup key as replicas share it: a digest of what makes two calls the same."""
    return canonical(repr(key))


class Unsent(Outcome):
    """A lane's refusal of a shared flight's run: it never ran, so its callers' batch charges
    go back (as a refusal of ``Lane.submit`` inside ``Gateway.enqueue`` does)."""

    __slots__ = ()


def queue(lane: Lane, p: Pending) -> None:
    """Queue ``p`` on its lane unless its callers have gone; a refusal is its outcome."""
    if p.future.done():
        return
    p.state = "queued"
    try:
        lane.submit(p.item, p)
    except RpcError as e:
        p.future.set(Unsent(error=e))


async def first_of(a: Future, b: Future) -> None:
    """Until either future is done."""
    done = anyio.Event()
    a.add_done_callback(done.set)
    b.add_done_callback(done.set)
    await done.wait()


class Flights:
    """Single flight in this process: the identical call in flight is joined."""

    def __init__(self, clock: Clock) -> None:
        self.inflight = InFlight()
        self.idempotency = IdempotencyKeys(clock)

    def start(self, key: Hashable, item: Item, lane: Lane, cache_ttl_s: float) -> tuple[Pending, bool]:
        """The pending the caller waits on, and whether it joined one already in flight. An
        idempotency key reused with other params while its first call may be in flight or cached
        is refused (-32602)."""
        if isinstance(key, IdempotencyKey):
            deadline = item.deadline if item.deadline is not None else self.idempotency.clock.now()
            self.idempotency.check(key, deadline + cache_ttl_s)
        pending = self.inflight.join(key)
        if pending is not None:
            return pending, True
        pending = self.run(key, item, lane, cache_ttl_s)
        self.inflight.register(key, pending)
        return pending, False

    def run(self, key: Hashable, item: Item, lane: Lane, cache_ttl_s: float) -> Pending:
        return lane.submit(item)

    def release(self, key: Hashable, pending: Pending) -> None:
        self.inflight.release(key, pending)


class SharedFlights(Flights):
    """Single flight across the replicas that share ``state``."""

    def __init__(self, state: SharedState, clock: Clock, metrics: Metrics, spawn: Spawn) -> None:
        super().__init__(clock)
        self.state = state
        self.clock = clock
        self.metrics = metrics
        self._spawn = spawn

    def run(self, key: Hashable, item: Item, lane: Lane, cache_ttl_s: float) -> Pending:
        # queued on the lane once its claim is won
        pending = Pending(item, self.clock.now(), state="claiming")
        self._spawn(self._fly, pending, lane, flight_key(key), cache_ttl_s)
        return pending

    async def _fly(self, p: Pending, lane: Lane, key: str, cache_ttl_s: float) -> None:
        try:
            await self._claim(p, lane, key, cache_ttl_s)
        except BaseException:  # the gateway is closing: its callers are told so, not left waiting
            p.future.set(Outcome.fail(shutting_down()))
            raise

    async def _claim(self, p: Pending, lane: Lane, key: str, cache_ttl_s: float) -> None:
        token = secrets.token_hex(8)
        shared = False
        while not p.future.done():
            p.state = "claiming"
            try:
                kind, value = await self.state.claim(key, token)
            except StateUnavailable:
                self.metrics.state_degraded_count("dedup")
                queue(lane, p)
                return
            if kind == "won":
                await self._lead(p, lane, key, token, cache_ttl_s)
                return
            if not shared:  # one hit per call, however often it claims again
                shared = True
                label = "replica_cache" if kind == "cached" else "replica"
                self.metrics.dedup_hits.labels(p.item.route, label).inc()
            if kind == "cached":
                p.future.set(CachedOutcome(*value))
                return
            p.state = "replica"
            if await self._follow(p, lane, key, value):
                return

    async def _lead(self, p: Pending, lane: Lane, key: str, token: str, cache_ttl_s: float) -> None:
        """Run it here (its own pending on the lane) while keeping the claim alive; publish its
        result, or free the key, before its callers have it: then a replica that asks next finds
        it. Its callers giving up ends the run and frees the key at once."""
        run = p.via = Pending(p.item, self.clock.now())
        try:
            queue(lane, run)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep, key, token)
                await first_of(run.future, p.future)
                tg.cancel_scope.cancel()
        except BaseException:  # the gateway is closing: free the key for the others
            with anyio.CancelScope(shield=True), contextlib.suppress(StateUnavailable):
                await self.state.abandon(key, token)
            raise
        outcome = run.future.outcome() if run.future.done() else p.future.outcome()
        lane.withdraw(run, outcome)  # its callers went: cancelled (nothing if it ran)
        try:
            if outcome.ok:
                await self.state.publish(key, token, outcome.result, cache_ttl_s)
            else:
                await self.state.abandon(key, token)
        except (TypeError, ValueError):  # a result JSON cannot carry: the others run it
            await self.state.abandon(key, token)
        except StateUnavailable:
            self.metrics.state_degraded_count("dedup")
        p.future.set(outcome)

    async def _keep(self, key: str, token: str) -> None:
        while True:
            await self.clock.sleep_until(self.clock.now() + self.state.lease_s / 3)
            with contextlib.suppress(StateUnavailable):
                await self.state.keep(key, token)

    async def _follow(self, p: Pending, lane: Lane, key: str, theirs: str) -> bool:
        """Wait for the replica that holds the key; False when its flight ended without a
        result (it died or failed): the caller then claims the key again."""
        while not p.future.done():
            try:
                ready, value = await self.state.wait(key, theirs, self.state.lease_s)
            except LookupError:
                return False
            except StateUnavailable:
                self.metrics.state_degraded_count("dedup")
                queue(lane, p)
                return True
            if ready:
                p.future.set(Followed(result=value))
        return True
