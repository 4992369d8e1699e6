"""Span export in a process of its own: the gateway hands finished spans over a pipe, and a
child process encodes them as OTLP and sends them with the SDK's own OTLP exporter.

Why a process: the SDK's OTLP encoder costs about 60 µs per span (measured on the 2-core
host, protobuf's upb backend), two spans per call, and in the gateway's process that CPU is
taken under the GIL from the event loop, even on the span processor's thread. Here the event
loop only appends a compact tuple per span; a sender thread pickles them in batches (C code,
a few µs a span) and writes them to the child's stdin; the child rebuilds ``ReadableSpan``
objects and exports them (its exporter reads the usual ``OTEL_EXPORTER_OTLP_*`` variables).

A child that dies is started again (at most every ``RESTART_S``); spans that could not be
handed over are dropped and counted, never blocking a call. When the queue is full (the child
falls behind), new spans are dropped and counted, as the SDK's batch processor does.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any, cast

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

log = logging.getLogger(__name__)

MAX_QUEUE = 8192  # spans waiting for the sender; beyond this they are dropped and counted
BATCH = 512  # spans per frame
FLUSH_S = 0.5  # the longest a span waits in the queue
RESTART_S = 5.0  # the least time between two starts of the child
DRAIN_S = 3.0  # after the gateway closes the pipe, the most the child spends sending what is left
NICE = 10  # the child's scheduling priority, lowered by this much
FRAMES = 64  # frames the child holds before it stops reading the pipe
TELL_S = 60.0  # dropped spans are logged at most this often
_LEN = struct.Struct("!I")

Compact = tuple[Any, ...]


Ids = tuple[int, int, int, "list[tuple[str, str]] | None"]  # trace id, span id, flags, state


def ids_of(c: Any) -> Ids | None:
    """A span context as the plain values that cross the pipe."""
    if c is None:
        return None
    return c.trace_id, c.span_id, int(c.trace_flags), list(c.trace_state.items()) if c.trace_state else None


def compact(span: ReadableSpan) -> Compact:
    """A finished span as plain values (picklable, rebuilt by ``rebuild``). The call path's own
    spans make theirs from their fields (``compact()``); this serves every other span (the MCP
    SDK's)."""
    fast = getattr(span, "compact", None)
    if fast is not None:
        return fast()  # type: ignore[no-any-return]
    scope = span.instrumentation_scope
    status = span.status
    return (span.name, ids_of(span.context), ids_of(span.parent), int(span.kind.value),
            span.start_time, span.end_time, dict(span.attributes or {}),
            [(ids_of(link.context), dict(link.attributes or {})) for link in span.links],
            [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events],
            int(status.status_code.value), status.description,
            (scope.name, scope.version) if scope is not None else None)


class ProcessSpanProcessor(SpanProcessor):
    """Hands ended spans to an exporting child process (see the module's docstring)."""

    def __init__(self, endpoint: str | None, resource: dict[str, Any],
                 program: Sequence[str] | None = None, restart_s: float = RESTART_S) -> None:
        self.endpoint = endpoint
        self.resource = resource
        self.program = list(program) if program is not None else [
            sys.executable, "-m", "multiplexer.gateway.span_export"]
        self.restart_s = restart_s
        self.queue: collections.deque[Compact] = collections.deque()
        self.dropped = 0
        self.child: subprocess.Popen[bytes] | None = None
        self._started_at = -float("inf")
        self._wake = threading.Event()
        self._stop = False
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.take(compact(span))

    def take(self, span: Compact) -> None:
        """A sampled span, compacted (the call path's own spans come straight here)."""
        if len(self.queue) >= MAX_QUEUE:
            self.dropped += 1
            return
        self.queue.append(span)
        if len(self.queue) >= BATCH:
            self._wake.set()

    def _run(self) -> None:
        told, told_at = 0, -float("inf")
        while not self._stop:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self._send()
            if self.dropped > told and time.monotonic() - told_at >= TELL_S:  # at most once a minute
                log.warning("%d spans dropped so far (the export process fell behind or was away)",
                            self.dropped)
                told, told_at = self.dropped, time.monotonic()

    def _send(self) -> bool:
        """Everything queued so far to the child; False when it could not be handed over."""
        with self._send_lock:
            ok = True
            while self.queue:
                batch = [self.queue.popleft() for _ in range(min(len(self.queue), BATCH))]
                pipe = self._pipe()
                if pipe is None:
                    self.dropped += len(batch)
                    ok = False
                    continue
                frame = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    pipe.write(_LEN.pack(len(frame)) + frame)
                    pipe.flush()
                except (BrokenPipeError, OSError, ValueError):
                    log.warning("the span export process is gone; %d spans dropped, starting it again",
                                len(batch))
                    self.dropped += len(batch)
                    self._reap()
                    ok = False
            return ok

    def _pipe(self) -> IO[bytes] | None:
        child = self.child
        if child is not None and child.poll() is None:
            return child.stdin
        if child is not None:
            self._reap()
        if time.monotonic() - self._started_at < self.restart_s:
            return None
        self._started_at = time.monotonic()
        try:
            self.child = subprocess.Popen(
                [*self.program, self.endpoint or "", json.dumps(self.resource)],
                stdin=subprocess.PIPE, start_new_session=True)  # a Ctrl-C to the gateway's group
            # must not stop it before the gateway has handed over its last spans
        except OSError:
            log.exception("the span export process could not be started")
            return None
        return self.child.stdin

    def _reap(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            if child.stdin is not None:
                with contextlib.suppress(OSError):
                    child.stdin.close()
            if child.poll() is None:
                child.kill()
            child.wait()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._send()

    def shutdown(self) -> None:
        """Send what is queued, then let the child export it and exit (EOF on its stdin)."""
        self._stop = True
        self._wake.set()
        self._thread.join(5)
        self._send()
        child, self.child = self.child, None
        if child is None:
            return
        try:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(DRAIN_S + 2)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()


# -- the child ---------------------------------------------------------------------------

def rebuild(c: Compact, resource: Any) -> ReadableSpan:
    from opentelemetry.sdk.trace import Event
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

    def ctx(v: Any, remote: bool = False) -> SpanContext | None:
        if v is None:
            return None
        trace_id, span_id, flags, state = v
        return SpanContext(trace_id, span_id, remote, TraceFlags(flags), TraceState(state) if state else None)

    name, context, parent, kind, start, end, attributes, links, events, code, description, scope = c
    return ReadableSpan(
        name, context=ctx(context), parent=ctx(parent), resource=resource, attributes=attributes,
        events=[Event(n, a, timestamp=t) for n, t, a in events],
        links=[Link(cast(SpanContext, ctx(lc)), la) for lc, la in links], kind=SpanKind(kind),
        status=Status(StatusCode(code), description), start_time=start, end_time=end,
        instrumentation_scope=InstrumentationScope(*scope) if scope is not None else None)


def _read(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def main(argv: list[str]) -> int:
    """Export the frames of compact spans read from stdin until EOF, then whatever is left of
    them for up to ``DRAIN_S`` (an unreachable collector must not hold the gateway's exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway ends it by closing the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(os, "nice"):  # background work: on a busy machine the calls' processes go first,
        os.nice(NICE)  # and spans wait (or, past MAX_QUEUE, are dropped and counted)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource

    endpoint = argv[0] or None
    resource = Resource(json.loads(argv[1]))
    exporter = OTLPSpanExporter(endpoint=endpoint)
    stdin = os.fdopen(sys.stdin.fileno(), "rb", buffering=1 << 16)
    frames: queue.Queue[bytes | None] = queue.Queue(maxsize=FRAMES)  # full: the pipe fills, and
    # the gateway's sender waits (its own thread, never the event loop) while its queue fills
    drained = threading.Event()

    def export_all() -> None:
        while (frame := frames.get()) is not None:
            exporter.export([rebuild(c, resource) for c in pickle.loads(frame)])
        drained.set()

    threading.Thread(target=export_all, name="export", daemon=True).start()
    while (head := _read(stdin, _LEN.size)) is not None:
        frame = _read(stdin, _LEN.unpack(head)[0])
        if frame is None:
            break
        frames.put(frame)
    frames.put(None)
    drained.wait(DRAIN_S)
    exporter.shutdown()  # ends a retry still waiting on the collector
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
