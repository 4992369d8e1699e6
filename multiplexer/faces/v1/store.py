"""Durable files and batch records for OpenAI's Files and Batch API and Anthropic's Message
Batches, in the job store (``multiplexer/jobs/``: the SQLite file at ``store.path``, or the
PostgreSQL database at ``store.url`` that every replica shares).

Uploaded files are kept as they came, a chunk at a time (``file_store.py``); a batch's record
says where each input line went (a job on a provider's batch API, or the lanes), written once at
creation; the lines that end outside its job (refused at creation, or run through the lanes) each
get a result row as they finish, so a restarted gateway, or another replica, still answers for
all of them. A message batch's requests come inline: they are kept in its record (and so are a
batch's bodies when its input file is deleted before its lane lines ran). Everything belongs to
the key that created it: another key gets "not found".
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from multiplexer.faces.v1.file_store import FileRecord, StoredFiles, uploads_beside
from multiplexer.jobs.store import JobStore
from multiplexer.jobs.stores import acquire, release, sqlite_shared

__all__ = ["BatchRecord", "FileRecord", "V1Store"]


@dataclass
class BatchRecord:
    id: str
    owner: str | None
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    metadata: dict[str, Any] | None = None
    custom_ids: list[str] = field(default_factory=list)
    job_id: str | None = None  # the job holding the lines for providers with a batch API
    job_lines: list[int] = field(default_factory=list)  # job index -> line
    lane_lines: list[int] = field(default_factory=list)  # lines run through the lanes
    errors: list[dict[str, Any]] | None = None  # validation errors: the batch failed
    cancelled_at: int | None = None
    ended: dict[str, int] = field(default_factory=dict)  # status -> when it was first seen
    kind: str = "openai"  # or "anthropic": a Message Batch (id msgbatch_..., requests inline)
    counts: dict[str, int] | None = None  # a message batch's final request counts, once ended
    total: int = 0  # its lines
    own_total: int = 0  # its lines outside the job: refused at creation, or run in the lanes
    lines_loaded: bool = True  # custom_ids, job_lines and lane_lines (a listing leaves them out)
    held_until: float | None = None  # (wall time) a gateway runs its lane lines until then

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> BatchRecord:
        lines = {k: row.pop(k) for k in ("custom_ids", "job_lines", "lane_lines") if k in row}
        return cls(id=row["id"], owner=row["owner"], endpoint=row["endpoint"],
                   input_file_id=row["input_file_id"], completion_window=row["completion_window"],
                   created_at=row["created"], metadata=row["metadata"], job_id=row["job_id"],
                   errors=row["errors"], cancelled_at=row["cancelled_at"], ended=row["ended"],
                   kind=row["kind"], counts=row["counts"], total=row["total"],
                   own_total=row["own_total"], held_until=row["runner_until"],
                   lines_loaded=bool(lines), **lines)


BATCH_PREFIXES = ("batch_", "msgbatch_")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


_last_ns = 0


def new_batch_id(prefix: str) -> str:
    """Unguessable, and in creation order (as Anthropic's are): listings sort by (created_at,
    id), and batches made within one second must still come newest first."""
    global _last_ns
    _last_ns = max(time.time_ns(), _last_ns + 1)
    return f"{prefix}{_last_ns:016x}{secrets.token_hex(8)}"


def now() -> int:
    return int(time.time())


class V1Store(StoredFiles):
    """The ``/v1`` face's view of the job store: async methods, each one hop to the store's
    thread. The store is opened on first use (as the job managers open theirs) and shared with
    them: one connection per database and process. Uploads in progress wait on disk in
    ``uploads``, beside the SQLite file."""

    def __init__(self, path: str | Path, url: str | None = None, lease_s: float = 30.0,
                 schema: str = "multiplexer") -> None:
        self._where = (path, url, lease_s, schema)
        self.uploads = uploads_beside(path)
        self.lease_s = lease_s
        self.runner = secrets.token_hex(6)  # this process, as the holder of the batches it runs
        self._store: JobStore | None = None
        self._opening = threading.Lock()

    def store(self) -> JobStore:
        """Blocking: opens the store on first use."""
        with self._opening:
            if self._store is None:
                self._store = acquire(*self._where)
            return self._store

    def close(self) -> None:
        with self._opening:
            if self._store is not None:
                release(self._store)
                self._store = None

    def opened(self) -> bool:
        return self._store is not None

    def shared(self) -> bool:
        """Whether other gateways share the store (``store.url``), or other workers of this one
        its SQLite file (``serve --workers N``)."""
        return self._where[1] is not None or sqlite_shared()

    def exists(self) -> bool:
        """Whether there is a store to read: shared, opened here, or a SQLite file on disk (a
        sweep of a store nobody made would make the file for nothing, where a user ran a demo)."""
        return self.shared() or self.opened() or Path(self._where[0]).exists()

    async def _st(self) -> JobStore:
        if self._store is not None:
            return self._store
        return await anyio.to_thread.run_sync(self.store)

    # -- batch records ---------------------------------------------------------------------
    async def create_batch(self, record: BatchRecord, results: Sequence[tuple[int, str, int, Any]] = (),
                           requests: bytes | None = None) -> None:
        """Write a new batch's record once, with ``results`` (line, custom_id, status, body) of
        the lines that ended at creation, and its kept request bodies."""
        record.total = len(record.custom_ids)
        record.own_total = len(record.lane_lines) + len(results)
        row = {"id": record.id, "owner": record.owner, "kind": record.kind,
               "endpoint": record.endpoint, "input_file_id": record.input_file_id,
               "completion_window": record.completion_window, "created": record.created_at,
               "metadata": record.metadata, "total": record.total, "own_total": record.own_total,
               "job_id": record.job_id, "errors": record.errors, "cancelled_at": record.cancelled_at,
               "ended": record.ended, "counts": record.counts, "runner_until": None}
        lines = {"custom_ids": record.custom_ids, "job_lines": record.job_lines,
                 "lane_lines": record.lane_lines}
        st = await self._st()
        await st.run(st.create_batch, row, lines, requests, results)

    async def update(self, record: BatchRecord, column: str) -> None:
        """Save one of the record's small fields: ``cancelled_at``, ``ended`` or ``counts``."""
        st = await self._st()
        await st.run(st.update_batch, record.id, column, getattr(record, column))

    async def delete_batch(self, batch_id: str) -> None:
        st = await self._st()
        await st.run(st.delete_batch, batch_id)

    async def put_requests(self, batch_id: str, content: bytes) -> None:
        """A batch's request bodies (kept when its input file is deleted), for a restarted
        gateway's lane lines."""
        st = await self._st()
        await st.run(st.update_batch, batch_id, "requests", content)

    async def requests(self, batch_id: str) -> bytes | None:
        st = await self._st()
        return await st.run(st.batch_requests, batch_id)

    async def batch(self, batch_id: str, owner: str | None, *,
                    everyone: bool = False) -> BatchRecord | None:
        if not batch_id.startswith(BATCH_PREFIXES):
            return None
        st = await self._st()
        row = await st.run(st.batch_row, batch_id, owner, everyone)
        return None if row is None else BatchRecord.from_row(row)

    async def load_lines(self, record: BatchRecord) -> BatchRecord:
        """The record with its per-line lists (a listing's records come without them)."""
        if not record.lines_loaded:
            st = await self._st()
            lines = await st.run(st.batch_lines, record.id) or {}
            record.custom_ids = lines.get("custom_ids", [])
            record.job_lines = lines.get("job_lines", [])
            record.lane_lines = lines.get("lane_lines", [])
            record.lines_loaded = True
        return record

    async def page(self, owner: str | None, kind: str, limit: int, after: str | None = None,
                   before: str | None = None) -> tuple[list[BatchRecord], bool]:
        """A page of the owner's batches of one API, newest first, and whether there are more."""
        st = await self._st()
        rows, more = await st.run(st.list_batches, owner, kind, limit, after, before)
        return [BatchRecord.from_row(r) for r in rows], more

    async def created_before(self, before: int) -> list[BatchRecord]:
        st = await self._st()
        return [BatchRecord.from_row(r) for r in await st.run(st.batches_created_before, before)]

    async def reading(self, owner: str | None, file_id: str) -> list[str]:
        """The owner's batches whose input file is ``file_id``."""
        st = await self._st()
        return await st.run(st.batches_reading, owner, file_id)

    # -- lane lines: who runs them, and their results -------------------------------------
    async def owed(self) -> list[str]:
        """Batches with lane lines left to run that no live gateway is running."""
        st = await self._st()
        return await st.run(st.owed_batches, time.time())

    async def hold(self, batch_id: str, renew: bool = False) -> bool:
        """Take the batch's lane lines for this gateway (``renew``: extend a hold not run out)."""
        st = await self._st()
        wall = time.time()
        return await st.run(st.hold_batch, batch_id, self.runner, wall, wall + self.lease_s, renew)

    async def release(self, batch_id: str) -> None:
        st = await self._st()
        await st.run(st.release_batch, batch_id, self.runner)

    async def add_results(self, batch_id: str, rows: Sequence[tuple[int, str, int, Any]], *,
                          held: bool = False) -> None:
        """``held``: a runner's page, stored only while this gateway holds the batch."""
        st = await self._st()
        await st.run(st.add_results, batch_id, rows, self.runner if held else None, time.time())

    async def results(self, batch_id: str, lo: int = 0, hi: int | None = None,
                      bodies: bool = True) -> dict[int, dict[str, Any]]:
        """Line -> {status, raw: the body's JSON text} of lines ``lo`` to ``hi`` with a result
        ({status} alone without ``bodies``)."""
        st = await self._st()
        return await st.run(st.results, batch_id, lo, hi, bodies)

    async def result_counts(self, batch_id: str) -> tuple[int, int]:
        """(lines outside the job that ended, of which succeeded)."""
        st = await self._st()
        return await st.run(st.result_counts, batch_id)

    async def done_lines(self, batch_id: str) -> set[int]:
        st = await self._st()
        return await st.run(st.done_lines, batch_id)
