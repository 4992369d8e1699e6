"""A ``multipart/form-data`` upload read as it arrives (``POST /v1/files``): its ``file`` part
written to a temporary file in the store's uploads folder, up to ``WRITE_AT`` bytes at a time, its
other parts kept as short strings.

So an upload never is whole in memory: the request's reads are bounded by the server's flow
control, the file part by ``WRITE_AT``. The file part is cut off with a 413 as soon as it passes
``server.max_file_bytes`` (the whole body soon after, its declared length at once), and the
temporary file is removed when the request ends, whatever happened.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import anyio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Receive, Scope

from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.faces.body import BodyTooLarge, ClientGone, body_chunks
from multiplexer.faces.v1.common import HttpError

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

WRITE_AT = 1 << 20  # file bytes gathered before they go to disk
FORM_SLACK = 64 * 1024  # the body besides the file: boundaries, part headers, the small fields
MAX_PARTS = 16
MAX_FIELD_BYTES = 4096
MAX_FILENAME = 255
FORM = "a multipart/form-data body with 'file' and 'purpose'"


@dataclass
class UploadForm:
    fields: dict[str, str]
    path: Path | None  # the file part on disk; None when there was none
    filename: str | None
    size: int

    def open(self) -> BinaryIO:
        assert self.path is not None
        return self.path.open("rb")


def bad_form(detail: str, param: str | None = None) -> HttpError:
    return HttpError(400, invalid_params(f"{FORM} is required: {detail}"), param=param)


def too_large(max_file_bytes: int) -> HttpError:
    return HttpError(413, RpcError(Code.TOO_LARGE, f"File too large: the most one file may have is "
                                   f"{max_file_bytes} bytes (server.max_file_bytes)",
                                   {"max_file_bytes": max_file_bytes}), param="file")


@dataclass
class _Parts:
    """The parser's callbacks: what each part is, its bytes routed as they come."""

    max_file_bytes: int
    fields: dict[str, str] = field(default_factory=dict)
    pending: bytearray = field(default_factory=bytearray)  # file bytes not yet on disk
    has_file: bool = False
    filename: str | None = None
    size: int = 0
    parts: int = 0
    ended: bool = False
    _name: str = ""
    _is_file: bool = False
    _value: bytearray = field(default_factory=bytearray)
    _header: list[bytes] = field(default_factory=lambda: [b"", b""])
    _disposition: bytes = b""

    def callbacks(self) -> MultipartCallbacks:
        return cast("MultipartCallbacks", {
            "on_part_begin": self.on_part_begin, "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end, "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished, "on_end": self.on_end})

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise bad_form(f"at most {MAX_PARTS} parts")
        self._disposition, self._value = b"", bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header[0] += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header[1] += data[start:end]

    def on_header_end(self) -> None:
        if self._header[0].lower() == b"content-disposition":
            self._disposition = self._header[1]
        self._header = [b"", b""]

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise bad_form("each part needs a Content-Disposition with a name")
        self._name = name.decode("utf-8", "replace")
        self._is_file = self._name == "file"
        if self._is_file:
            if self.has_file:
                raise bad_form("one file per upload", "file")
            self.has_file = True
            filename = options.get(b"filename", b"").decode("utf-8", "replace")
            if len(filename) > MAX_FILENAME:
                raise bad_form(f"a filename of at most {MAX_FILENAME} characters", "file")
            self.filename = filename or None
        elif self._name in self.fields:
            raise bad_form(f"{self._name!r} given twice", self._name)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.size += end - start
            if self.size > self.max_file_bytes:
                raise too_large(self.max_file_bytes)
            self.pending += data[start:end]
        elif len(self._value) + end - start > MAX_FIELD_BYTES:
            raise bad_form(f"{self._name!r} of at most {MAX_FIELD_BYTES} bytes", self._name)
        else:
            self._value += data[start:end]

    def on_part_end(self) -> None:
        if not self._is_file:
            self.fields[self._name] = self._value.decode("utf-8", "replace")

    def on_end(self) -> None:
        self.ended = True

    def take(self) -> bytes:
        out = bytes(self.pending)
        self.pending.clear()
        return out


def _temporary(folder: Path) -> tuple[BinaryIO, Path]:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix="upload-", suffix=".part")
    return os.fdopen(fd, "wb"), Path(name)


async def _receive(scope: Scope, receive: Receive, folder: Path, max_file_bytes: int,
                   parts: _Parts, spool: list[Any]) -> None:
    """Parse the body into ``parts``, the file's bytes into a temporary file (``spool``: the
    open file and its path, once made)."""
    headers = dict(scope["headers"])
    kind, params = parse_options_header(headers.get(b"content-type", b""))
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise bad_form("the request's content-type is not multipart/form-data with a boundary")
    parser = MultipartParser(boundary, parts.callbacks())

    async def flush() -> None:
        if not spool:
            spool.extend(await anyio.to_thread.run_sync(_temporary, folder))
        await anyio.to_thread.run_sync(spool[0].write, parts.take())

    try:
        async for chunk in body_chunks(headers.get(b"content-length"), receive,
                                       max_file_bytes + FORM_SLACK):
            parser.write(chunk)
            if len(parts.pending) >= WRITE_AT:
                await flush()
    except BodyTooLarge:
        raise too_large(max_file_bytes) from None
    except ClientGone:
        raise HttpError(499, RpcError(Code.CANCELLED, "Client closed the request")) from None
    except MultipartParseError as e:
        raise bad_form(str(e)) from None
    if not parts.ended:
        raise bad_form("the body ends before the form's closing boundary")
    if parts.has_file:
        await flush()
        await anyio.to_thread.run_sync(spool[0].close)


@asynccontextmanager
async def upload_form(scope: Scope, receive: Receive, folder: Path,
                      max_file_bytes: int) -> AsyncIterator[UploadForm]:
    """The upload's form, its file on disk while the block runs; removed after, and on any error."""
    parts = _Parts(max_file_bytes)
    spool: list[Any] = []  # the temporary file, open, and its path, once made
    try:
        await _receive(scope, receive, folder, max_file_bytes, parts, spool)
        yield UploadForm(parts.fields, spool[1] if spool else None, parts.filename, parts.size)
    finally:
        if spool:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_discard, spool[0], spool[1])


def _discard(out: BinaryIO, path: Path) -> None:
    out.close()
    with suppress(FileNotFoundError):
        path.unlink()


def clear_stale(folder: Path, older_than: float) -> int:
    """Remove uploads' temporary files last written before ``older_than`` (wall time): left by a
    gateway that was killed mid-upload. How many were removed."""
    removed = 0
    with suppress(FileNotFoundError):
        for path in folder.glob("upload-*.part"):
            with suppress(FileNotFoundError):
                if path.stat().st_mtime < older_than:
                    path.unlink()
                    removed += 1
    return removed
