"""The runner of a batch's lines whose routes have no batch API: through their lanes, a page at
a time, one gateway at a time, resumed after a restart.

A batch (a ``/v1/batches`` file, an Anthropic Message Batch) sends its lines for providers with
a batch API to a job (``jobs.submit``); the others run here. Their results are inserted a page
at a time as they finish (rows beside the batch's record, never a rewrite of it), so what a
stopped gateway left is exactly the lines without a row. A gateway runs a batch's lines while
it holds the batch in the store and renews the hold; a replica that dies lets go once its hold
runs out, and the next resume pass (at start, then every ``lease_s``) of any gateway runs the
rest. A runner whose renewals fail (its store connection broke while the database is up for the
others) stops at its hold's deadline, cancelling the page it runs: past it, another replica may
take the batch, and the same lines would be paid for twice. Its result rows are fenced too: the
store refuses a page from a runner that no longer holds the batch (``HoldLost``). Calls refused
for the moment (the owner's quota, a full queue) wait their ``retry_after`` and go again: a
batch has 24 hours, not a live caller.

The runner knows calls, outcomes and rows, not APIs: the face that owns the batch says what a
line is as a call, what an outcome is as its API's result (``Plan``, ``Answer``) and where a
batch's bodies are (``Bodies``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import anyio

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.errors import Code, RpcError, internal_error

log = logging.getLogger(__name__)
PAGE = 16  # lines admitted at once: a 50,000-line file must not flood the queues, and the
# event loop answers other requests between pages (a page's answers arrive together: with 64
# mock embeddings a page held it ~40 ms, with 16 ~20 ms, and the batch ran no slower)
Row = tuple[int, str, int, Any]  # (line, custom_id, HTTP status, body) as stored


class Batch(Protocol):
    """What the runner reads of a batch's record."""

    @property
    def id(self) -> str: ...
    @property
    def custom_ids(self) -> list[str]: ...
    @property
    def lane_lines(self) -> list[int]: ...  # the lines run here (the others: its job, or refused)
    @property
    def own_total(self) -> int: ...  # its lines with a row here when done: lane lines and refused
    @property
    def cancelled_at(self) -> int | None: ...
    @property
    def errors(self) -> list[dict[str, Any]] | None: ...  # its input was invalid: nothing runs
    @property
    def held_until(self) -> float | None: ...  # (wall time) a gateway runs its lines until then


B = TypeVar("B", bound=Batch)


class LineStore(Protocol[B]):
    """The batch records and result rows in the job store, and the hold on a batch's lines."""

    lease_s: float

    def shared(self) -> bool: ...
    def opened(self) -> bool: ...
    def close(self) -> None: ...
    async def batch(self, batch_id: str, owner: str | None, *, everyone: bool = False) -> B | None: ...
    async def load_lines(self, record: B) -> B: ...
    async def owed(self) -> list[str]: ...
    async def hold(self, batch_id: str, renew: bool = False) -> bool: ...
    async def release(self, batch_id: str) -> None: ...
    async def add_results(self, batch_id: str, rows: Sequence[Row], *, held: bool = False) -> None:
        """``held``: stored only while this gateway holds the batch, else ``HoldLost``."""
    async def done_lines(self, batch_id: str) -> set[int]: ...
    async def result_counts(self, batch_id: str) -> tuple[int, int]: ...


class Runs(Protocol):
    """The gateway, as the runner uses it."""

    @property
    def clock(self) -> Clock: ...
    async def submit_many(self, calls: Sequence[Call]) -> list[Outcome]: ...
    def start_background(self, fn: Callable[..., Any], *args: Any) -> None: ...


class HoldLost(Exception):
    """The store refused a runner's rows: its hold on the batch lapsed (or went to another
    gateway), so whatever it ran meanwhile may run there too."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(f"batch {batch_id} is not held by this gateway")
        self.batch_id = batch_id


class Refused(Exception):
    """A line that cannot be a call (``Plan`` raises it): its row is its error's answer."""

    def __init__(self, error: RpcError) -> None:
        super().__init__(error.message)
        self.error = error


# a line's body as its call, and what ``Answer`` needs to shape its result (or ``Refused``)
Plan = Callable[[B, dict[str, Any]], tuple[Call, Any]]
Answer = Callable[[B, Outcome, Any], tuple[int, Any]]  # an outcome as its API's (status, body)
Bodies = Callable[[B], Awaitable[list[dict[str, Any]] | None]]  # bodies in line order; None: gone


