"""A record sink off the hot path: callers ``put`` a record and never wait; a writer task (run in
the owner's task group) takes what is queued in batches, by size or every ``interval_s``, and
hands each batch to ``write`` on a worker thread (a database's insert).

The queue is bounded: a record that finds it full is dropped and counted in
``multiplexer_records_dropped{sink=NAME}``, never a stall. A batch the writer fails to write is
logged and counted in ``multiplexer_records_failed{sink=NAME}``. ``redact`` runs on the writer
(not on the caller's path) before a record is written. ``aclose`` writes what is left, in order.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import anyio
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

T = TypeVar("T")

_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, tuple[Counter, Counter, Counter]] = \
    weakref.WeakKeyDictionary()


def _counters(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    """One set of counters per registry, shared by the sinks on it (labelled by name)."""
    found = _COUNTERS.get(registry)
    if found is None:
        found = _COUNTERS[registry] = (
            Counter("multiplexer_records_dropped", "Records a sink dropped because its queue was full",
                    ["sink"], registry=registry),
            Counter("multiplexer_records_failed", "Records a sink's writer failed to write",
                    ["sink"], registry=registry),
            Counter("multiplexer_records_written", "Records a sink wrote", ["sink"], registry=registry))
    return found


class RecordSink(Generic[T]):
    """A bounded queue of records and the writer that empties it in batches.

    ``write``: blocking, run on a worker thread with one batch (in the order ``put`` saw them);
    ``capacity``: the most records queued; ``batch``: the most per ``write``, and the queue length
    that wakes the writer before ``interval_s``."""

    def __init__(self, name: str, write: Callable[[Sequence[T]], None], *,
                 registry: CollectorRegistry | None = None, capacity: int = 100_000,
                 batch: int = 1000, interval_s: float = 1.0,
                 redact: Callable[[T], T] | None = None) -> None:
        if capacity < 1 or batch < 1 or interval_s <= 0:
            raise ValueError("capacity and batch must be at least 1 and interval_s above 0")
        self.name = name
        self._write = write
        self.capacity, self.batch, self.interval_s = capacity, batch, interval_s
        self.redact = redact
        self._queue: deque[T] = deque()
        self._wake = anyio.Event()
        self._lock = anyio.Lock()  # one batch at a time: batches are written in order
        self._closed = False
        self.dropped = self.failed = self.written = 0
        counters = _counters(registry) if registry is not None else None
        self._counted = None if counters is None else tuple(c.labels(name) for c in counters)

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, record: T) -> bool:
        """Queue ``record`` for the writer; False (and counted) when the queue is full or closed."""
        queue = self._queue
        if len(queue) >= self.capacity or self._closed:
            self.dropped += 1
            if self._counted is not None:
                self._counted[0].inc()
            return False
        queue.append(record)
        if len(queue) == self.batch:
            self._wake.set()
        return True

    async def run(self) -> None:
        """The writer, for the owner's lifetime (cancelled by its task group; ``aclose`` writes
        the rest)."""
        while True:
            with anyio.move_on_after(self.interval_s):
                await self._wake.wait()
            if self._wake.is_set():
                self._wake = anyio.Event()
            await self.flush()

    async def flush(self) -> None:
        """Write what is queued, a batch at a time, in order, until the queue is empty."""
        async with self._lock:
            while self._queue:
                n = min(len(self._queue), self.batch)
                taken = [self._queue.popleft() for _ in range(n)]
                with anyio.CancelScope(shield=True):  # a batch taken is written, cancelled or not
                    await anyio.to_thread.run_sync(self._write_batch, taken)

    def _write_batch(self, taken: list[T]) -> None:
        try:
            if self.redact is not None:
                taken = [self.redact(r) for r in taken]
        except Exception:
            self._failed(len(taken))
            return
        self._write_redacted(taken)

    def _write_redacted(self, taken: list[T]) -> None:
        try:
            self._write(taken)
        except Exception:
            if len(taken) > 1:  # one record the store refuses costs that record, not its batch
                for record in taken:
                    self._write_redacted([record])
                return
            self._failed(1)
            return
        self.written += len(taken)
        if self._counted is not None:
            self._counted[2].inc(len(taken))

    def _failed(self, n: int) -> None:
        self.failed += n
        if self._counted is not None:
            self._counted[1].inc(n)
        log.exception("the %s sink could not write %d record(s); /metrics counts them", self.name, n)

    async def aclose(self) -> None:
        """No more records; what is queued is written (shielded: a shutdown's cancel waits)."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.flush()
