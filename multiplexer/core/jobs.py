"""The contracts of batch jobs: the durable job store and a provider's batch runner.

The ``jobs.*`` face and the providers with a batch API meet here, so the face
depends on these shapes, not on the SQLite store or a provider's job manager.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from multiplexer.core.call import Item
from multiplexer.core.jobrows import JobRow, NewItem, PartRow

T = TypeVar("T")


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

    def idle_open_jobs(self, before: float) -> list[str]: ...

    def set_job_state(self, job_id: str, state: str, only_from: Sequence[str] = ()) -> bool: ...

    def finish_job_if_done(self, job_id: str) -> str | None: ...

    def delete_job(self, job_id: str) -> bool: ...

    def purge(self, before: float, limit: int = 500) -> list[str]: ...

    def counts(self, job_id: str) -> dict[str, int]: ...

    def job_parts(self, job_id: str) -> list[PartRow]: ...

    def add_items(self, job_id: str, items: Any) -> int: ...

    def append_items(self, job_id: str, items: Sequence[NewItem]) -> int | None:
        """Items numbered from 0, placed after the job's total at once; None: the job is not open."""
        ...

    def page(self, job_id: str, cursor: int, limit: int) -> list[tuple[int, str, Any, Any]]: ...

    def record(self, job_id: str, rows: Sequence[tuple[int, str, Any, Any]]) -> int:
        """Store (idx, state, result, error) for items not already finished; how many it stored."""
        ...


class BatchJobs(Protocol):
    """A provider's share of jobs: it stores its items, plans them into remote batches, cancels."""

    def store(self) -> JobStore: ...

    def new_item(self, job_id: str, idx: int, item: Item) -> NewItem: ...

    async def plan(self, job_id: str) -> None: ...

    async def cancel(self, job_id: str) -> None: ...

    def forget(self, job_id: str) -> None:
        """Drop what the runner keeps in memory for a deleted job."""
        ...
