"""The relayed stream: an upstream's events reach a face of the same shape as the upstream's own
bytes, only the events that carry usage, an error or the end are parsed, and what a stream
costs is still booked from its usage (or, abandoned, from the chunks it was sent)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.sink import ChunkSink
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from providers.sse_relay import DATA, NAMED, Relay, Splitter, escaped, events, valued

pytestmark = pytest.mark.anyio
KEY = "sk-stream-relay-0123456789"
ADMIN = "adm-stream-relay-" + "x" * 24
# As an upstream may write them: spaces a re-encoding would drop, an escape it would not keep
CONTENT = [b'{"id": "c1",  "object": "chat.completion.chunk", "choices": [{"index": 0, '
           b'"delta": {"content": "h\\u00e9llo"}, "finish_reason": null}], "usage": null}',
           b'{"id": "c1", "choices": [{"index": 0, "delta": {"content": " the \\"usage\\" is"}, '
           b'"finish_reason": null}],\n"usage" : null}'.replace(b"\n", b""),
           b'{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}']
USAGE = b'{"id": "c1", "choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 2000, ' \
        b'"total_tokens": 3000}}'


async def collect(chunks: list[bytes]) -> list[tuple[str, bytes, bytes | None, str | None]]:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return [(e.name, e.data, e.wire, e.form) async for e in events(source())]


async def test_events_are_split_as_the_sse_spec_reads_them() -> None:
    # a plain data event, split mid-line and with its blank line split across reads
    assert await collect([b"data: {\"a\"", b": 1}\n", b"\n"]) == [
        ("message", b'{"a": 1}', b'data: {"a": 1}\n\n', DATA)]
    # \r\n line ends, a \r\n cut between two reads, a comment block, a named event
    assert await collect([b": ping\r\n\r\nevent: x\r", b"\ndata: {}\r\n\r", b"\n"]) == [
        ("x", b"{}", b"event: x\ndata: {}\n\n", NAMED)]
    # lines joined, id and retry, no space after the colon, lone \r: parsed, never relayed raw
    assert await collect([b"id: 7\ndata:1\rdata: 2\n\nretry: 5\n\n"]) == [
        ("message", b"1\n2", None, None), ("message", b"", None, None)]
    # the last event without its blank line still counts, as httpx_sse reads it
    assert await collect([b"data: [DONE]"]) == [("message", b"[DONE]", b"data: [DONE]\n\n", DATA)]


def test_usage_is_found_only_with_a_value() -> None:
    assert not valued(CONTENT[0], b'"usage"')  # null
    assert not valued(CONTENT[1], b'"usage"')  # in the text (escaped quotes), and null after spaces
    assert valued(USAGE, b'"usage"')
    assert valued(b'{"usage":\n{"prompt_tokens": 1}}', b'"usage"')
    assert escaped(b'{"\\u0075sage": {"prompt_tokens": 1}}')  # spelled with escapes: parsed
    assert not escaped(CONTENT[0])  # an escape of no ASCII letter
    assert valued(b'{"error": {"message": "x"}}', b'"error"')
    assert not valued(b'{"error": null}', b'"error"')


class Upstream:
    """A bare HTTP/1.1 upstream streaming ``events`` (each one chunk), then holding the stream
    open when ``hold`` (until the gateway lets go), else ending it with ``[DONE]``."""

    def __init__(self, events: list[bytes], hold: bool = False, gap_s: float = 0.0) -> None:
        self.events = events
        self.hold = hold
        self.gap_s = gap_s  # between events: each its own read, as a model's tokens come
        self.bodies: list[bytes] = []
        self.let_go = anyio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        self.bodies.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for data in self.events:
            event = data if data.startswith(b"event: ") else b"data: " + data + b"\n\n"
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
        if self.hold:
            await reader.read()  # b"" once the gateway closes the connection
            self.let_go.set()
        else:
            event = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event))
            await writer.drain()
        writer.close()


@asynccontextmanager
async def gateway(tmp_path: Path, upstream: Upstream,
                  kind: str = "openai") -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}" + ("/v1" if kind == "openai" else "")
    config = {
        "server": {"api_keys": {"alice": {"key": KEY}}, "admin_key": ADMIN},
        "store": {"path": str(tmp_path / "jobs.db")},
        "spend": {"flush_interval_s": 0.05},
        "providers": {"up": {"kind": kind, "base_url": base, "api_key": "sk-up",
                             "retry": {"attempts": 1},
                             "price": {"input_per_mtok": 2, "output_per_mtok": 10}}},
        "routes": {"chat": {"provider": "up", "operation": "chat" if kind == "openai" else "messages",
                            "models": ["gpt-relay" if kind == "openai" else "claude-relay"]}},
    }
    try:
        async with (
            running(parse_config(config), port=0) as (gw, url),
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                              timeout=30) as client,
        ):
            yield gw, client
    finally:
        server.close()


def ask(**more: Any) -> dict[str, Any]:
    return {"model": "gpt-relay", "messages": [{"role": "user", "content": "one two three"}],
            "stream": True, **more}


async def spend(client: httpx.AsyncClient, calls: int) -> Decimal:
    """The booked total once ``calls`` calls are in the spend report."""
    with anyio.fail_after(10):
        while True:
            r = await client.get("/admin/spend", headers={"authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200, r.text
            total = r.json()["total"]
            if total["calls"] >= calls:
                assert total["calls"] == calls
                return Decimal(str(total["cost_usd"]))
            await anyio.sleep(0.02)


async def test_a_relayed_stream_is_the_upstreams_bytes_and_is_priced_from_its_usage(tmp_path: Path) -> None:
    async with gateway(tmp_path, Upstream([*CONTENT, USAGE])) as (_, client):
        r = await client.post("/v1/chat/completions",
                              json=ask(stream_options={"include_usage": True}))
        assert r.status_code == 200, r.text
        events = r.content.split(b"\n\n")
        assert events[:3] == [b"data: " + c for c in CONTENT]  # byte for byte, never re-encoded
        assert events[4:] == [b"data: [DONE]", b""]
        # the usage chunk was read: priced (1,000 in at $2, 2,000 out at $10 per million)
        usage = httpx.Response(200, content=events[3][6:]).json()["usage"]
        cost = Decimal(1000 * 2 + 2000 * 10) / 10**6
        assert Decimal(usage["cost_usd"]) == cost and usage["completion_tokens"] == 2000
        assert await spend(client, 1) == cost
        # a caller that did not ask for the usage chunk gets none (the gateway asked for it)
        r = await client.post("/v1/chat/completions", json=ask())
        assert r.content.split(b"\n\n") == [*(b"data: " + c for c in CONTENT), b"data: [DONE]", b""]
        assert await spend(client, 2) == 2 * cost


async def test_an_error_chunk_is_read_not_relayed(tmp_path: Path) -> None:
    error = b'{"error": {"message": "the model fell over", "type": "server_error"}}'
    async with gateway(tmp_path, Upstream([CONTENT[0], error])) as (_, client):
        r = await client.post("/v1/chat/completions", json=ask())
        events = r.content.split(b"\n\n")
        assert events[0] == b"data: " + CONTENT[0]
        assert b"the model fell over" in events[1] and events[1] != b"data: " + error  # our error event
        assert b"[DONE]" not in r.content


async def abandoned(tmp_path: Path, chunks: int) -> Decimal:
    """What a stream its client left after ``chunks`` relayed chunks is booked at."""
    upstream = Upstream(CONTENT[:1] * chunks, hold=True, gap_s=0.01)  # relayed from the callback
    async with gateway(tmp_path, upstream) as (_, client):
        async with client.stream("POST", "/v1/chat/completions", json=ask()) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == chunks:
                    break  # every chunk read: the client goes away
        with anyio.fail_after(10):
            await upstream.let_go.wait()  # the gateway closed the upstream stream too
        return await spend(client, 1)


async def test_an_abandoned_relayed_stream_is_booked_by_the_chunks_it_was_sent(tmp_path: Path) -> None:
    """Chunks relayed as bytes count as sent: two more cost two more output tokens."""
    three, five = await abandoned(tmp_path / "3", 3), await abandoned(tmp_path / "5", 5)
    assert three > 0
    assert five - three == Decimal(2 * 10) / 10**6


def test_the_servers_chunk_writer_frames_chunks_and_never_ends_a_body() -> None:
    """A chunk after the head goes out framed as uvicorn frames it; an empty one (an event that
    encodes to nothing) writes nothing, since an empty chunk would end the body; and where
    uvicorn's own send must act (no head yet, a client reading slower, the response over) the
    writer says so."""
    from types import SimpleNamespace

    from multiplexer.faces.server_protocol import JoinedWrites, _chunk_writer

    written: list[bytes] = []
    transport = SimpleNamespace(write=written.append, is_closing=lambda: False)
    joined = JoinedWrites(transport, SimpleNamespace())  # type: ignore[arg-type]  # write_now needs no loop
    cycle = SimpleNamespace(response_started=True, chunked_encoding=True, response_complete=False,
                            disconnected=False, flow=SimpleNamespace(write_paused=False),
                            scope={"method": "POST"})
    write = _chunk_writer(cycle, joined)  # type: ignore[arg-type]
    assert write(b"data: {}\n\n") and write(b"")
    assert written == [b"a\r\ndata: {}\n\n\r\n"]
    for field, value in (("response_started", False), ("response_complete", True)):
        setattr(cycle, field, value)
        assert not write(b"x")
        setattr(cycle, field, not value)
    cycle.flow.write_paused = True
    assert not write(b"x") and written == [b"a\r\ndata: {}\n\n\r\n"]


async def test_chunks_are_relayed_from_the_read_callback_in_order(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Spaced chunks go out from the upstream connection's read callback while the stream's task
    waits (no wake-up a chunk), in order and as they came; the usage chunk and the end are left
    to the task, which still prices the call."""
    relayed: list[bool] = []
    call = Relay.__call__

    def counted(self: Relay) -> bool:
        relayed.append(call(self))
        return relayed[-1]

    monkeypatch.setattr(Relay, "__call__", counted)
    content = [CONTENT[0], CONTENT[1]] * 5 + [CONTENT[2]]
    async with gateway(tmp_path, Upstream([*content, USAGE], gap_s=0.01)) as (_, client):
        r = await client.post("/v1/chat/completions",
                              json=ask(stream_options={"include_usage": True}))
        events = r.content.split(b"\n\n")
        assert events[:len(content)] == [b"data: " + c for c in content]
        assert b'"cost_usd"' in events[len(content)] and events[-2:] == [b"data: [DONE]", b""]
        assert relayed.count(True) >= 5  # most chunks never woke the task
        assert await spend(client, 1) == Decimal(1000 * 2 + 2000 * 10) / 10**6


