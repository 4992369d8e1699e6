"""Streamed replies for the fakes: the reply's words one event each, with knobs to fail mid-stream
(`stream_error_after`), to hold the stream after its first event until a test opens `stream_gate`,
and a count of streams that ended early because the client went away (`streams_cut`,
`stream_cut` set when given)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import StreamingResponse


@dataclass
class StreamKnobs:
    stream_error_after: int | None = None  # events sent before an error event
    stream_gate: anyio.Event | None = None  # held after the first event until set
    streams_cut: int = 0
    streams_done: int = 0
    stream_cut: anyio.Event | None = None  # set (when given) as a stream is cut


def words(reply: str) -> list[str]:
    parts = reply.split(" ")
    return [p if i == 0 else " " + p for i, p in enumerate(parts)]


def sse(events: Callable[[], AsyncIterator[tuple[str | None, Any]]], knobs: StreamKnobs,
        error: Callable[[], tuple[str | None, Any]]) -> StreamingResponse:
    """Serialise (event name, data) pairs; `data` "[DONE]" is sent raw."""

    async def body() -> AsyncIterator[bytes]:
        sent, finished = 0, False
        try:
            async for name, data in events():
                if knobs.stream_error_after is not None and sent >= knobs.stream_error_after:
                    name, data = error()
                    yield _encode(name, data)
                    finished = True
                    return
                yield _encode(name, data)
                sent += 1
                if sent == 1 and knobs.stream_gate is not None:
                    await knobs.stream_gate.wait()
            finished = True
        finally:
            if finished:
                knobs.streams_done += 1
            else:
                knobs.streams_cut += 1
                if knobs.stream_cut is not None:
                    knobs.stream_cut.set()

    return StreamingResponse(body(), media_type="text/event-stream")


def _encode(name: str | None, data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {text}\n\n".encode()
