"""Prometheus metrics, one registry per gateway so several can live in one process.

Every label value comes from the config or a fixed set (routes, providers, codes), never from
what a client sends: an unknown method or model is the one route ``(no route)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable

import anyio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from multiplexer.core.errors import Code
from multiplexer.core.plain_metrics import Level, Levels, Tally, Timings

disable_created_metrics()

UNROUTED = "(no route)"  # the route label of a call no route took (an unknown method or model)
_KNOWN_CODES = frozenset(int(c) for c in Code)


def code_label(code: int) -> str:
    """An error code as a label value: ours and JSON-RPC's own by number, any other code an
    upstream or client may send as ``other``, so the label set stays bounded whatever they send."""
    return str(code) if code in _KNOWN_CODES else "other"


def status_label(status: int) -> str:
    """An upstream HTTP status as a label value (a status outside 100-599 is ``other``)."""
    return str(status) if 100 <= status <= 599 else "other"

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
_FIRST_CHUNK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A call's seconds from admission to its answer: a cached or local call takes about a
# millisecond, a remote model's seconds, a deadline at most the default 60 s.
_CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITEM_STATES = {"queued": "pending", "submitted": "running", "succeeded": "done", "failed": "failed"}
REFRESH_TIMEOUT_S = 2.0  # a scrape waits no longer for the job store; its gauges keep their last values


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.calls = Counter(
            "multiplexer_calls", "Calls answered, by route and outcome", ["route", "outcome"],
            registry=r,
        )
        self._calls: dict[tuple[str, str], Counter] = {}  # the labelled children
        self.upstream_requests = Counter(
            "multiplexer_upstream_requests", "HTTP or protocol requests sent upstream",
            ["provider"], registry=r,
        )
        self.upstream_batches = Counter(
            "multiplexer_upstream_batches", "Batches handed to a provider", ["provider"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "multiplexer_upstream_errors", "Failed upstream attempts, by kind",
            ["provider", "kind"], registry=r,
        )
        self.retries = Counter(
            "multiplexer_retries", "Upstream retries", ["provider"], registry=r
        )
        self.batch_size = Histogram(
            "multiplexer_batch_size", "Items per upstream batch", ["provider"],
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.time_to_first_chunk = Histogram(
            "multiplexer_time_to_first_chunk_seconds",
            "Streamed calls: seconds from admission to the first chunk sent back", ["route"],
            buckets=_FIRST_CHUNK_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge(
            "multiplexer_queue_depth", "Items waiting in a lane", ["provider"], registry=r
        )
        self.dedup_hits = Counter(
            "multiplexer_dedup_hits", "Calls served by a shared execution or the cache",
            ["route", "kind"], registry=r,
        )
        self.rejections = Counter(
            "multiplexer_rejections", "Calls refused before running", ["provider", "reason"],
            registry=r,
        )
        self.mcp_sessions = Gauge(
            "multiplexer_mcp_sessions", "Open handshake-era MCP sessions over HTTP", registry=r
        )
        self.state_degraded = Counter(
            "multiplexer_state_degraded", "Decisions made locally: the shared state was unreachable",
            ["part"], registry=r,
        )
        self.compute_cpu = Gauge(
            "multiplexer_compute_cpu_seconds",
            "CPU seconds in-process providers spent in model forward passes (the thread running each pass)",
            ["provider", "model"], registry=r,
        )
        self.events = Counter(
            "multiplexer_events", "Notable events (device fallback, restarts, ...)",
            ["component", "event"], registry=r,
        )
        # fallbacks and circuit breakers (docs/fallbacks.md); labels are config names only
        self.attempts = Counter(
            "multiplexer_attempts", "Attempts of calls with fallbacks or breakers, by route and "
            "result (ok, a fallback reason, or client_error)", ["route", "result"], registry=r,
        )
        self.fallbacks = Counter(
            "multiplexer_fallbacks", "Calls moved to another route, by the route left, the one "
            "tried next and why", ["from_route", "to_route", "reason"], registry=r,
        )
        self.breaker_state = Gauge(
            "multiplexer_breaker_state", "Circuit breakers: 0 closed, 1 open, 2 half-open",
            ["endpoint"], registry=r,
        )
        # moved by every call and request: plain numbers, no lock (core/plain_metrics.py)
        self.call_seconds = Timings(
            "multiplexer_call_duration_seconds", "Seconds from a call's admission to its answer",
            "route", _CALL_BUCKETS, r,
        )
        self.calls_in_flight = Levels(
            "multiplexer_calls_in_flight", "Calls admitted and not answered yet", "route", r,
        )
        self.http_requests = Tally(
            "multiplexer_http_requests", "HTTP requests answered, by route (the path's template) "
            "and status; 500: an unexpected exception", ["route", "status"], r,
        )
        self.batch_jobs_open = Gauge(
            "multiplexer_batch_jobs_open", "Batch jobs not ended (the job store's: with store.url, "
            "every replica's)", registry=r,
        )
        self.batch_items = Gauge(
            "multiplexer_batch_items", "Items of the open batch jobs, by state", ["state"], registry=r,
        )
        for state in ITEM_STATES.values():
            self.batch_items.labels(state)
        self.refreshers: dict[Hashable, Callable[[], Awaitable[None]]] = {}  # run before a scrape

    def call_started(self, route: str) -> Level:
        """One more call in flight on ``route``; the caller lowers the level it gets back."""
        level = self.calls_in_flight.of(route)
        level.n += 1
        return level

    def call_answered(self, route: str, outcome: str, seconds: float | None = None,
                      count: int = 1) -> None:
        """``calls`` for answered calls (and the call's duration); each child is looked up once,
        as every call counts here and ``labels()`` costs as much as the rest of counting."""
        child = self._calls.get((route, outcome))
        if child is None:
            child = self._calls[(route, outcome)] = self.calls.labels(route, outcome)
        child.inc(count)
        if seconds is not None:
            self.call_seconds.of(route).observe(seconds)

    def http_answered(self, route: str, status: int) -> None:
        self.http_requests.add((route, status_label(status)))

    def batch_counts(self, open_jobs: int, items: dict[str, int]) -> None:
        """The job store's counts: open jobs, and their items by the store's state."""
        self.batch_jobs_open.set(open_jobs)
        for state, label in ITEM_STATES.items():
            self.batch_items.labels(label).set(items.get(state, 0))

    async def refresh(self) -> None:
        """Bring the gauges read from elsewhere (the job store) up to date, within a bound."""
        with anyio.move_on_after(REFRESH_TIMEOUT_S):
            for refresh in list(self.refreshers.values()):
                await refresh()

    def state_degraded_count(self, part: str) -> None:
        self.state_degraded.labels(part).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
