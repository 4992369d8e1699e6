"""The stream face's event writer: the provider's task writes each chunk, in order, once."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from multiplexer.faces.v1.sse import _Events

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Wire:
    """An ASGI ``send`` that keeps every message, and the server's flush, counted."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.flushes = 0

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def flush(self) -> None:
        self.flushes += 1

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(m["body"]) for m in self.messages if m["type"] == "http.response.body"]


def encode(chunk: dict[str, Any]) -> bytes:
    if chunk.get("bad"):
        raise ValueError("not encodable")
    return json.dumps(chunk).encode()


def events(wire: Wire) -> _Events:
    return _Events(wire.send, encode, lambda: [(b"x-route", b"chat")], "chat", wire.flush)


async def test_the_head_goes_once_with_the_first_event_and_is_flushed_at_once() -> None:
    wire = Wire()
    out = events(wire)
    for n in range(3):
        await out.send({"n": n})
    assert [m["type"] for m in wire.messages] == ["http.response.start"] + ["http.response.body"] * 3
    assert (b"x-route", b"chat") in wire.messages[0]["headers"]
    assert wire.bodies() == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert wire.flushes == 1  # the first event leaves now; the rest join the loop's turn


async def test_chunks_from_a_callback_that_cannot_await_keep_their_order() -> None:
    wire = Wire()
    out = events(wire)
    for n in range(3):
        out.send_nowait({"n": n})  # a local model's step callback
    assert wire.bodies() == []  # not written inside the callback
    await out.send({"n": 3})  # drains what was queued first
    out.send_nowait({"n": 4})
    await out.flushed()
    assert wire.bodies() == [{"n": n} for n in range(5)]
    assert out.drainer is None


async def test_a_chunk_that_cannot_be_encoded_ends_the_stream_for_the_provider() -> None:
    wire = Wire()
    out = events(wire)
    await out.send({"n": 0})
    with pytest.raises(anyio.BrokenResourceError):
        await out.send({"bad": True})
    assert out.broken is not None and out.broken.code == -32603
    with pytest.raises(anyio.BrokenResourceError):
        await out.send({"n": 1})
    with pytest.raises(anyio.BrokenResourceError):
        out.send_nowait({"n": 2})
    assert wire.bodies() == [{"n": 0}]


async def test_the_final_usage_event_and_what_follows_wait_to_be_priced() -> None:
    wire = Wire()
    out = events(wire)
    await out.send({"choices": [{"delta": {"content": "hi"}}]})
    await out.send({"choices": [], "usage": {"total_tokens": 3}})  # OpenAI's usage chunk
    await out.send({"choices": [{"delta": {}}]})
    assert wire.bodies() == [{"choices": [{"delta": {"content": "hi"}}]}]
    assert out.held == [{"choices": [], "usage": {"total_tokens": 3}}, {"choices": [{"delta": {}}]}]


async def test_a_cancelled_call_stops_its_drain() -> None:
    wire = Wire()
    gate = anyio.Event()

    async def slow(message: dict[str, Any]) -> None:
        await gate.wait()
        wire.messages.append(message)

    out = _Events(slow, encode, list, "chat", None)
    out.send_nowait({"n": 0})
    await anyio.sleep(0)  # the drain starts and waits on the client
    assert out.drainer is not None and not out.drainer.done()
    drainer = out.drainer
    out.stop()
    with pytest.raises(BaseException):  # noqa: B017 - cancelled
        await drainer
    assert drainer.cancelled() and wire.messages == []