class _Conn:
    """What the relay reads of an upstream connection: its parsed chunks and its read timer."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.timeout = 5.0
        self.armed = 0

    def take(self) -> list[bytes]:
        chunks, self.chunks = self.chunks, []
        return chunks

    def arm(self, timeout: float | None) -> None:
        self.armed += 1


class _Reader:
    """A face's end that takes raw events now (``write_now``), or refuses them all."""

    raw = DATA

    def __init__(self, takes: bool) -> None:
        self.takes = takes
        self.writes: list[list[bytes]] = []

    def write_now(self, events: list[bytes]) -> bool:
        if self.takes:
            self.writes.append(list(events))
        return self.takes

    async def send(self, chunk: Any) -> None: ...

    def send_nowait(self, chunk: Any) -> None: ...

    def close(self) -> None: ...


def _relay(reader: _Reader, chunks: list[bytes]) -> tuple[Relay, _Conn, ChunkSink]:
    sink = ChunkSink(reader)
    sink._started()  # a chunk already went the usual way (the head with it)
    conn = _Conn(chunks)
    usage = lambda event: not valued(event.data, b'"usage"')  # noqa: E731
    return Relay(conn, Splitter(), sink, DATA, usage), conn, sink  # type: ignore[arg-type]


def test_the_events_of_one_read_leave_in_one_write_and_the_rest_wait_in_order() -> None:
    """A read behind by several events (a loaded host) is one write of them all, counted as
    that many chunks handed over; the usage event and what follows are the task's, in order."""
    wire = [b"data: " + c + b"\n\n" for c in CONTENT]
    reader = _Reader(takes=True)
    relay, conn, sink = _relay(reader, [wire[0] + wire[1], wire[2]])
    assert relay() is True
    assert reader.writes == [wire] and sink.sent == 3 and conn.armed == 1
    usage = b"data: " + USAGE + b"\n\n"
    conn.chunks = [wire[0] + usage + wire[1]]
    assert relay() is False  # the usage event: the task is woken for it and the one after it
    assert reader.writes[-1] == [wire[0]] and sink.sent == 4
    assert [e.wire for e in relay.splitter.pending] == [usage, wire[1]]
    assert conn.chunks == [b""]  # a read for the task, which takes the events left first