@dataclass(frozen=True, slots=True)
class LaneCounts:
    """A batch's lines outside its job: how many ended, how many of them succeeded, and
    whether none is left to run (here, or on the replica that holds the batch)."""

    ended: int
    succeeded: int
    done: bool


class LineRunner(Generic[B]):
    def __init__(self, gateway: Runs, store: LineStore[B], plan: Plan[B], answer: Answer[B],
                 bodies: Bodies[B], ended: Callable[[B], None] | None = None) -> None:
        self.gateway = gateway
        self.store = store
        self.plan, self.answer, self.bodies = plan, answer, bodies
        self.ended = ended  # told when a batch's lines stop running here (done, cancelled, lost)
        self.live: dict[str, tuple[B, anyio.CancelScope]] = {}  # batches whose lines run here

    def reserve(self, record: B) -> anyio.CancelScope:
        """Mark a new batch live before it is stored: no resume pass starts a second runner."""
        scope = anyio.CancelScope()
        self.live[record.id] = (record, scope)
        return scope

    def start(self, record: B, bodies: list[dict[str, Any]],
              scope: anyio.CancelScope | None = None) -> None:
        """Run the batch's lines in the background (``scope``: the one ``reserve`` made)."""
        if scope is None:
            scope = self.reserve(record)
        self.gateway.start_background(self.run_lines, record, bodies, scope)

    def stop(self, batch_id: str) -> None:
        """A cancelled batch: its lines running here stop."""
        live = self.live.get(batch_id)
        if live is not None:
            live[1].cancel()

    async def run_lines(self, record: B, bodies: list[dict[str, Any]],
                        scope: anyio.CancelScope) -> None:
        """Run the batch's lines without a result, while this gateway holds the batch (a
        replica that held it and died lets go once its hold runs out)."""
        held = False
        try:
            with scope:
                asked = self.gateway.clock.now()
                try:
                    held = await self.store.hold(record.id)
                except Exception:  # the store is away: a later resume pass runs them
                    log.exception("batch %s: could not take its lane lines", record.id)
                if not held:
                    return  # another gateway runs them
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._keep_holding, record.id, asked + self.store.lease_s,
                                  tg.cancel_scope)
                    await self._run_pages(record, bodies)
                    tg.cancel_scope.cancel()
        finally:
            self.live.pop(record.id, None)
            if self.ended is not None:
                self.ended(record)
            if held:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.store.release(record.id)
                    except Exception:  # the store is away: the hold lapses by itself
                        log.exception("batch %s: could not let go of its lane lines", record.id)

    async def _keep_holding(self, batch_id: str, deadline: float, scope: anyio.CancelScope) -> None:
        """Renew the hold every third of its lease; at its deadline (the time the last renewal
        that succeeded was asked, plus the lease) without a later one, stop the pages: the
        store may give the batch to another gateway from then on."""
        clock = self.gateway.clock
        until = [deadline]  # moved on by each renewal that succeeds
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._renew, batch_id, until, scope)
            while clock.now() < until[0]:
                await clock.sleep_until(until[0])
            log.warning("batch %s: its hold ran out without a renewal: its lane lines stop here",
                        batch_id)
            scope.cancel()

    async def _renew(self, batch_id: str, until: list[float], scope: anyio.CancelScope) -> None:
        clock = self.gateway.clock
        lease = self.store.lease_s
        while True:
            await clock.sleep_until(clock.now() + lease / 3)
            asked = clock.now()
            try:
                kept = await self.store.hold(batch_id, renew=True)
            except Exception:  # the store is away for now: asked again at the next renewal
                log.exception("batch %s: could not renew its hold", batch_id)
                continue
            if not kept:
                log.info("batch %s: cancelled, or its hold lost to another gateway: its lane "
                         "lines stop here", batch_id)
                scope.cancel()
                return
            until[0] = max(until[0], asked + lease)

    async def _run_pages(self, record: B, bodies: list[dict[str, Any]]) -> None:
        try:
            todo = await self._unfinished(record)
        except Exception:  # the store is away: a later resume pass runs them
            log.exception("batch %s: could not read its unfinished lane lines", record.id)
            return
        cids = record.custom_ids
        try:
            for start in range(0, len(todo), PAGE):
                page, calls, hows = [], [], []
                rows: list[Row] = []
                for n in todo[start:start + PAGE]:
                    try:
                        call, how = self.plan(record, bodies[n])
                    except Refused as e:  # the config changed under a resumed batch
                        rows.append((n, cids[n], *self.answer(record, Outcome.fail(e.error), None)))
                        continue
                    page.append(n)
                    calls.append(call)
                    hows.append(how)
                outcomes = await self._patiently(calls)
                stopping = False
                for n, how, o in zip(page, hows, outcomes, strict=True):
                    if o.error is not None and o.error.code == Code.SHUTTING_DOWN:
                        stopping = True  # it did not run: the restarted gateway runs it
                        continue
                    rows.append((n, cids[n], *self.answer(record, o, how)))
                await self.store.add_results(record.id, rows, held=True)
                if stopping:
                    break
        except HoldLost:  # another gateway may run them now: none of its rows land from here
            log.warning("batch %s: its hold was lost: its lane lines stop here", record.id)
        except Exception as e:  # every line still ends: as failed
            log.exception("batch %s: running its lane lines failed", record.id)
            status, body = self.answer(record, Outcome.fail(internal_error(type(e).__name__)), None)
            try:
                await self.store.add_results(record.id, [(n, cids[n], status, body) for n in todo],
                                             held=True)
            except Exception:  # the store is away too: a later resume pass runs them
                log.exception("batch %s: could not record its failed lane lines", record.id)

    async def _patiently(self, calls: list[Call]) -> list[Outcome]:
        """Run a page of calls; those refused for the moment (the owner's quota, a full queue)
        wait their ``retry_after`` and go again: a batch has 24 hours, not a live caller."""
        outcomes: list[Outcome] = [Outcome()] * len(calls)
        todo = list(range(len(calls)))
        clock = self.gateway.clock
        while todo:
            done = await self.gateway.submit_many([calls[i] for i in todo])
            waits = []
            for i, o in zip(todo, done, strict=True):
                outcomes[i] = o
                if o.error is not None and o.error.code in (Code.RATE_LIMITED, Code.OVERLOADED):
                    after = (o.error.data or {}).get("retry_after")
                    if isinstance(after, int | float) and 0 <= after <= 3600:
                        waits.append((i, after))
            todo = [i for i, _ in waits]
            if todo:
                await clock.sleep_until(clock.now() + max(a for _, a in waits))
        return outcomes

    async def _unfinished(self, record: B) -> list[int]:
        """Its lane lines without a result yet."""
        done = await self.store.done_lines(record.id)
        return [n for n in (await self.store.load_lines(record)).lane_lines if n not in done]

    # -- where batches stand -------------------------------------------------------------------
    async def counts(self, record: B) -> LaneCounts:
        """Counts, not results (a poll must not page through 50,000 answers); its lines run
        here, or on another replica while that one holds the batch."""
        ended, succeeded = await self.store.result_counts(record.id)
        elsewhere = self.store.shared() and (record.held_until or 0) > time.time()
        done = record.id not in self.live and not elsewhere and (
            record.cancelled_at is not None or ended >= record.own_total)
        return LaneCounts(ended, succeeded, done)

    async def owes(self, record: B) -> bool:
        """Whether a batch still owes some lines a run: neither cancelled nor failed whole."""
        if record.cancelled_at is not None or record.errors:
            return False
        return (await self.store.result_counts(record.id))[0] < record.own_total

    # -- resuming ------------------------------------------------------------------------------
    async def resume(self) -> None:
        """Run the lines a stopped gateway (or a replica that died) left unfinished (a job part
        resumes by itself)."""
        for batch_id in await self.store.owed():
            if batch_id in self.live:
                continue
            record = await self.store.batch(batch_id, None, everyone=True)
            if record is None:
                continue
            bodies = await self.bodies(record)
            if bodies is not None and record.id not in self.live:  # not made meanwhile
                self.start(record, bodies)

    async def run(self, resume: bool,
                  beside: Sequence[Callable[[], Coroutine[Any, Any, Any]]] = ()) -> None:
        """For the gateway's lifetime: resume the lines a stopped gateway left (where a store is
        there to hold them), then every ``store.lease_s`` those left without a runner: a
        replica's that died (once its hold has run out), or a runner's here that the store
        failed under. ``beside``: other loops on the same store (the retention purge), run in
        this task's group so that they have stopped, their last query ended, before the store
        is let go at the end."""
        try:
            async with anyio.create_task_group() as tg:
                for loop in beside:
                    tg.start_soon(loop)
                if resume:
                    await self.resume()
                while True:
                    await anyio.sleep(self.store.lease_s)
                    if not (self.store.shared() or self.store.opened()):
                        continue  # no batch yet: the SQLite file is not made for nothing
                    try:
                        await self.resume()
                    except Exception:  # the database is away for now: asked again on the next pass
                        log.exception("resuming batches failed")
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(5):
                    while self.live:  # the runners let go of their batches first
                        await anyio.sleep(0.01)
                await anyio.to_thread.run_sync(self.store.close)
