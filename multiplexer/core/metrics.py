"""Prometheus metrics, one registry per gateway so several can live in one process."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from multiplexer.core.errors import Code

disable_created_metrics()

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

    def call_answered(self, route: str, outcome: str) -> None:
        """``calls`` for one answered call; each (route, outcome) child is looked up once, as
        every call counts here and ``labels()`` costs as much as the rest of counting."""
        child = self._calls.get((route, outcome))
        if child is None:
            child = self._calls[(route, outcome)] = self.calls.labels(route, outcome)
        child.inc()

    def state_degraded_count(self, part: str) -> None:
        self.state_degraded.labels(part).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
