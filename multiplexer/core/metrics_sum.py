"""One gateway's metrics from several worker processes: their expositions summed into one.

Each worker keeps its own registry (prometheus-client's and the plain metrics of
``core/plain_metrics.py`` alike) and renders it as text; this adds them up sample by sample,
so an operator scraping any worker sees the gateway as a whole. Counters, histograms (bucket
by bucket, sum and count) and per-process gauges (queue depth, calls in flight) add up; the
gauges every worker reads from the one job store would count it N times, so they take the
largest value instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# gauges read from a store the workers share: the same number in each, not a part of it
SAME_IN_EVERY_WORKER = frozenset({"multiplexer_batch_jobs_open", "multiplexer_batch_items"})

Key = tuple[str, tuple[tuple[str, str], ...]]


class _Summed:
    """A collector handing the summed families to ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def sum_expositions(texts: Iterable[str | bytes]) -> bytes:
    """The Prometheus text exposition of the sum of ``texts`` (each one worker's)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[Key, float]] = {}
    for text in texts:
        raw = text.decode() if isinstance(text, bytes) else text
        for family in text_string_to_metric_families(raw):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            held = values[family.name]
            largest = family.name in SAME_IN_EVERY_WORKER
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = held.get(key)
                if before is None:
                    held[key] = sample.value
                else:
                    held[key] = max(before, sample.value) if largest else before + sample.value
    out = []
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
        out.append(family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Summed(out))  # type: ignore[arg-type]
    return generate_latest(registry)
