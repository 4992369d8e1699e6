"""A provider's limits (requests and tokens per minute, concurrency) behind one interface.

``Limiter`` is what a lane charges, once per upstream request: ``RateLimiter`` here keeps
the buckets in this process, ``core/shared_limiter.SharedLimiter`` keeps them in the
replicas' shared state. A provider never charges: it reports what it learns (rate-limit
headers: ``observe``, real usage: ``correct_tokens``, a 429's Retry-After: ``pause``),
and the further requests of a batch (a packed batch's next chunk, a retry) are charged
by the lane's ``Upstream``, which the provider's HTTP client asks before each request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from multiplexer.core.call import Item
from multiplexer.core.clock import Clock

OnWait = Callable[[str | None], None]  # told the limit a request waits for, then None when it goes


def holding(items: Sequence[Item]) -> OnWait:
    """An ``on_wait`` that marks ``items`` with the limit they wait for (``Item.held``), so a
    deadline that ends the wait says which limit it was, not that the upstream was slow."""

    def on_wait(limit: str | None) -> None:
        for item in items:
            item.held = limit

    return on_wait


@dataclass(slots=True)
class Permit:
    """One upstream request's charge: a request, ``tokens`` and (with ``slot``) one of this
    process's concurrency slots, until ``finish``. ``held``, ``id`` and ``shared``: a lease on
    a slot in the replicas' shared state (``SharedLimiter``)."""

    tokens: int = 0
    slot: bool = True
    held: bool = False
    id: str = ""
    shared: bool = False
    deadline: float | None = None  # the last of its callers' deadlines (None: one has none)
    key: str = ""  # a named limit's (a tool's) set in the shared state; "" the provider's own


class Limiter(Protocol):
    """rpm, tpm and concurrency of one provider, local or shared; the lane is its one charger.

    The lane's step asks ``full`` and ``delay``, then ``take``s a permit for the batch (the
    local charge, decided at once); its worker awaits ``ready`` (the shared charge, one round
    trip; nothing more for a local limiter) before the provider runs, and ``finish``es it after.
    ``admit`` charges a batch's further requests (no slot: the batch holds one)."""

    concurrency: int  # 0: no cap

    def full(self) -> bool: ...

    def delay(self, requests: int, tokens: int) -> tuple[float, str]: ...

    def take(self, tokens: int) -> Permit: ...

    async def ready(self, permit: Permit, on_wait: OnWait | None = None) -> None: ...

    def finish(self, permit: Permit) -> None: ...

    def on_release(self, wake: Callable[[], None]) -> None: ...

    async def admit(self, requests: int = 1, tokens: int = 0, on_wait: OnWait | None = None) -> None: ...

    def correct_tokens(self, estimated: int, actual: int) -> None: ...

    def pause(self, seconds: float) -> None: ...

    def observe(self, kind: str, limit: float | None, remaining: float, reset_in: float) -> None: ...

    def named(self, scope: str, rules: Sequence[tuple[str, float | None, int]],
              matches: Callable[[str, str], bool]) -> NamedLimits: ...


class Upstream:
    """The upstream requests of one lane batch: the lane charged the first (its permit); each
    further one is charged here through the same limiter, rpm only, while the batch runs."""

    __slots__ = ("items", "limiter", "open", "paid", "tokens")

    def __init__(self, limiter: Limiter, items: Sequence[Item], *, paid: bool = True,
                 tokens: int = 0) -> None:
        self.limiter = limiter
        self.items = items
        self.paid = paid  # the next request is already charged
        self.tokens = tokens  # charged with the first request when it is not
        self.open = True  # False once the batch has ended: a task it left behind charges nothing

    async def request(self) -> None:
        if not self.open:
            return
        if self.paid:
            self.paid = False
            return
        tokens, self.tokens = self.tokens, 0
        await self.limiter.admit(1, tokens, holding(self.items) if self.items else None)


_UPSTREAM: ContextVar[Upstream | None] = ContextVar("upstream", default=None)


class _Charging:
    """``charging``'s context manager: a class, not a generator's, as every batch enters one."""

    __slots__ = ("token", "upstream")

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def __enter__(self) -> None:
        self.token = _UPSTREAM.set(self.upstream)

    def __exit__(self, *exc: object) -> None:
        _UPSTREAM.reset(self.token)
        self.upstream.open = False


def charging(upstream: Upstream) -> _Charging:
    """Requests sent inside (in this task and the tasks it starts) are charged to ``upstream``."""
    return _Charging(upstream)


@contextmanager
def uncharged() -> Iterator[None]:
    """Requests sent inside are no lane batch's (a durable job's, whose tasks outlive the call
    that started them): charged only where they open their own ``Upstream``."""
    token = _UPSTREAM.set(None)
    try:
        yield
    finally:
        _UPSTREAM.reset(token)


def current_items() -> Sequence[Item]:
    """The items of the lane batch whose requests are being sent now (empty outside one)."""
    upstream = _UPSTREAM.get()
    return upstream.items if upstream is not None else ()


async def upstream_request() -> None:
    """Before each upstream request (first try, next chunk, retry): the charge the lane handed in."""
    upstream = _UPSTREAM.get()
    if upstream is not None:
        await upstream.request()


