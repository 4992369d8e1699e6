"""Uploaded files in the job store, a chunk at a time (``multiplexer/jobs/v1_files.py``): the part
of ``V1Store`` that writes, reads, expires and deletes them.

A file goes in from a file on disk (the upload's temporary file), ``CHUNK`` bytes per store call,
after its row has been reserved against its key's and team's quotas; it is served once its last
chunk is in, read back the same way, and never again once it has expired.
"""

from __future__ import annotations

import io
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import anyio

from multiplexer.jobs.store import JobStore
from multiplexer.jobs.v1_files import CHUNK, NewFile, Over

log = logging.getLogger(__name__)
STALE_S = 3600  # an upload still unfinished this long after it began lost its gateway
_EXPIRED_TOO: ContextVar[bool] = ContextVar("v1_expired_files_too", default=False)


@dataclass
class FileRecord:
    id: str
    owner: str | None
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> FileRecord:
        return cls(row[0], row[1] or None, *row[2:])

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class OverQuota(Exception):
    """An upload that would take its key or team past the bytes of files it may keep."""

    def __init__(self, over: Over, size: int) -> None:
        super().__init__(f"{over.column} quota {over.limit} bytes, {over.usage} kept, file {size}")
        self.over, self.size = over, size


@contextmanager
def expired_too() -> Iterator[None]:
    """Within it, ``file`` finds expired files too: the sweep keeps a running batch's request
    bodies from its input file before deleting that file."""
    token = _EXPIRED_TOO.set(True)
    try:
        yield
    finally:
        _EXPIRED_TOO.reset(token)


def _owner(owner: str | None) -> str:
    return "" if owner is None else owner


class StoredFiles:
    """Mixed into ``V1Store``: ``_st`` opens the store, ``wall`` is the wall clock (tests move it)."""

    wall: Callable[[], float] = time.time
    _st: Callable[[], Awaitable[JobStore]]

    def _now(self) -> int:
        return int(self.wall())

    async def add_file(self, owner: str | None, filename: str, purpose: str, source: BinaryIO,
                       size: int, *, team: str | None = None, expires_s: int | None = None,
                       key_max: int | None = None, team_max: int | None = None) -> FileRecord:
        """Store ``size`` bytes read from ``source``, once the owner's quota (``key_max``) and its
        team's (``team_max``) have room for them (``OverQuota`` otherwise)."""
        created = self._now()
        expires_at = None if expires_s is None else created + expires_s
        new = NewFile(new_file_id(), _owner(owner), team or "", filename, purpose, size, created,
                      expires_at)
        limits = [(column, most) for column, most in (("owner", key_max), ("team", team_max))
                  if most is not None and (column == "owner" or team)]
        st = await self._st()
        over = await st.run(st.reserve_file, new, limits, created)
        if over is not None:
            raise OverQuota(over, size)
        try:
            n = 0
            while data := await anyio.to_thread.run_sync(source.read, CHUNK):
                await st.run(st.put_file_chunk, new.id, n, data)
                n += 1
            await st.run(st.finish_file, new.id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                try:
                    await st.run(st.delete_file, new.id)
                except Exception:  # the store is away: the sweep removes the unfinished upload
                    log.exception("file %s: could not remove its unfinished upload", new.id)
            raise
        return FileRecord(new.id, owner, size, created, filename, purpose, expires_at)

    async def put_file(self, owner: str | None, filename: str, purpose: str, content: bytes,
                       expires_s: int | None = None) -> FileRecord:
        """A file whose bytes are at hand (tests, small files)."""
        return await self.add_file(owner, filename, purpose, io.BytesIO(content), len(content),
                                   expires_s=expires_s)

    async def file(self, file_id: str, owner: str | None) -> FileRecord | None:
        """The owner's file, unless it has expired (inside ``expired_too``: even then)."""
        if not file_id.startswith("file-"):
            return None
        st = await self._st()
        now = None if _EXPIRED_TOO.get() else self._now()
        row = await st.run(st.file_row, file_id, _owner(owner), now)
        return None if row is None else FileRecord.from_row(row)

    async def list_files(self, owner: str | None, purpose: str | None = None) -> list[FileRecord]:
        st = await self._st()
        rows = await st.run(st.list_files, _owner(owner), purpose, self._now())
        return [FileRecord.from_row(row) for row in rows]

    async def chunks(self, record: FileRecord) -> AsyncIterator[bytes]:
        """The file's bytes, a chunk per store call."""
        st = await self._st()
        n = 0
        while (data := await st.run(st.file_chunk, record.id, n)) is not None:
            yield data
            n += 1

    async def content(self, record: FileRecord) -> bytes:
        """The whole file, for a reader that needs it whole (a batch's lines)."""
        return b"".join([chunk async for chunk in self.chunks(record)])

    async def delete_file(self, file_id: str) -> None:
        st = await self._st()
        await st.run(st.delete_file, file_id)

    async def files_due(self, limit: int) -> list[tuple[str, str | None]]:
        """(id, owner) of up to ``limit`` files the sweep deletes: expired, or uploads that never
        finished (``STALE_S``)."""
        st = await self._st()
        now = self._now()
        return [(i, o or None) for i, o in await st.run(st.files_due, now, now - STALE_S, limit)]


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def uploads_beside(path: str | Path) -> Path:
    """The folder of uploads in progress: beside the store's SQLite file (``jobs.db.uploads``)."""
    path = Path(path)
    return path.with_name(path.name + ".uploads")
