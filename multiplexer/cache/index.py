"""One scope's answers: an HNSW vector index (usearch) beside an LRU of the entries it holds.

Why usearch: it ships wheels (no compiler at install), removes a key in place (an LRU eviction,
an expiry or a reported wrong hit leaves no tombstone to rebuild around, unlike faiss's HNSW),
stores vectors as float16 (100,000 MiniLM vectors and their graph in about 100 MB), and answers
a neighbour query in tens of microseconds. hnswlib only marks deletions and ships as a source
package here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from usearch.index import Index

DIMS_UNKNOWN = 0
NEIGHBOURS = 8  # candidates a lookup reads, nearest first; each must then pass the guard

_ids = itertools.count(1)


@dataclass(slots=True)
class Entry:
    """One stored answer and what it was the answer to."""

    id: str  # unique over replicas: the writer's replica id and its own sequence
    scope: str
    route: str
    neighbourhood: str
    exact: str
    text: str
    result: Any  # the provider's result, shaped for each caller as it is answered
    request_id: str | None
    expires: float  # wall-clock seconds (replicas share it)
    vector: np.ndarray | None = None
    key: int = field(default_factory=lambda: next(_ids))  # the index's integer key, this process only
    aliases: list[str] = field(default_factory=list)  # exact requests a semantic hit matched to it


class ScopeIndex:
    """Entries of one scope, at most ``max_entries``, the least recently used out first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by index key, LRU first
        self.exact: dict[str, Entry] = {}
        self.by_id: dict[str, Entry] = {}
        self.expiring: list[tuple[float, int]] = []  # a heap: the soonest to expire first
        self.index: Index | None = None
        self.dims = DIMS_UNKNOWN

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def memory_bytes(self) -> int:
        return int(self.index.memory_usage) if self.index is not None else 0

    def _index_for(self, dims: int) -> Index:
        if self.index is None or self.dims != dims:
            self.index = Index(ndim=dims, metric="cos", dtype="f16", connectivity=16,
                               expansion_add=64, expansion_search=48)
            self.dims = dims
        return self.index

    def add(self, entry: Entry) -> list[Entry]:
        """Keep ``entry`` (replacing one with the same exact request); the entries evicted."""
        evicted = []
        old = self.exact.get(entry.exact)
        if old is not None:
            self.remove(old)
        if entry.vector is not None:
            self._index_for(entry.vector.shape[0]).add(entry.key, entry.vector)
        self.entries[entry.key] = entry
        self.exact[entry.exact] = entry
        self.by_id[entry.id] = entry
        heapq.heappush(self.expiring, (entry.expires, entry.key))
        if len(self.expiring) > 2 * self.max_entries + 1024:  # evicted entries' times dropped
            self.expiring = [(e.expires, k) for k, e in self.entries.items()]
            heapq.heapify(self.expiring)
        while len(self.entries) > self.max_entries:
            evicted.append(self.entries[next(iter(self.entries))])
            self.remove(evicted[-1])
        return evicted

    def alias(self, exact: str, entry: Entry) -> None:
        """A request that a semantic hit answered with ``entry``: its repeat is an exact hit."""
        if entry.key in self.entries and exact not in self.exact and len(entry.aliases) < 64:
            self.exact[exact] = entry
            entry.aliases.append(exact)

    def remove(self, entry: Entry) -> None:
        if self.entries.pop(entry.key, None) is None:
            return
        for exact in (entry.exact, *entry.aliases):
            if self.exact.get(exact) is entry:
                del self.exact[exact]
        self.by_id.pop(entry.id, None)
        if entry.vector is not None and self.index is not None:
            self.index.remove(entry.key)

    def touch(self, entry: Entry) -> None:
        if entry.key in self.entries:
            self.entries.move_to_end(entry.key)

    def expire(self, now: float) -> int:
        """Entries past their time removed (oldest first); how many."""
        n = 0
        while self.expiring and self.expiring[0][0] <= now:
            _, key = heapq.heappop(self.expiring)
            entry = self.entries.get(key)
            if entry is not None and entry.expires <= now:
                self.remove(entry)
                n += 1
        return n

    def nearest(self, vector: np.ndarray, neighbourhood: str, now: float,
                count: int = NEIGHBOURS) -> list[tuple[Entry, float]]:
        """Live entries of ``neighbourhood`` near ``vector``, nearest first, with their cosine
        similarity."""
        if self.index is None or len(self.index) == 0 or vector.shape[0] != self.dims:
            return []
        found = self.index.search(vector, min(count, len(self.index)))
        out = []
        for key, distance in zip(found.keys.tolist(), found.distances.tolist(), strict=True):
            entry = self.entries.get(key)
            if entry is None or entry.neighbourhood != neighbourhood or entry.expires <= now:
                continue
            out.append((entry, 1.0 - float(distance)))
        return out
