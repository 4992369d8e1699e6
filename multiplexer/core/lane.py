"""One lane per provider: a bounded priority queue drained in batches under limits.

The lane decides *when* a batch leaves (formation + limiter) and is the one place that
charges the provider's limiter, local or shared: a permit per batch, and each further
upstream request of the batch through the ``Upstream`` it hands the provider. The
provider decides *how* the batch goes upstream. Every pending item ends exactly once, by the
provider's outcome, by its callers giving up, or by shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import anyio

from multiplexer.core.batching import Formation, GroupedQueue, Pending, choose
from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import Clock, wait_own
from multiplexer.core.errors import RpcError, internal_error, overloaded, shutting_down
from multiplexer.core.limiter import Limiter, Permit, Upstream, charging, holding
from multiplexer.core.metrics import Metrics
from multiplexer.core.tracing import NOOP, Tracer

log = logging.getLogger(__name__)

Execute = Callable[[str, Sequence[Item]], Awaitable[list[Outcome]]]


Batch = tuple[list[Pending], Permit]  # a batch and its charge


class _Worker:
    """A parked lane worker: the next batch is handed to it, or None to end. Its event is
    asyncio's (the lane runs on asyncio): anyio's asks sniffio for the backend each time one is
    made, once per batch here."""

    __slots__ = ("batch", "ready")

    def __init__(self) -> None:
        self.batch: Batch | None = None
        self.ready = asyncio.Event()

    def hand(self, batch: Batch | None) -> None:
        self.batch = batch
        self.ready.set()

    async def next(self) -> Batch | None:
        await self.ready.wait()
        return self.batch


class _Running:
    """A running batch, for ``withdraw`` and ``abort`` to cancel while it runs: its task's own
    cancel, which ``_dispatch`` takes back (``uncancel``) as ``asyncio.timeout`` does. An anyio
    cancel scope per batch cost about 10 us of a lone call's CPU. Only one cancel is sent, and
    none once the batch has ended: its entry leaves the lane before the task runs on."""

    __slots__ = ("batch", "fired", "task")

    def __init__(self, task: asyncio.Task[Any], batch: list[Pending]) -> None:
        self.task, self.batch, self.fired = task, batch, False

    def cancel(self) -> None:
        if not self.fired:
            self.fired = True
            self.task.cancel()


class Lane:
    def __init__(
        self,
        name: str,
        execute: Execute,
        formation: Formation,
        clock: Clock,
        limiter: Limiter,
        *,
        max_queue: int = 10_000,
        eager: bool = False,
        metrics: Metrics | None = None,
        tracer: Tracer = NOOP,
        provider: str | None = None,
        attach_trace: bool = True,
    ) -> None:
        self.name = name
        self.provider = provider or name  # the lane's provider: what a limit's deadline names
        self._tracer = tracer
        self._attach_trace = attach_trace  # the OTel context while a batch runs (Tracer.batch)
        self._execute = execute
        self.formation = formation
        self.clock = clock
        self.limiter = limiter
        self.queue = GroupedQueue(max_queue)
        self.eager = eager
        self.in_flight = 0
        self.metrics = metrics
        if metrics is not None:  # label lookups cost microseconds: do them once
            self._depth = metrics.queue_depth.labels(name)
            self._sizes = metrics.batch_size.labels(name)
            self._batches = metrics.upstream_batches.labels(name)
        self._wake = asyncio.Event()  # set by submits and finished batches: see wait_own
        self.drained = anyio.Event()  # set when the loop has ended: closed and empty, or cancelled
        self._closing = False
        self._scopes: dict[int, _Running] = {}  # the batches running now, by id
        self._batch_ids = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._idle: list[_Worker] = []  # workers parked between batches
        # groups whose last decision waits for a running batch to end: arrivals there do not wake
        # the loop (with 64 callers on a gated model that was a wake and a decision per call)
        self._blocked: set[Hashable] = set()
        self._held: str | None = None  # the limiter's limit that held the queue at the last step
        self._avg_batch_s = 0.0  # moving averages of batch duration and size, for retry_after
        self._avg_size = 1.0
        limiter.on_release(self._slot_freed)  # a slot freed by any lane of the provider

    # -- admission -------------------------------------------------------
    def submit(self, item: Item, pending: Pending | None = None) -> Pending:
        """Queue an item (in ``pending``, when its callers wait on one already), or raise the
        documented overload / shutdown error at once."""
        if self._closing:
            raise shutting_down()
        if self.queue.full():
            if self.metrics:
                self.metrics.rejections.labels(self.name, "queue_full").inc()
            raise overloaded(self.name, self._retry_after())
        if item.deadline is not None and len(self.queue) and self._avg_batch_s > 0:
            drain = self._drain_time()
            if self.clock.now() + drain > item.deadline:  # it would only time out in the queue
                if self.metrics:
                    self.metrics.rejections.labels(self.name, "deadline").inc()
                raise overloaded(self.name, drain)
        if pending is None:
            p = Pending(item, self.clock.now())
        else:
            p, p.enqueued = pending, self.clock.now()
        self.queue.push(p)
        self._gauge()
        tg = self._tg
        if tg is not None and self.eager and self.in_flight == 0:  # idle: send now, no hop via the loop
            self._step(tg)
            if len(self.queue):
                self._wake.set()
        elif not self.limiter.full() and item.group not in self._blocked:
            self._wake.set()  # else nothing can leave before a batch ends, and its end wakes the loop
        return p

    def express(self, item: Item, streamed: bool = False) -> Batch | None:
        """A lone item on an idle eager lane: its batch, taken and charged now, for the caller to
        ``run_here`` in its own task; None when it must queue (``submit``).

        It is the batch ``submit`` would have started at once; run by the caller, it skips the
        queue, the hand-over to a worker and back, and the caller's wait for it, which were a fifth
        of a lone proxied call's CPU.

        ``streamed``: a stream also on a busy lane, when nothing is queued and the formation
        sends it alone at once (as ``submit`` then would): a stream holds its batch for its whole
        length, and a worker task parked on each of a thousand open streams, with its frames and
        its caller's waiter, was 6 KB of every one."""
        if (self._tg is None or not self.eager or (self.in_flight and not streamed) or self._closing
                or getattr(self.formation, "tracks_batches", False)
                or len(self.queue) or self.limiter.full()
                or self.limiter.delay(1, item.tokens)[0] > 0):
            return None
        p = Pending(item, self.clock.now())
        if self.in_flight and not self.formation.decide([p], p.enqueued).take:
            return None  # the formation would hold it for a batch: it queues
        p.state = "running"
        self.in_flight += 1
        return [p], self.limiter.take(item.tokens)

    async def run_here(self, batch: Batch) -> None:
        """Run a batch from ``express`` in the caller's task; its pending gets its outcome."""
        await self._dispatch(*batch)

    def _retry_after(self) -> float:
        """When a refused caller should come back: the rate limit's wait, or the time the
        queue takes to drain at the recent pace (batch time x batches / parallelism)."""
        wait, _ = self.limiter.delay(1, 0)
        return min(max(wait, self._drain_time(), 0.05), 60.0)

    def _drain_time(self) -> float:
        """Seconds until the queue ahead empties at the recent pace."""
        batches = len(self.queue) / max(self._avg_size, 1.0)
        return batches * self._avg_batch_s / max(self.limiter.concurrency, 1)

    def withdraw(self, p: Pending, outcome: Outcome) -> None:
        """A pending item's last caller gave up: drop it, cancelling its batch if it was alone."""
        p.waiters -= 1
        if p.waiters > 0:
            return
        if p.state == "queued" and self.queue.remove(p):
            p.state = "done"
            self._gauge()
        p.future.set(outcome)
        for running in self._scopes.values():
            if p in running.batch and all(q.future.done() for q in running.batch):
                running.cancel()

    def holding(self) -> str | None:
        """The limit that keeps queued items from leaving now: ``concurrency`` while every slot
        is taken, else the limiter's (rpm, tpm, retry_after) that stopped the last step."""
        return "concurrency" if self.limiter.full() else self._held

    def _slot_freed(self) -> None:
        if len(self.queue):
            self._wake.set()

    def _gauge(self) -> None:
        if self.metrics:
            self._depth.set(len(self.queue))

    # -- the loop ----------------------------------------------------------
    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                while True:
                    self._wake = asyncio.Event()
                    deadline = self._step(tg)
                    if self._closing and not len(self.queue) and not self.in_flight:
                        self._release_idle()
                        return
                    if deadline != 0.0:
                        await wait_own(self.clock, self._wake, deadline)
        finally:
            self.drained.set()

    def _step(self, tg: anyio.abc.TaskGroup) -> float:
        """Start every batch that may leave now; return when to look again (inf: on wake)."""
        blocked = self._blocked
        blocked.clear()  # as it stays when nothing is asked below
        self._held = None
        while not self.limiter.full() and len(self.queue):
            now = self.clock.now()
            group, decision = choose(self.queue, self.formation, now, blocked)
            if not decision.take and self.eager and self.in_flight == 0:
                group, decision = choose(self.queue, self.formation, math.inf, blocked)
            if not decision.take:
                return decision.wait_until
            pending = self.queue.group(group)
            expired = [i for i in decision.take
                       if (deadline := pending[i].item.deadline) is not None and deadline <= now]
            if expired:  # every caller of these has timed out, or is about to: never sent
                for p in self.queue.take(group, expired):
                    p.state = "done"
                self._gauge()
                continue
            tokens = sum(pending[i].item.tokens for i in decision.take)
            wait, which = self.limiter.delay(1, tokens)
            if wait > 0:
                self._held = which
                return now + wait
            batch = (self.queue.take(group, decision.take), self.limiter.take(tokens))
            self._gauge()
            self.in_flight += 1
            if self._idle:
                self._idle.pop().hand(batch)
            else:
                tg.start_soon(self._work, batch)
        return math.inf

    async def _work(self, batch: Batch | None) -> None:
        """Run batches until the lane ends: a worker parks between batches, since starting
        a task costs more CPU (~40 us with anyio) than a small upstream call's whole client side.

        A worker whose batch ended takes the next one before it yields: the callers just
        answered are queued on the event loop, and a next batch handed to a parked worker
        would start only after all of their replies were written (a model idle meanwhile).
        """
        assert self._tg is not None
        while batch is not None:
            await self._dispatch(*batch)
            if self._closing and not len(self.queue):
                return
            worker = _Worker()
            self._idle.append(worker)
            self._step(self._tg)  # the last worker parked is the first handed a batch: this one
            batch = worker.batch if worker.ready.is_set() else await worker.next()

    def _release_idle(self) -> None:
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.hand(None)

    async def _dispatch(self, batch: list[Pending], permit: Permit) -> None:
        self._batch_ids += 1
        bid = self._batch_ids
        items = [p.item for p in batch]
        if self.metrics:
            self._sizes.observe(len(batch))
            self._batches.inc()
        outcomes: list[Outcome] | None = None
        started = self.clock.now()
        task = asyncio.current_task()
        assert task is not None
        running = self._scopes[bid] = _Running(task, batch)
        try:
            try:
                ends = [item.deadline for item in items if item.deadline is not None]
                permit.deadline = max(ends) if len(ends) == len(items) else None
                await self.limiter.ready(permit, holding(items))  # shared: the replicas' charge
                with self._tracer.batch(self.name, batch, started, self._attach_trace), \
                        charging(Upstream(self.limiter, items)):
                    outcomes = await self._execute(items[0].operation, items)
                if len(outcomes) != len(items):
                    raise RuntimeError(f"provider returned {len(outcomes)} for {len(items)} items")
            except RpcError as e:
                outcomes = [Outcome.fail(e)] * len(items)
            except Exception as e:  # a provider bug must not lose calls
                log.exception("lane %s: provider failed", self.name)
                outcomes = [Outcome.fail(internal_error(type(e).__name__))] * len(items)
            finally:
                self._avg_batch_s += 0.2 * (self.clock.now() - started - self._avg_batch_s)
                self._avg_size += 0.2 * (len(batch) - self._avg_size)
                self._scopes.pop(bid, None)
                self.limiter.finish(permit)
                self.in_flight -= 1
                self._blocked.clear()
                if len(self.queue) or self._closing:  # else the loop has nothing to decide: a
                    self._wake.set()  # wake per call was a task step, a step and a new event each
        except asyncio.CancelledError:
            if not running.fired or task.uncancel() > 0:  # not (only) the lane's own cancel
                raise
        if outcomes is None:  # cancelled: every caller already has its answer
            outcomes = [Outcome.fail(shutting_down())] * len(items)
        for p, o in zip(batch, outcomes, strict=True):
            p.state = "done"
            p.future.set(o)

    # -- shutdown ------------------------------------------------------------
    def close(self, fail_queued: bool = False) -> None:
        """Stop admitting; queued items still run unless ``fail_queued``."""
        self._closing = True
        if fail_queued:
            for p in self.queue.drain():
                p.state = "done"
                p.future.set(Outcome.fail(shutting_down()))
            self._gauge()
        self._wake.set()

    def abort(self) -> None:
        """Fail everything still queued or running (grace period over)."""
        self.close(fail_queued=True)
        for running in list(self._scopes.values()):
            for p in running.batch:
                p.future.set(Outcome.fail(shutting_down()))
            running.cancel()
