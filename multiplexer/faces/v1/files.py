"""OpenAI's Files and Batches endpoints: ``/v1/files`` (upload, get, content) and
``/v1/batches`` (create, get, cancel, list), so ``client.files.create(..., purpose="batch")``,
``client.batches.create(...)``, ``client.batches.retrieve(...)`` and ``client.files.content(...)``
work unchanged against the gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.faces.v1.batch_run import Batches
from multiplexer.faces.v1.common import V1, HttpError, page_limit, send_chunks, send_json
from multiplexer.faces.v1.endpoint import Endpoint
from multiplexer.faces.v1.file_policy import expires_s, purpose_of, quotas_for, refusal
from multiplexer.faces.v1.file_store import OverQuota
from multiplexer.faces.v1.openai import OPENAI
from multiplexer.faces.v1.store import BatchRecord, FileRecord, V1Store
from multiplexer.faces.v1.upload_form import upload_form


def not_found(what: str, ident: Any) -> HttpError:
    """404 naming the id and where the caller's own are listed (``GET /v1/files``, ``/v1/batches``)."""
    listing = "GET /v1/files" if what == "file" else "GET /v1/batches"
    return HttpError(404, RpcError(Code.NOT_FOUND, f"No such {what}: {ident!r}; {listing} lists yours"))


class FilesEndpoint(Endpoint):
    metered = True
    surface = OPENAI

    def __init__(self, v1: V1, store: V1Store, batches: Batches, max_bytes: int) -> None:
        super().__init__(v1)
        self.files, self.batches, self.max_bytes = store, batches, max_bytes


class Upload(FilesEndpoint):
    """The form streamed to a temporary file (``upload_form.py``), then into the store a chunk at
    a time once its key's and team's quotas have room for it (``file_policy.py``)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        settings = self.v1.gateway.config.server.files
        async with upload_form(scope, receive, self.files.uploads, self.max_bytes) as form:
            if form.path is None:
                raise HttpError(400, invalid_params("'file' is required"), param="file")
            purpose = purpose_of(form.fields)
            expiry = expires_s(form.fields, purpose, settings)
            quotas = quotas_for(self.v1.gateway.keys, identity, settings)
            source = await anyio.to_thread.run_sync(form.open)
            try:
                record = await self.files.add_file(
                    identity, form.filename or "upload.jsonl", purpose, source, form.size,
                    team=quotas.team, expires_s=expiry, key_max=quotas.key_max,
                    team_max=quotas.team_max)
            except OverQuota as e:
                raise refusal(e, identity, quotas) from None
            finally:
                source.close()
        await send_json(send, 200, record.wire(), headers)


class FileInfo(FilesEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        file_id = scope["path_params"]["file_id"]
        derived = await self._derived(file_id, identity)
        if derived is not None:
            size = 0
            async for chunk in self.batches.output(derived[0], derived[1]):
                size += len(chunk)
            info = self.output_info(file_id, derived[0], size, self._forgotten_at(*derived))
        else:
            info = (await self.uploaded(file_id, identity)).wire()
        await send_json(send, 200, info, headers)

    @staticmethod
    def output_info(file_id: str, record: BatchRecord, size: int,
                    expires_at: int | None = None) -> dict[str, Any]:
        """A batch's output or error file, as a file object (built from its results when asked for)."""
        return {"id": file_id, "object": "file", "bytes": size, "created_at": record.created_at,
                "filename": file_id + ".jsonl", "purpose": "batch_output", "status": "processed",
                "expires_at": expires_at, "status_details": None}

    def _forgotten_at(self, record: BatchRecord, errors: bool, status: str) -> int | None:
        """When an ended batch, and with it its output and error files, is forgotten
        (``store.retention_s`` after it ended); None while it is kept."""
        retention = self.v1.gateway.config.store.retention_s
        ended = record.ended.get(status)
        return None if retention is None or ended is None else int(ended + retention)

    async def uploaded(self, file_id: str, identity: str | None) -> FileRecord:
        found = await self.files.file(file_id, identity)
        if found is None:
            raise not_found("file", file_id)
        return found

    async def _derived(self, file_id: str, identity: str | None) -> tuple[BatchRecord, bool, str] | None:
        """(the batch, whether its error file, its status) for a batch's output or error file."""
        for suffix, errors in (("-output", False), ("-error", True)):
            if file_id.startswith("file-batch_") and file_id.endswith(suffix):
                record = await self.batches.get(file_id[len("file-"):-len(suffix)], identity)
                if record is None:
                    raise not_found("file", file_id)
                view = await self.batches.wire(record)
                if view["output_file_id" if not errors else "error_file_id"] != file_id:
                    raise not_found("file", file_id)  # not ended, or nothing in it
                return record, errors, view["status"]
        return None


