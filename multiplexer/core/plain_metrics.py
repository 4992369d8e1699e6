"""Metrics that every call or request moves, kept in plain numbers and read at scrape time.

prometheus-client's own children take a lock on each change (a histogram's ``observe`` cost
about 1 us here, five times a bisect and two additions). These are changed only on the event
loop's thread, where the gateway answers calls and requests, so they need no lock; a collector
hands them to the registry as ordinary metric families.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

T = TypeVar("T")


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


class PerLabel(Generic[T]):
    """A metric with one label: a value (``make()``'s) per label value, made on first use, and
    the family a scrape reads (``family``, ``add``: what each kind of metric says)."""

    def __init__(self, name: str, doc: str, label: str, make: Callable[[], T],
                 registry: CollectorRegistry) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.make = make
        self.values: dict[str, T] = {}
        registry.register(self)

    def of(self, value: str) -> T:
        held = self.values.get(value)
        if held is None:
            held = self.values[value] = self.make()
        return held

    def family(self) -> Metric:
        raise NotImplementedError

    def add(self, family: Metric, value: str, held: T) -> None:
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        yield self.family()

    def collect(self) -> Iterator[Metric]:
        family = self.family()
        for value, held in self.values.items():
            self.add(family, value, held)
        yield family


class Timings(PerLabel[Series]):
    """A histogram with one label."""

    def __init__(self, name: str, doc: str, label: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.buckets = tuple(buckets)
        self.bounds = (*map(floatToGoString, self.buckets), "+Inf")
        super().__init__(name, doc, label, lambda: Series(self.buckets), registry)

    def family(self) -> Metric:
        return HistogramMetricFamily(self.name, self.doc, labels=[self.label])

    def add(self, family: Metric, value: str, held: Series) -> None:
        total, buckets = 0, []
        for bound, count in zip(self.bounds, held.counts, strict=True):
            total += count
            buckets.append((bound, float(total)))
        assert isinstance(family, HistogramMetricFamily)
        family.add_metric([value], buckets, held.sum)


class Level:
    """One label value's gauge, moved by the caller (``n += 1``)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Levels(PerLabel[Level]):
    """A gauge with one label."""

    def __init__(self, name: str, doc: str, label: str, registry: CollectorRegistry) -> None:
        super().__init__(name, doc, label, Level, registry)

    def family(self) -> Metric:
        return GaugeMetricFamily(self.name, self.doc, labels=[self.label])

    def add(self, family: Metric, value: str, held: Level) -> None:
        assert isinstance(family, GaugeMetricFamily)
        family.add_metric([value], held.n)


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