def test_events_a_reader_cannot_take_now_are_all_left_to_the_task_in_order() -> None:
    wire = [b"data: " + c + b"\n\n" for c in CONTENT]
    reader = _Reader(takes=False)
    relay, _conn, sink = _relay(reader, [wire[0] + wire[1] + b"data: " + USAGE + b"\n\n"])
    assert relay() is False
    assert reader.writes == [] and sink.sent == 0
    assert [e.wire for e in relay.splitter.pending] == [wire[0], wire[1], b"data: " + USAGE + b"\n\n"]


def named(kind: str, data: bytes) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def test_anthropic_named_events_are_relayed_as_they_came(tmp_path: Path) -> None:
    """Anthropic's content events go on as the upstream's bytes; message_start and message_delta
    (usage) are read, and the delta carries the cost of both."""
    start = b'{"type": "message_start", "message": {"id": "m1", "type": "message", "role": ' \
            b'"assistant", "model": "claude-relay", "content": [], "usage": {"input_tokens": 1000, ' \
            b'"output_tokens": 1}}}'
    content = [named("content_block_start", b'{"type": "content_block_start",  "index": 0, '
                                            b'"content_block": {"type": "text", "text": ""}}'),
               named("ping", b'{"type": "ping"}')] + [
        named("content_block_delta", b'{"type": "content_block_delta", "index": 0, '
                                     b'"delta": {"type": "text_delta", "text": "w\\u00f6rd %d "}}' % i)
        for i in range(4)] + [named("content_block_stop", b'{"type": "content_block_stop", "index": 0}')]
    delta = b'{"type": "message_delta", "delta": {"stop_reason": "end_turn"}, ' \
            b'"usage": {"output_tokens": 2000}}'
    events = [named("message_start", start), *content, named("message_delta", delta),
              named("message_stop", b'{"type": "message_stop"}')]
    async with gateway(tmp_path, Upstream(events, gap_s=0.01), kind="anthropic") as (_, client):
        r = await client.post("/v1/messages", json={
            "model": "claude-relay", "max_tokens": 100, "stream": True,
            "messages": [{"role": "user", "content": "one two three"}]})
        assert r.status_code == 200, r.text
        out = [e + b"\n\n" for e in r.content.split(b"\n\n") if e]
        assert out[1:1 + len(content)] == content  # byte for byte, spaces and escapes kept
        usage = httpx.Response(200, content=out[-2].split(b"data: ", 1)[1]).json()["usage"]
        cost = Decimal(1000 * 2 + 2000 * 10) / 10**6
        assert Decimal(usage["cost_usd"]) == cost
        assert await spend(client, 1) == cost
