"""How an ``mcp`` upstream is reached: its settings, and a transport per connection attempt.

Each attempt gets a fresh transport (a new child process or HTTP session); the
read side is watched so the session supervisor learns at once that a child died
or a stream ended, instead of at the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TextIO

import anyio
import httpx2
from mcp import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from multiplexer.core.paths import ConfigPath, base_dir

from .mcp_limits import ToolLimit
from .mcp_logs import LogRouter

_PYTHON_ALIASES = {"python", "python3"}
log = logging.getLogger(__name__)


class McpSettings(BaseModel):
    """Keys of a ``kind: mcp`` provider; exactly one of ``command`` (stdio) or ``url`` (HTTP)."""

    model_config = ConfigDict(extra="forbid")

    command: str | None = Field(
        default=None, description="the child's program; `python`: this interpreter; a relative path"
                                  " (./server) is looked up in `cwd`")
    args: list[str] = Field(
        default_factory=list, description="the child's arguments; a relative file name is `cwd`'s")
    # A list names variables the child may inherit (an allow-list); a mapping sets values.
    env: list[str] | dict[str, str] = Field(default_factory=dict)
    cwd: ConfigPath | None = Field(
        default=None, description="the child's working folder (relative: to the config's folder);"
                                  " unset: the config file's folder, so a config names its upstream's"
                                  " files beside it and runs from any folder")
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    protocol: Literal["auto", "legacy", "2026-07-28"] = "auto"
    max_pages: int = Field(default=20, ge=1)
    idempotent_tools: list[str] = Field(default_factory=list)
    restart_backoff_ms: float = Field(default=100, ge=0)
    max_backoff_ms: float = Field(default=10_000, ge=0)
    connect_timeout_ms: float = Field(default=15_000, gt=0)
    # Relay the upstream's log messages (notifications/message) to the callers that asked.
    forward_logs: bool = True
    pin: bool = Field(
        default=True, description="tool pinning: each tool's definition is hashed at first sight and a"
        " tool whose definition changes is quarantined (hidden, its calls refused with -32010) until"
        " an admin approves it (docs/mcp.md, \"Tool pinning\"); false: changes are served at once")
    tool_limits: dict[str, ToolLimit] = Field(
        default_factory=dict, description="per-tool rpm, concurrency and timeout_ms by glob over the"
        " upstream's tool names, shared by every route to this provider (docs/mcp.md)")

    @model_validator(mode="after")
    def _one_transport(self) -> McpSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("set exactly one of 'command' (stdio) or 'url' (Streamable HTTP)")
        return self

    @model_validator(mode="after")
    def _child_in_config_folder(self, info: ValidationInfo) -> McpSettings:
        base = base_dir(info)
        if self.command is not None and self.cwd is None and base is not None:
            self.cwd = str(base)
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


PACKAGES = str(Path(__file__).resolve().parents[1])  # holds multiplexer/ and providers/


def stdio_parameters(settings: McpSettings) -> StdioServerParameters:
    """``command: python`` means this interpreter, so configs work where no ``python`` is on PATH,
    and with this interpreter's ``PYTHONPATH``: the child inherits only an allow-list of the
    environment, and packages the gateway imports from there (installed with ``--target``, say)
    must import in its Python child too."""
    assert settings.command is not None
    python = settings.command in _PYTHON_ALIASES
    command = sys.executable if python else settings.command
    if isinstance(settings.env, list):
        env = {k: os.environ[k] for k in settings.env if k in os.environ}
    else:
        env = dict(settings.env)
    if python:  # and the folder this gateway's packages come from: `-m multiplexer...` finds them
        given = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        paths = [p for p in given.split(os.pathsep) if p]
        if PACKAGES not in paths:
            paths.append(PACKAGES)
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return StdioServerParameters(command=command, args=list(settings.args), env=env or None,
                                 cwd=settings.cwd)


@asynccontextmanager
async def _http_streams(settings: McpSettings, read_timeout_s: float) -> AsyncIterator[Any]:
    assert settings.url is not None
    timeout = httpx2.Timeout(30.0, read=max(read_timeout_s, 300.0))
    async with (
        httpx2.AsyncClient(headers=settings.headers, timeout=timeout) as http,
        streamable_http_client(settings.url, http_client=http) as streams,
    ):
        yield streams


class StderrRelay:
    """A stdio child's stderr, line by line, into this log with its provider's name in front (it
    went to the gateway's own stderr unmarked, where nobody could tell whose it was). The last
    line is kept until a connection is up: a child that dies says why there, which readiness
    shows."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.last: str | None = None
        self._fd: int | None = None
        self._partial = b""

    def open(self) -> TextIO:
        """The write end for the child (ours to close once it has its own copy); lines read as
        they come, on the event loop (no task, no thread)."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        self._fd, self._partial = read, b""
        asyncio.get_running_loop().add_reader(read, self._read)
        return os.fdopen(write, "w")

    def _read(self) -> None:
        assert self._fd is not None
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self.close()
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._line(line)

    def _line(self, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip()
        if text:
            self.last = text[:500]
            log.info("%s: %s", self.name, text)

    def close(self) -> None:
        """Stop reading: what the child wrote before it ended is read first."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        asyncio.get_running_loop().remove_reader(fd)
        with contextlib.suppress(OSError):
            while data := os.read(fd, 65536):
                *lines, self._partial = (self._partial + data).split(b"\n")
                for line in lines:
                    self._line(line)
        os.close(fd)
        if self._partial:
            self._line(self._partial)
            self._partial = b""


@asynccontextmanager
async def _stdio_streams(settings: McpSettings, relay: StderrRelay) -> AsyncIterator[Any]:
    errlog = relay.open()
    try:
        async with stdio_client(stdio_parameters(settings), errlog=errlog) as streams:
            errlog.close()  # the child holds its own copy: its end is the pipe's end
            yield streams
    finally:
        errlog.close()
        relay.close()


def open_transport(settings: McpSettings, read_timeout_s: float,
                   relay: StderrRelay | None = None) -> AbstractAsyncContextManager[Any]:
    """A fresh transport; a stdio child's stderr goes through ``relay`` (the gateway's own stderr
    without one)."""
    if settings.command is not None:
        if relay is None:
            return stdio_client(stdio_parameters(settings))
        return _stdio_streams(settings, relay)
    return _http_streams(settings, read_timeout_s)


class WatchedReadStream:
    """A read stream that calls ``on_end`` when the transport's read side ends for any reason,
    and shows the ``LogRouter`` every message in wire order."""

    def __init__(self, inner: Any, on_end: Callable[[], None], router: LogRouter | None = None) -> None:
        self._inner = inner
        self._on_end = on_end
        self._router = router

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            item = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_end()
            raise
        if self._router is not None:
            self._router.received(item, self.last_context)
        return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> WatchedReadStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class RoutedWriteStream:
    """A write stream that shows the ``LogRouter`` each message, in the task that sends it."""

    def __init__(self, inner: Any, router: LogRouter) -> None:
        self._inner = inner
        self._router = router

    async def send(self, item: Any, /) -> None:
        self._router.sent(item)
        await self._inner.send(item)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> RoutedWriteStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


@asynccontextmanager
async def watched(transport: AbstractAsyncContextManager[Any], on_end: Callable[[], None],
                  router: LogRouter | None = None) -> AsyncIterator[Any]:
    """Wrap a transport so its end is observable and its log messages find their calls; pass the
    result to ``mcp.Client``."""
    async with transport as (read_stream, write_stream):
        write = RoutedWriteStream(write_stream, router) if router is not None else write_stream
        yield WatchedReadStream(read_stream, on_end, router), write
