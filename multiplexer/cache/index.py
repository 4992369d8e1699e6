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
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from usearch.index import Index

from multiplexer.core.json_codec import dumps, loads

NEIGHBOURS = 8  # candidates a lookup reads, nearest first; each must then pass the guard

_ids = itertools.count(1)


@dataclass(slots=True)
class Entry:
    """One stored answer and what it was the answer to. Kept small, as a scope holds up to
    ``max_entries`` of them: the answer as its JSON bytes (one object, not a tree of dicts the
    collector walks; each hit reads its own copy), the scope, route and neighbourhood strings
    shared by every entry that has them (interned), the exact request as a digest."""

    id: str  # unique over replicas: the writer's replica id and its own sequence
    scope: str
    route: str
    neighbourhood: str
    exact: str
    text: str
    body: Any  # the provider's result (its JSON bytes once made), shaped for each caller
    request_id: str | None
    expires: float  # wall-clock seconds (replicas share it)
    vector: np.ndarray | None = None
    key: int = field(default_factory=lambda: next(_ids))  # the index's integer key, this process only
    aliases: list[str] | None = None  # exact requests a semantic hit matched to it

    def __post_init__(self) -> None:
        self.scope = sys.intern(self.scope)
        self.route = sys.intern(self.route)
        self.neighbourhood = sys.intern(self.neighbourhood)
        if not isinstance(self.body, bytes):
            # copied to its own size: orjson's bytes keep the buffer they were written in (4 KB
            # and more; 100,000 answers held 400 MB where their JSON is 40)
            self.body = bytes(memoryview(dumps(self.body)))

    @property
    def result(self) -> Any:
        """The stored answer, a copy of its own for each reader."""
        return loads(self.body)


SMALL = 256  # a neighbourhood up to this many answers is scanned exactly; above, an HNSW index


def _hnsw(dims: int) -> Index:
    return Index(ndim=dims, metric="cos", dtype="f16", connectivity=16, expansion_add=64,
                 expansion_search=48)


class _Hood:
    """One neighbourhood's entries with vectors: a matrix scanned exactly while it is small (an
    index costs about 50 KB even empty), an HNSW index once it is not."""

    __slots__ = ("entries", "index", "keys", "matrix")

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.index: Index | None = None
        self.keys: list[int] | None = None
        self.matrix: np.ndarray | None = None

    def add(self, entry: Entry) -> None:
        assert entry.vector is not None
        self.entries[entry.key] = entry
        self.matrix = self.keys = None
        if self.index is not None:
            self.index.add(entry.key, entry.vector, threads=1)
            entry.vector = None  # the index keeps it (float16): one copy, not two
        elif len(self.entries) > SMALL:
            self.index = _hnsw(entry.vector.shape[0])
            keys = np.fromiter(self.entries, dtype=np.uint64, count=len(self.entries))
            self.index.add(keys, np.stack([e.vector for e in self.entries.values()]))  # type: ignore[misc]
            for e in self.entries.values():
                e.vector = None

    def remove(self, entry: Entry) -> None:
        if self.entries.pop(entry.key, None) is not None:
            self.matrix = self.keys = None
            if self.index is not None:
                self.index.remove(entry.key)

    def nearest(self, vector: np.ndarray, count: int) -> list[tuple[int, float]]:
        if self.index is not None:
            found = self.index.search(vector, min(count, len(self.index)), threads=1)
            return [(k, 1.0 - d) for k, d in zip(found.keys.tolist(), found.distances.tolist(),
                                                 strict=True)]
        if self.matrix is None or self.keys is None:
            self.keys = list(self.entries)
            self.matrix = np.stack([e.vector for e in self.entries.values()])  # type: ignore[misc]
        if self.matrix.shape[1] != vector.shape[0]:
            return []
        sims = self.matrix @ vector
        top = np.argsort(-sims)[:count]
        return [(self.keys[i], float(sims[i])) for i in top.tolist()]

    @property
    def memory_bytes(self) -> int:
        if self.index is not None:
            return int(self.index.memory_usage)
        return 0 if self.matrix is None else int(self.matrix.nbytes)


class ScopeIndex:
    """Entries of one scope, at most ``max_entries`` over all its neighbourhoods, the least
    recently used out first; a lookup searches its own neighbourhood only."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by index key, LRU first
        self.exact: dict[str, Entry] = {}
        self.alias_similarity: dict[str, float] = {}  # an alias's similarity when it first hit
        self.by_id: dict[str, Entry] = {}
        self.expiring: list[tuple[float, int]] = []  # a heap: the soonest to expire first
        self.hoods: dict[str, _Hood] = {}

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def memory_bytes(self) -> int:
        return sum(h.memory_bytes for h in self.hoods.values())

    def add(self, entry: Entry) -> list[Entry]:
        """Keep ``entry`` (replacing one with the same exact request); the entries evicted."""
        evicted = []
        old = self.exact.get(entry.exact)
        if old is not None:
            self.remove(old)
        if entry.vector is not None:
            hood = self.hoods.get(entry.neighbourhood)
            if hood is None:
                hood = self.hoods[entry.neighbourhood] = _Hood()
            hood.add(entry)
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

    def alias(self, exact: str, entry: Entry, similarity: float) -> None:
        """A request that a semantic hit answered with ``entry``: its repeat is an exact hit."""
        if entry.aliases is None:
            entry.aliases = []
        if entry.key in self.entries and exact not in self.exact and len(entry.aliases) < 64:
            self.exact[exact] = entry
            self.alias_similarity[exact] = similarity
            entry.aliases.append(exact)

    def remove(self, entry: Entry) -> None:
        if self.entries.pop(entry.key, None) is None:
            return
        for exact in (entry.exact, *(entry.aliases or ())):
            if self.exact.get(exact) is entry:
                del self.exact[exact]
            self.alias_similarity.pop(exact, None)
        self.by_id.pop(entry.id, None)
        hood = self.hoods.get(entry.neighbourhood)
        if hood is not None:
            hood.remove(entry)
            if not hood.entries:
                del self.hoods[entry.neighbourhood]

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
        hood = self.hoods.get(neighbourhood)
        if hood is None:
            return []
        out = []
        for key, similarity in hood.nearest(vector, count):
            entry = self.entries.get(key)
            if entry is not None and entry.expires > now:
                out.append((entry, similarity))
        return out