class DeleteFile(FileInfo):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        file_id = scope["path_params"]["file_id"]
        found = await self.uploaded(file_id, identity)  # output files are views of a batch
        await self.batches.keep_bodies(file_id, identity)  # a running batch outlives its file
        await self.files.delete_file(found.id)
        await send_json(send, 200, {"id": file_id, "object": "file", "deleted": True}, headers)


class ListFiles(FilesEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        purpose = Request(scope).query_params.get("purpose")
        records = await self.files.list_files(identity, purpose)
        await send_json(send, 200, {"object": "list", "data": [r.wire() for r in records],
                                    "has_more": False}, headers)


class FileContent(FileInfo):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        file_id = scope["path_params"]["file_id"]
        derived = await self._derived(file_id, identity)
        if derived is None:
            found = await self.uploaded(file_id, identity)
            await send_sized(send, found.bytes, self.files.chunks(found), headers)
            return
        await send_chunks(send, b"application/jsonl", self.batches.output(derived[0], derived[1]),
                          headers)


async def send_sized(send: Send, size: int, chunks: AsyncIterator[bytes],
                     headers: list[tuple[bytes, bytes]]) -> None:
    """A stored file, a chunk at a time as the store gives them (its length known: no chunked
    encoding). The first chunk is read before anything is sent, so a store that fails at once
    still gets its error reply."""
    first = await anext(chunks, b"")
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/jsonl"), (b"content-length", str(size).encode()), *headers]})
    await send({"type": "http.response.body", "body": first, "more_body": True})
    async for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


class CreateBatch(FilesEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        body = await self.v1.read_json(scope, receive)
        record = await self.batches.create(identity, body)
        await send_json(send, 200, await self.batches.wire(record), headers)


class GetBatch(FilesEndpoint):
    async def record(self, scope: Scope, identity: str | None) -> BatchRecord:
        batch_id = scope["path_params"]["batch_id"]
        record = await self.batches.get(batch_id, identity)
        if record is None:
            raise not_found("batch", batch_id)
        return record

    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        record = await self.record(scope, identity)
        await send_json(send, 200, await self.batches.wire(record), headers)


class CancelBatch(GetBatch):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        record = await self.record(scope, identity)
        view = await self.batches.wire(record)
        if view["status"] in ("completed", "failed", "expired"):
            raise HttpError(409, invalid_params(f"batch {record.id} is {view['status']}; only a "
                                                "running batch can be cancelled"))
        await self.batches.cancel(record)
        await send_json(send, 200, await self.batches.wire(record), headers)


class ListBatches(FilesEndpoint):
    async def handle(self, scope: Scope, receive: Receive, send: Send, identity: str | None,
                     headers: list[tuple[bytes, bytes]]) -> None:
        query = Request(scope).query_params
        limit = page_limit(query, 100)
        page, more = await self.batches.mine(identity, "openai", limit, query.get("after"))
        data = [await self.batches.wire(r) for r in page]
        await send_json(send, 200, {
            "object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}, headers)
