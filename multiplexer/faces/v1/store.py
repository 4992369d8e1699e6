"""Durable files and batch records for OpenAI's Files and Batch API and Anthropic's Message
Batches, next to the job store.

Uploaded files are kept as they came, with a small JSON record each; a batch's record says
where each input line went (a job on a provider's batch API, or the lanes) and holds the
lane lines' results as they finish, so a restarted gateway still answers for both. A message
batch's requests come inline: they are kept as ``files/<batch id>``, seen by no files listing
(and so are a batch's bodies when its input file is deleted before its lane lines ran).
Everything belongs to the key that created it: another key gets "not found".
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio


@dataclass
class FileRecord:
    id: str
    owner: str | None
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


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
    lane_results: dict[str, Any] = field(default_factory=dict)  # str(line) -> {status, body}
    early: dict[str, Any] = field(default_factory=dict)  # str(line) -> refused at creation
    errors: list[dict[str, Any]] | None = None  # validation errors: the batch failed
    cancelled_at: int | None = None
    ended: dict[str, int] = field(default_factory=dict)  # status -> when it was first seen
    kind: str = "openai"  # or "anthropic": a Message Batch (id msgbatch_..., requests inline)
    counts: dict[str, int] | None = None  # a message batch's final request counts, once ended


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


class V1Store:
    """One directory: ``files/<id>`` (content) and ``<id>.json`` records."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"

    def _open(self) -> None:
        self.files.mkdir(parents=True, exist_ok=True)

    async def put_file(self, owner: str | None, filename: str, purpose: str,
                       content: bytes) -> FileRecord:
        record = FileRecord(new_id("file-"), owner, len(content), now(), filename, purpose)

        def write() -> None:
            self._open()
            (self.files / record.id).write_bytes(content)
            self._write(record.id, asdict(record))

        await anyio.to_thread.run_sync(write)
        return record

    async def file(self, file_id: str, owner: str | None) -> FileRecord | None:
        data = await anyio.to_thread.run_sync(self._read, file_id, "file-")
        record = FileRecord(**data) if data else None
        return record if record is not None and record.owner == owner else None

    async def delete_file(self, record: FileRecord) -> None:
        def remove() -> None:
            (self.root / f"{record.id}.json").unlink(missing_ok=True)
            (self.files / record.id).unlink(missing_ok=True)

        await anyio.to_thread.run_sync(remove)

    async def list_files(self, owner: str | None) -> list[FileRecord]:
        def scan() -> list[FileRecord]:
            if not self.root.is_dir():
                return []
            found = [FileRecord(**json.loads(p.read_text())) for p in self.root.glob("file-*.json")]
            return sorted((r for r in found if r.owner == owner), key=lambda r: (r.created_at, r.id),
                          reverse=True)

        return await anyio.to_thread.run_sync(scan)

    async def content(self, record: FileRecord) -> bytes:
        return await anyio.to_thread.run_sync((self.files / record.id).read_bytes)

    async def save_batch(self, record: BatchRecord) -> None:
        await anyio.to_thread.run_sync(self._write, record.id, asdict(record))

    async def delete_batch(self, batch_id: str) -> None:
        def remove() -> None:
            (self.root / f"{batch_id}.json").unlink(missing_ok=True)
            (self.files / batch_id).unlink(missing_ok=True)  # a message batch's requests

        await anyio.to_thread.run_sync(remove)

    async def put_requests(self, batch_id: str, content: bytes) -> None:
        """A batch's request bodies (a message batch's inline requests), kept for a restarted
        gateway's lane lines."""
        def write() -> None:
            self._open()
            (self.files / batch_id).write_bytes(content)

        await anyio.to_thread.run_sync(write)

    async def requests(self, batch_id: str) -> bytes | None:
        try:
            return await anyio.to_thread.run_sync((self.files / batch_id).read_bytes)
        except FileNotFoundError:
            return None

    async def batch(self, batch_id: str, owner: str | None) -> BatchRecord | None:
        data = await anyio.to_thread.run_sync(self._read, batch_id, BATCH_PREFIXES)
        record = BatchRecord(**data) if data else None
        return record if record is not None and record.owner == owner else None

    async def batches(self, owner: str | None = None, *, everyone: bool = False) -> list[BatchRecord]:
        def scan() -> list[BatchRecord]:
            if not self.root.is_dir():
                return []
            out = []
            for path in [*self.root.glob("batch_*.json"), *self.root.glob("msgbatch_*.json")]:
                record = BatchRecord(**json.loads(path.read_text()))
                if everyone or record.owner == owner:
                    out.append(record)
            return sorted(out, key=lambda r: (r.created_at, r.id), reverse=True)

        return await anyio.to_thread.run_sync(scan)

    def _write(self, name: str, data: dict[str, Any]) -> None:
        """Atomically: a crash leaves the old record or the new one, never half of one; each
        write has its own temporary file, as two may save one record at once (a cancel and a
        page of results)."""
        self._open()
        tmp = self.root / f".{name}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, self.root / f"{name}.json")

    def _read(self, name: str, prefix: str | tuple[str, ...]) -> dict[str, Any] | None:
        bare = name.replace("-", "").replace("_", "")
        if not name.startswith(prefix) or not (bare.isascii() and bare.isalnum()):
            return None  # ids are ours: nothing else may name a path
        path = self.root / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