@dataclass(slots=True)
class TokenBucket:
    """Refills ``rate`` units per second up to ``capacity``.

    What the upstream reports overrides the plan for a while: until ``until`` the
    bucket refills at ``learned`` (fast or slow) so that it is full exactly when the
    upstream says it resets; after that it goes back to ``rate``. A tiny reset thus
    speeds the bucket up for that instant only, and a long one slows it down.
    """

    rate: float
    capacity: float
    level: float
    stamp: float
    learned: float = 0.0
    until: float = 0.0
    ceiling: float | None = None  # the configured limit: learned limits never exceed it

    @classmethod
    def per_minute(cls, amount: float, now: float, *, configured: bool = True) -> TokenBucket:
        return cls(rate=amount / 60.0, capacity=amount, level=amount, stamp=now,
                   ceiling=amount if configured else None)

    def _refill(self, now: float) -> None:
        if now <= self.stamp:
            return
        gain, t = 0.0, self.stamp
        if self.until > t:
            seg = min(now, self.until) - t
            gain, t = seg * self.learned, t + seg
        gain += (now - t) * self.rate
        self.level = min(self.capacity, self.level + gain)
        self.stamp = now

    def delay(self, amount: float, now: float) -> float:
        self._refill(now)
        need = min(amount, self.capacity) - self.level
        if need <= 0:
            return 0.0
        wait = 0.0
        if self.until > now:
            span = self.until - now
            if need <= span * self.learned:
                return need / self.learned
            need -= span * self.learned
            wait = span
        return wait + need / self.rate if self.rate > 0 else math.inf

    def available(self, now: float) -> float:
        """What may be charged now (refilled to ``now``): the dashboard's reading of the bucket."""
        self._refill(now)
        return self.level

    def consume(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def correct(self, delta: float, now: float) -> None:
        """Charge ``delta`` more (or give back, when negative) once a charge's real amount is
        known; what is given back never fills the bucket past its capacity."""
        self._refill(now)
        self.level = min(self.capacity, self.level - delta)

    def observe(self, limit: float | None, remaining: float, reset_in: float, now: float) -> None:
        """Follow what the upstream reports, both ways: its limit, ``remaining`` now, full
        again after ``reset_in``."""
        self._refill(now)
        if limit:
            cap = min(limit, self.ceiling) if self.ceiling else limit
            if cap != self.capacity:
                self.capacity, self.rate = cap, cap / 60.0
                self.level = min(self.level, cap)
        if remaining < self.level:
            self.level = remaining
        if reset_in > 0 and self.level < self.capacity:
            self.learned = (self.capacity - self.level) / reset_in
            self.until = now + reset_in
        else:
            self.until = 0.0


class RateLimiter:
    """Requests and tokens per minute, concurrency, and a hard pause set by 429 / Retry-After,
    in this process."""

    def __init__(self, clock: Clock, rpm: float | None = None, tpm: float | None = None,
                 concurrency: int = 0) -> None:
        self.clock = clock
        now = clock.now()
        self.requests = TokenBucket.per_minute(rpm, now) if rpm else None
        self.tokens = TokenBucket.per_minute(tpm, now) if tpm else None
        self.paused_until = 0.0
        self.concurrency = concurrency
        self.in_flight = 0
        self.share = 1  # the processes enforcing this provider's limits apart (each its part)
        self._wakes: list[Callable[[], None]] = []

    def full(self) -> bool:
        """Every concurrency slot is taken: nothing may go before a ``finish``."""
        return 0 < self.concurrency <= self.in_flight

    def on_release(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever a slot is given back (each lane of the provider asks)."""
        self._wakes.append(wake)

    def take(self, tokens: int) -> Permit:
        """Charge one request, ``tokens`` and a slot now (the caller saw ``delay`` at 0)."""
        self.consume(1, tokens)
        self.in_flight += 1
        return Permit(tokens)

    async def ready(self, permit: Permit, on_wait: OnWait | None = None) -> None:
        """Charged in ``take`` already."""

    def finish(self, permit: Permit) -> None:
        if permit.slot:
            permit.slot = False
            self.in_flight -= 1
            for wake in self._wakes:
                wake()

    def delay(self, requests: int, tokens: int) -> tuple[float, str]:
        """Seconds until a request of this cost may go, and which limit holds it."""
        now = self.clock.now()
        waits = [(self.paused_until - now, "retry_after")]
        if self.requests is not None:
            waits.append((self.requests.delay(requests, now), "rpm"))
        if self.tokens is not None:
            waits.append((self.tokens.delay(tokens, now), "tpm"))
        wait, which = max(waits)
        return max(0.0, wait), which

    def consume(self, requests: int, tokens: int) -> None:
        now = self.clock.now()
        if self.requests is not None:
            self.requests.consume(requests, now)
        if self.tokens is not None:
            self.tokens.consume(tokens, now)

    async def admit(self, requests: int = 1, tokens: int = 0, on_wait: OnWait | None = None) -> None:
        """Wait until a request of this cost may go, then charge it (no slot): a batch's
        further requests, through its ``Upstream``."""
        waited = False
        while True:
            wait, which = self.delay(requests, tokens)
            if wait <= 0:
                self.consume(requests, tokens)
                if waited and on_wait is not None:
                    on_wait(None)
                return
            if on_wait is not None:
                on_wait(which)
                waited = True
            await self.clock.sleep_until(self.clock.now() + wait)

    def correct_tokens(self, estimated: int, actual: int) -> None:
        """Charge (or refund) the difference once the upstream reports real usage."""
        if self.tokens is not None and actual != estimated:
            self.tokens.correct(actual - estimated, self.clock.now())

    def pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, self.clock.now() + seconds)

    def observe(self, kind: str, limit: float | None, remaining: float, reset_in: float) -> None:
        """Learn from upstream headers; creates the bucket when the config had none."""
        now = self.clock.now()
        bucket = self.requests if kind == "requests" else self.tokens
        if bucket is None:
            if not limit or limit <= 0:
                return
            bucket = TokenBucket.per_minute(limit, now, configured=False)
            if kind == "requests":
                self.requests = bucket
            else:
                self.tokens = bucket
        bucket.observe(limit, remaining, reset_in, now)

    def named(self, scope: str, rules: Sequence[tuple[str, float | None, int]],
              matches: Callable[[str, str], bool]) -> NamedLimits:
        """Limits per name (an MCP tool's ``tool_limits``) kept as this provider's are: in this
        process, each of ``share`` workers enforcing its part. ``scope`` names the set (a route's
        own, or the provider's) where the limits are kept apart from this process."""
        return NamedLimits(self.clock, rules, matches, share=self.share)



@dataclass(slots=True)
class NamedLimit:
    """One name's (an MCP tool's) share of its provider's limits: a requests-per-minute bucket and
    a count of its calls in flight; refused, never queued, when either is spent. ``lease``: a
    call's concurrency slot in the replicas' shared state (``SharedNamedLimits``)."""

    rule: str  # the glob that gave these limits, for the refusal's message
    requests: TokenBucket | None
    concurrency: int  # 0: no cap
    in_flight: int = 0
    key: str = ""  # shared: where its limits are kept in the shared state ("" here)
    lease: str = ""


def _part(amount: float | None, share: int) -> float | None:
    return amount / share if amount and share > 1 else amount


class NamedLimits:
    """Limits per name under one provider (``tool_limits``: rpm and concurrency per tool glob), kept
    beside its ``Limiter``'s buckets and charged with the same ``TokenBucket``: a call of a name
    over its share is refused at once (``take`` says why), so it never holds a lane slot waiting.
    Made by the provider's limiter (``Limiter.named``), so they are shared as its limits are: here,
    in this process, each of ``share`` workers of ``serve --workers N`` keeping its part of each
    limit (never the whole); with ``state.url``, ``core/shared_limiter.SharedNamedLimits``."""

    def __init__(self, clock: Clock, rules: Sequence[tuple[str, float | None, int]],
                 matches: Callable[[str, str], bool], share: int = 1) -> None:
        self.clock = clock
        # (glob, rpm, concurrency) as configured, the first glob that matches wins
        self.rules = list(rules)
        self.share = max(1, share)
        self._matches = matches
        self._by_name: dict[str, NamedLimit | None] = {}

    def __bool__(self) -> bool:
        return bool(self.rules)

    def rule_of(self, name: str) -> tuple[str, float | None, int] | None:
        """The first rule whose glob matches ``name``."""
        for rule in self.rules:
            if self._matches(rule[0], name):
                return rule
        return None

    def of(self, name: str) -> NamedLimit | None:
        found = self._by_name.get(name, False)
        if found is not False:
            return found  # type: ignore[return-value]
        limit = None
        rule = self.rule_of(name)
        if rule is not None:
            glob, rpm, concurrency = rule
            rpm = _part(rpm, self.share)
            if concurrency and self.share > 1:
                concurrency = max(1, concurrency // self.share)
            bucket = TokenBucket.per_minute(rpm, self.clock.now()) if rpm else None
            limit = NamedLimit(glob, bucket, concurrency)
        self._by_name[name] = limit
        return limit

    def take(self, name: str) -> tuple[NamedLimit | None, str | None, float]:
        """Charge one call of ``name``: (its limit to ``finish``, None, 0) or, refused, (None, the
        limit spent: ``rpm`` or ``concurrency``, seconds until it may go)."""
        limit = self.of(name)
        if limit is None:
            return None, None, 0.0
        if 0 < limit.concurrency <= limit.in_flight:
            return None, "concurrency", 0.0
        if limit.requests is not None:
            now = self.clock.now()
            wait = limit.requests.delay(1, now)
            if wait > 0:
                return None, "rpm", wait
            limit.requests.consume(1, now)
        limit.in_flight += 1
        return limit, None, 0.0

    async def acquire(self, name: str) -> tuple[NamedLimit | None, str | None, float]:
        """``take``, where the decision may need a round trip (the shared state's)."""
        return self.take(name)

    def finish(self, limit: NamedLimit) -> None:
        limit.in_flight -= 1
