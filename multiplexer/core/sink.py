"""Where a streamed call's chunks go: the face's reader (its event writer, or any stream with
``send``, ``send_nowait`` and ``close``), behind a thin wrapper that notes when the first chunk
leaves (its time to first chunk, on the call's span and in
``/metrics``), so no provider has to measure it."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

# The shapes of a reader's events on the wire (``ChunkSink.raw``): OpenAI's chat and completions
# streams are ``data:`` lines only; Anthropic's and the Responses API's name each event.
DATA = "data"
NAMED = "named"


class Reader(Protocol):
    """The face's end of a stream (an anyio memory stream's send side fits)."""

    async def send(self, chunk: Any) -> None: ...

    def send_nowait(self, chunk: Any) -> None: ...

    def close(self) -> None: ...


class ChunkSink:
    """``send`` / ``send_nowait`` / ``close`` of the face's reader; ``first`` runs once, as the
    first chunk is handed over (before it is sent, so a reader gone still counts it). A chunk
    is an object, or an event's bytes as the upstream sent them where ``raw`` says the reader
    takes them."""

    __slots__ = ("_first", "_stream", "_write_now", "hold", "raw", "sent")

    def __init__(self, stream: Reader,
                 first: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self._first: Callable[[], None] | None = first or _nothing
        # a call that may still fall back keeps its reader's stream open while nothing was sent
        self.hold = False
        # chunks handed to the reader: what an abandoned stream is billed for (one token each)
        self.sent = 0
        # the shape of the reader's events on the wire ("data": OpenAI's ``data:`` lines,
        # "named": ``event:`` and ``data:``), when it takes an upstream's event in that shape as
        # the upstream's bytes (``providers/sse_relay.py``); None: chunks only as objects
        self.raw: str | None = getattr(stream, "raw", None)
        self._write_now: Callable[[list[bytes]], bool] | None = getattr(stream, "write_now", None)

    def reading(self, stream: Reader) -> ChunkSink:
        """The same call's sink handing its chunks to ``stream`` (a reader wrapping this one's),
        its first chunk still running this one's ``first``."""
        return ChunkSink(stream, self._first)

    @property
    def started(self) -> bool:
        """Whether a chunk has been handed to the reader (then the call can no longer fall back)."""
        return self._first is None

    def _started(self) -> None:
        first, self._first = self._first, None
        if first is not None:
            first()

    async def send(self, chunk: Any) -> None:
        if self._first is not None:
            self._started()
        self.sent += 1
        await self._stream.send(chunk)

    @property
    def writes_now(self) -> bool:
        """Whether the reader can take a raw chunk at once, outside any task (``write_now``)."""
        return self._write_now is not None and self.raw is not None

    def write_now(self, chunks: list[bytes]) -> bool:
        """Raw chunks (the events one read completed) written at once and together where the
        reader can (a chunk already went the usual way, and nothing waits before these); False
        where they must each be ``send``."""
        write = self._write_now
        if write is None or self._first is not None or not write(chunks):
            return False
        self.sent += len(chunks)
        return True

    def send_nowait(self, chunk: Any) -> None:
        if self._first is not None:
            self._started()
        self.sent += 1
        self._stream.send_nowait(chunk)

    def close(self) -> None:
        """The reader sees the end of the stream (not yet while ``hold``ing an unstarted one)."""
        if self.hold and self._first is not None:
            return
        self._stream.close()

    def __enter__(self) -> ChunkSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _nothing() -> None:
    pass
