"""The contracts of batch jobs: the durable job store and a provider's batch runner.

The ``jobs.*`` face and the providers with a batch API meet here, so the face
depends on these shapes, not on the SQLite store or a provider's job manager.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import anyio

from multiplexer.core.call import Item
from multiplexer.core.jobrows import ItemRow, JobRow, NewItem, PartRow
from multiplexer.core.metrics import UNROUTED, Metrics, code_label

log = logging.getLogger(__name__)

T = TypeVar("T")

# Keys of a job item's stored options. FALLBACK_ROUTES: the routes its items may be resubmitted to,
# once, when their remote batch fails whole (absent: none; a moved item has none left); FELL_BACK:
# the route it was moved from; LIVE: it runs on its provider's live endpoint, not its batch API.
FALLBACK_ROUTES = "fallback_routes"
FELL_BACK = "fell_back_from"
LIVE = "live"


def new_job_id() -> str:
    """An unguessable job id: job ids are bearer handles within the owner's key."""
    return "job_" + secrets.token_hex(8)


class JobStore(Protocol):
    """Blocking methods, called from async code through ``run`` (one thread hop per step)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...

    def ping(self) -> None:
        """One trivial query, for readiness; raises when the database cannot answer."""
        ...

    def create_job(self, job_id: str, identity: str | None, source: str, state: str) -> None: ...

    def job(self, job_id: str) -> JobRow | None: ...

    def list_jobs(self, identity: str | None, limit: int) -> list[JobRow]: ...

    def open_jobs(self, limit: int) -> list[JobRow]:
        """The jobs not ended yet, every caller's, newest first."""
        ...

    def idle_open_jobs(self, before: float) -> list[str]: ...

    def set_job_state(self, job_id: str, state: str, only_from: Sequence[str] = ()) -> bool: ...

    def finish_job_if_done(self, job_id: str) -> str | None: ...

    def gauges(self) -> tuple[int, dict[str, int]]:
        """Jobs not ended, and their items by state."""
        ...

    def tally(self, job_id: str) -> list[tuple[str | None, int | None, int]]:
        """(route, error code or None for a success, items) of a job's ended items."""
        ...

    def delete_job(self, job_id: str) -> bool: ...

    def purge(self, before: float, limit: int = 500) -> list[str]: ...

    def counts(self, job_id: str) -> dict[str, int]: ...

    def job_parts(self, job_id: str) -> list[PartRow]: ...

    def add_items(self, job_id: str, items: Any) -> int: ...

    def part_items(self, part_id: str, pending_only: bool = False) -> list[ItemRow]: ...

    def reroute(self, part_id: str, job_id: str, moves: Sequence[NewItem]) -> int:
        """Move a part's unfinished items, unplanned, to their fallback route (``moves``); how many."""
        ...

    def append_items(self, job_id: str, items: Sequence[NewItem]) -> int | None:
        """Items numbered from 0, placed after the job's total at once; None: the job is not open."""
        ...

    def page(self, job_id: str, cursor: int, limit: int) -> list[tuple[int, str, Any, Any, str | None]]:
        """(idx, state, result, error, the route that ran it) from ``cursor``, in order."""
        ...

    def record(self, job_id: str, rows: Sequence[tuple[int, str, Any, Any]]) -> int:
        """Store (idx, state, result, error) for items not already finished; how many it stored."""
        ...


class JobFallback(Protocol):
    """Resubmit the unfinished items of a part whose remote batch failed whole to their first
    fallback route that takes them (the gateway's ``gateway/job_fallbacks.py``): how many moved.
    Called by the part's driver before it fails what is left."""

    async def __call__(self, store: JobStore, part: PartRow) -> int: ...


class BatchJobs(Protocol):
    """A provider's share of jobs: it stores its items, plans them into remote batches, cancels."""

    def store(self) -> JobStore: ...

    def new_item(self, job_id: str, idx: int, item: Item) -> NewItem: ...

    async def plan(self, job_id: str) -> None: ...

    async def cancel(self, job_id: str) -> None: ...

    def forget(self, job_id: str) -> None:
        """Drop what the runner keeps in memory for a deleted job."""
        ...

    def ended(self, job_id: str) -> None:
        """The job ended (whoever closed it): wake what waits for it here and forget it."""
        ...


async def end_if_done(store: JobStore, job_id: str, metrics: Metrics) -> str | None:
    """Close a sealed job whose items all ended; its final state if this call closed it.

    The one place a job ends, whoever notices (a part's driver, a cancel, a seal with nothing
    left to run), so it is logged and counted once: its items go to ``calls_total`` by route and
    outcome, except a ``mode: batch`` route's (``source: route``), whose calls the gateway counts
    as it answers them."""
    final = await store.run(store.finish_job_if_done, job_id)
    if final is None:
        return None
    job = await store.run(store.job, job_id)
    tally = await store.run(store.tally, job_id)
    done = sum(n for _, code, n in tally if code is None)
    failed = sum(n for _, code, n in tally if code is not None)
    if job is not None and job.source != "route":
        for route, code, n in tally:
            metrics.call_answered(route or UNROUTED, "ok" if code is None else code_label(code), count=n)
    log.info("batch job %s %s: %d succeeded, %d failed", job_id, final, done, failed)
    return final


async def count_jobs(store: JobStore, metrics: Metrics) -> None:
    """The job store's open jobs and their items by state into ``metrics`` (before a scrape)."""
    open_jobs, items = await anyio.to_thread.run_sync(store.gauges, abandon_on_cancel=True)
    metrics.batch_counts(open_jobs, items)
