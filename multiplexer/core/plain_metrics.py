"""Metrics that every call or request moves, kept in plain numbers and read at scrape time.

prometheus-client's own children take a lock on each change (a histogram's ``observe`` cost
about 1 us here, five times a bisect and two additions). These are changed only on the event
loop's thread, where the gateway answers calls and requests, so they need no lock; a collector
hands them to the registry as ordinary metric families.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString


class Series:
    """One label value's histogram: a count per bucket and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Timings:
    """A histogram with one label."""

    def __init__(self, name: str, doc: str, label: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.buckets = tuple(buckets)
        self.series: dict[str, Series] = {}
        registry.register(self)

    def of(self, value: str) -> Series:
        series = self.series.get(value)
        if series is None:
            series = self.series[value] = Series(self.buckets)
        return series

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.doc, labels=[self.label])

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        for value, series in self.series.items():
            total, buckets = 0, []
            for bound, count in zip((*map(floatToGoString, self.buckets), "+Inf"), series.counts,
                                    strict=True):
                total += count
                buckets.append((bound, float(total)))
            family.add_metric([value], buckets, series.sum)
        yield family


class Level:
    """One label value's gauge, moved by the caller (``n += 1``)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Levels:
    """A gauge with one label."""

    def __init__(self, name: str, doc: str, label: str, registry: CollectorRegistry) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.levels: dict[str, Level] = {}
        registry.register(self)

    def of(self, value: str) -> Level:
        level = self.levels.get(value)
        if level is None:
            level = self.levels[value] = Level()
        return level

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.doc, labels=[self.label])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.doc, labels=[self.label])
        for value, level in self.levels.items():
            family.add_metric([value], level.n)
        yield family


class Tally:
    """A counter with labels, counted by label values."""

    def __init__(self, name: str, doc: str, labels: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.counts: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def add(self, values: tuple[str, ...], amount: float = 1) -> None:
        self.counts[values] = self.counts.get(values, 0) + amount

    def value(self, *values: str) -> float:
        return self.counts.get(values, 0)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, labels=self.labels)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, count in self.counts.items():
            family.add_metric(list(values), count)
        yield family
