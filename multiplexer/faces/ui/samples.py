"""The gateway's metrics registry read as `/metrics` renders it, for the dashboard's panels.

One ``collect()`` per snapshot: every number a panel takes from here is the value a scrape of
``/metrics`` would show at that moment (same names, same labels), so the two never disagree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry

Labels = tuple[tuple[str, str], ...]


class Samples:
    """Sample values by their exposition name (``multiplexer_calls_total``) and labels."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in registry.collect():
            for sample in family.samples:
                self.by_name[sample.name].append((sample.labels, sample.value))

    def rows(self, name: str, **match: str) -> Iterable[tuple[dict[str, str], float]]:
        for labels, value in self.by_name.get(name, ()):
            if all(labels.get(k) == v for k, v in match.items()):
                yield labels, value

    def value(self, name: str, **match: str) -> float:
        """The sum over every series that matches (0 when none does)."""
        return sum(v for _, v in self.rows(name, **match))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """Values summed per value of ``label``."""
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.rows(name, **match):
            out[labels.get(label, "")] += v
        return dict(out)

    def buckets(self, name: str, **match: str) -> list[tuple[float, float]]:
        """A histogram's cumulative ``(le, count)`` pairs, ``+Inf`` last (``name`` without ``_bucket``)."""
        out: dict[float, float] = defaultdict(float)
        for labels, v in self.rows(name + "_bucket", **match):
            out[float(labels["le"])] += v
        return sorted(out.items())


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: linear within the bucket the rank falls in; None
    without observations. Above the highest finite bound it answers that bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def per_bucket(buckets: Sequence[tuple[float, float]]) -> list[tuple[str, int]]:
    """Cumulative pairs turned into counts per bucket, labelled by their upper bound."""
    out, before = [], 0.0
    for bound, count in buckets:
        label = "+Inf" if math.isinf(bound) else f"{bound:g}"
        out.append((label, int(count - before)))
        before = count
    return out
