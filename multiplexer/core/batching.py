"""Batch formation: which queued items leave together, and when.

Formation policies are pure functions of the queue and the time, so they are
tested without I/O or clocks; ``lane.Lane`` is the small loop that runs them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from multiplexer.core.call import Future, Item


@dataclass(eq=False, slots=True)
class Pending:
    """An item waiting in (or taken from) a lane, with the future its callers wait on."""

    item: Item
    enqueued: float
    future: Future = field(default_factory=Future)
    waiters: int = 1
    state: str = "queued"  # queued (in the queue) -> running (taken from it) -> done; a shared
    # flight's callers' before that: claiming (its key, in the shared state), or replica (waiting
    # for the replica that runs it)
    via: Pending | None = None  # a shared flight this replica won: its own pending on the lane

    @property
    def sort_key(self) -> tuple[int, int]:
        return (-self.item.priority, self.item.seq)


@dataclass(frozen=True, slots=True)
class Decision:
    """Either ``take`` (indices into the group's pending list) or wait until ``wait_until``.

    ``blocked``: nothing of the group leaves until one of the lane's running batches ends, whatever
    arrives meanwhile (a gated model at its concurrency), so arrivals need not wake the lane."""

    take: tuple[int, ...] = ()
    wait_until: float = math.inf
    blocked: bool = False


class Formation(Protocol):
    """Which of a group's items leave next. A formation that counts the batches it chose while
    they run (``tracks_batches = True``, a gated model's) sees every batch of its lane: the lane
    then runs no lone call in its caller's task around it (``Lane.express``)."""

    def decide(self, pending: Sequence[Pending], now: float) -> Decision:
        """``pending`` is one group's queue, best first (priority, then arrival)."""
        ...


@dataclass(frozen=True, slots=True)
class CountFormation:
    """A full batch leaves at once; a partial one when its oldest item has waited ``max_wait``.

    ``max_tokens`` optionally caps the summed token estimate of one batch.
    """

    max_items: int = 1
    max_wait: float = 0.0
    max_tokens: int | None = None

    def decide(self, pending: Sequence[Pending], now: float) -> Decision:
        if not pending:
            return Decision()
        count, tokens = 0, 0
        for p in pending:
            if count >= self.max_items:
                break
            if self.max_tokens is not None and count and tokens + p.item.tokens > self.max_tokens:
                break
            count += 1
            tokens += p.item.tokens
        full = count < len(pending) or count >= self.max_items
        oldest = min(p.enqueued for p in pending) if not full else now
        if full or oldest + self.max_wait <= now:
            return Decision(take=tuple(range(count)))
        return Decision(wait_until=oldest + self.max_wait)


class GroupedQueue:
    """A bounded priority queue split into groups of items that may share a batch."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._groups: dict[Hashable, list[Pending]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def full(self) -> bool:
        return self._size >= self.max_size

    def push(self, p: Pending) -> None:
        queue = self._groups.setdefault(p.item.group, [])
        if not queue or queue[-1].sort_key < p.sort_key:
            queue.append(p)
        else:
            bisect.insort(queue, p, key=lambda x: x.sort_key)
        self._size += 1

    def remove(self, p: Pending) -> bool:
        queue = self._groups.get(p.item.group)
        if not queue:
            return False
        i = bisect.bisect_left(queue, p.sort_key, key=lambda x: x.sort_key)
        if i < len(queue) and queue[i] is p:
            del queue[i]
            self._size -= 1
            if not queue:
                del self._groups[p.item.group]
            return True
        return False

    def group(self, group: Hashable) -> list[Pending]:
        return self._groups[group]

    def groups(self) -> Iterator[tuple[Hashable, list[Pending]]]:
        return iter(list(self._groups.items()))

    def take(self, group: Hashable, indices: Sequence[int]) -> list[Pending]:
        """Remove and return the chosen items, marked running: an item is ``queued`` exactly
        while it is in the queue, so a formation can tell a taken batch by its items' state."""
        queue = self._groups[group]
        chosen = [queue[i] for i in indices]
        for p in chosen:
            p.state = "running"
        if list(indices) == list(range(len(indices))):
            del queue[: len(indices)]
        else:
            drop = set(indices)
            queue[:] = [p for i, p in enumerate(queue) if i not in drop]
        if not queue:
            del self._groups[group]
        self._size -= len(chosen)
        return chosen

    def drain(self) -> list[Pending]:
        out = [p for q in self._groups.values() for p in q]
        self._groups.clear()
        self._size = 0
        return out


def choose(queue: GroupedQueue, formation: Formation, now: float,
           blocked: set[Hashable] | None = None) -> tuple[Hashable, Decision]:
    """Pick the ready batch whose best item ranks highest; else the earliest wake-up.

    ``blocked``, when given, is set to the groups whose decision says only a batch's end can move them."""
    best: tuple[tuple[int, int], Hashable, Decision] | None = None
    wait_until = math.inf
    if blocked is not None:
        blocked.clear()
    for group, pending in queue.groups():
        d = formation.decide(pending, now)
        if d.take:
            rank = min(pending[i].sort_key for i in d.take)
            if best is None or rank < best[0]:
                best = (rank, group, d)
        else:
            wait_until = min(wait_until, d.wait_until)
            if d.blocked and blocked is not None:
                blocked.add(group)
    if best is not None:
        return best[1], best[2]
    return None, Decision(wait_until=wait_until)
