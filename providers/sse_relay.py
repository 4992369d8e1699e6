"""An upstream's server-sent events read as bytes, for a stream relayed at thousands at once.

Each event is split from the reply's bytes as they come, and its data is left as bytes: a
provider parses only the events it must read (usage, an error, the last event), found by a
search of the bytes, and a face whose events have the upstream's own shape (``ChunkSink.raw``)
gets every other event as the bytes the upstream sent, never decoded or encoded again. Parsing
JSON and encoding it again were most of a relayed chunk's CPU.

The split follows the SSE spec as httpx_sse reads it: lines end at ``\\n``, ``\\r\\n`` or
``\\r``; a blank line ends an event; ``data`` lines join with ``\\n``; comments and blocks of
nothing but comments are skipped; a field's value loses one leading space.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from multiplexer.core.sink import DATA, NAMED, ChunkSink
from multiplexer.transport.connection import Conn


class Event:
    """One event: its name (``message`` when it has none), its data as bytes, and the bytes
    to relay it by (``wire``: the event as the upstream sent it, ending in a blank line), set
    only when it is in one of the two plain forms a face can take as they are."""

    __slots__ = ("data", "form", "name", "wire")

    def __init__(self, name: str, data: bytes, wire: bytes | None, form: str | None) -> None:
        self.name = name
        self.data = data
        self.wire = wire
        self.form = form


class Splitter:
    """A reply's bytes as events, as they come; shared by the stream's task (``events``) and the
    connection's read callback (``Relay``), so neither loses the other's half-read event."""

    __slots__ = ("buf", "cr", "pending")

    def __init__(self) -> None:
        self.buf = b""
        self.cr = False  # the last read ended in ``\r``: it may be half of a ``\r\n``
        self.pending: list[Event] = []  # split by the relay, left for the task, in order

    def feed(self, chunk: bytes) -> list[Event]:
        """The events the bytes so far complete, in order."""
        if self.cr:
            chunk = b"\r" + chunk
            self.cr = False
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                chunk, self.cr = chunk[:-1], True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self.buf + chunk if self.buf else chunk
        out: list[Event] = []
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            # a read of one whole event (a stream's usual one) is that event's bytes, uncopied
            event = block(buf if start == 0 and end + 2 == len(buf) else buf[start:end + 2])
            start = end + 2
            if event is not None:
                out.append(event)
        self.buf = buf[start:] if start else buf
        return out

    def end(self) -> Event | None:
        """An event the body ended in without its blank line, as httpx_sse reads it."""
        buf = self.buf + b"\n" if self.cr else self.buf
        return block(buf.rstrip(b"\n") + b"\n\n") if buf.strip(b"\n") else None


async def events(chunks: AsyncIterator[bytes], splitter: Splitter | None = None) -> AsyncIterator[Event]:
    """The events in a reply's body, each as soon as its blank line arrives (first those the
    relay left to the task)."""
    splitter = splitter or Splitter()
    async for chunk in chunks:
        if splitter.pending:
            pending, splitter.pending = splitter.pending, []
            for event in pending:
                yield event
        for event in splitter.feed(chunk):
            yield event
    for event in splitter.pending:
        yield event
    last = splitter.end()
    if last is not None:
        yield last


def plain(event: Event, raw: str | None) -> bool:
    """Whether an event may go to a reader that takes ``raw`` events as bytes: in that form, and
    a JSON object (what the caller's SDK will parse), before what it says is looked at."""
    data = event.data
    return event.form is not None and event.form == raw and data[:1] == b"{" and data[-1:] == b"}"


class Relay:
    """A stream's events relayed from its upstream connection's read callback (``Conn.relay``)
    while the stream's task waits for bytes with nothing before them: the events that may go
    as they came are written to the reader at once, those of one read in one send, so the
    task is not woken for a chunk (that wake-up and the task's way back to its read were most
    of what a relayed chunk cost after its JSON was no longer parsed; a read behind by several
    events, as on a loaded host, costs one write, not one each). The first event that may not
    (usage, an error, the end) and every one after it are left to the task, in order, and all
    of them when the reader cannot take them now."""

    __slots__ = ("conn", "passes", "raw", "sink", "splitter")

    def __init__(self, conn: Conn, splitter: Splitter, sink: ChunkSink, raw: str,
                 passes: Callable[[Event], bool]) -> None:
        self.conn = conn
        self.splitter = splitter
        self.sink = sink
        self.raw = raw
        self.passes = passes

    def __call__(self) -> bool:
        conn, splitter = self.conn, self.splitter
        if splitter.pending or splitter.cr:
            return False
        for chunk in conn.chunks:
            if b"\r" in chunk:  # line ends to normalise: the task's (rare) way
                return False
        raw, passes, left = self.raw, self.passes, splitter.pending
        out: list[Event] = []  # the events that may go now: written together, in one send
        for chunk in conn.take():
            for event in splitter.feed(chunk):
                if left or not (plain(event, raw) and passes(event)):
                    left.append(event)
                else:
                    out.append(event)
        if out and not self.sink.write_now([event.wire or b"" for event in out]):
            left[:0] = out  # the reader cannot take them now: the task sends them, in order
        if left:
            conn.chunks.append(b"")  # a read for the task, which takes the events left first
            return False
        conn.arm(conn.timeout)  # the read timeout runs from the last bytes read
        return True


def block(wire: bytes) -> Event | None:
    """An event from its lines and the blank line that ends it; None for one with no field
    (comments only, or nothing)."""
    if wire.startswith(b"\n"):
        wire = wire.lstrip(b"\n")
        if not wire:
            return None
    last = len(wire) - 2
    if wire.startswith(b"data: ") and wire.find(b"\n", 0, last) < 0:  # OpenAI's every chunk
        return Event("message", wire[6:last], wire, DATA)
    if wire.startswith(b"event: "):  # Anthropic's and the Responses API's every event
        end = wire.find(b"\n", 0, last)
        if end > 7 and wire.startswith(b"data: ", end + 1) and wire.find(b"\n", end + 1, last) < 0:
            return Event(wire[7:end].decode("utf-8", "replace"), wire[end + 7:last], wire, NAMED)
    raw = wire[:last]
    name: str | None = None
    data: list[bytes] = []
    fields = False
    for line in raw.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
            fields = True
        elif field == b"event":
            name = value.decode("utf-8", "replace")
            fields = True
        elif field in (b"id", b"retry"):
            fields = True
    if not fields:
        return None
    return Event(name or "message", b"\n".join(data), None, None)


def valued(data: bytes, key: bytes) -> bool:
    """Whether JSON ``data`` may hold ``key`` (quoted: ``b'"usage"'``) with a value other than
    ``null``: True whenever a search of the bytes cannot rule it out, so the caller parses. A
    key spelled with escapes is ``escaped``'s to find (one search for every key)."""
    found = data.count(key)
    if not found or found == data.count(key + b":null"):  # OpenAI's every chunk: scans in C
        return False
    at = data.find(key)
    while at >= 0:
        after = at + len(key)
        rest = data[after:after + 24].lstrip()
        if not rest.startswith(b":") or not rest[1:].lstrip().startswith(b"null"):
            return True
        at = data.find(key, after)
    return False


def escaped(data: bytes) -> bool:
    """Whether JSON ``data`` spells a lowercase letter with an escape (``\\u0075``), as no
    encoder does unasked: a key that a search of the bytes would miss could be hidden so."""
    return b"\\u00" in data and (b"\\u006" in data or b"\\u007" in data)
