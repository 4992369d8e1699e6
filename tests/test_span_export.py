"""Span export through the exporting child process: a real gateway process with
``telemetry.otlp_endpoint`` sends OTLP/HTTP protobuf to a receiver on 127.0.0.1, and a child
that dies is started again."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider

from benchmarks._procs import child, free_port
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.tracing import TraceSlot
from multiplexer.gateway.otel import OtelTracer
from multiplexer.gateway.span_export import ProcessSpanProcessor

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Receiver:
    """An OTLP/HTTP collector on 127.0.0.1: each request's spans, decoded, on a queue."""

    def __init__(self) -> None:
        self.requests: queue.Queue[ExportTraceServiceRequest] = queue.Queue()
        got = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                got.put(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self, want: int, timeout: float = 30.0) -> list[tuple[Any, Any]]:
        """(resource, span) pairs until ``want`` spans have arrived."""
        out: list[tuple[Any, Any]] = []
        while len(out) < want:
            request = self.requests.get(timeout=timeout)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    out += [(rs.resource, s) for s in ss.spans]
        return out


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, daemon=True)
    thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


def attrs(span: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


def test_a_gateway_process_exports_its_spans_as_otlp(tmp_path, receiver) -> None:
    fake_port, port = free_port(), free_port()
    conf = tmp_path / "gateway.yaml"
    conf.write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
store: {{path: {tmp_path / 'jobs.db'}}}
telemetry: {{otlp_endpoint: '{receiver.url}', service_name: gw-under-test}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake_port}/v1", api_key: sk-test}}
routes:
  chat: {{provider: oai, operation: chat, models: [gpt-test]}}
""")
    url = f"http://127.0.0.1:{port}"
    fake = ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port)]
    with child(fake, f"http://127.0.0.1:{fake_port}/"), \
            child(["-m", "multiplexer", "serve", "--config", str(conf)], f"{url}/healthz"):
        for n in range(3):
            reply = httpx.post(f"{url}/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                               json={"model": "gpt-test", "messages": [{"role": "user", "content": f"q{n}"}]},
                               timeout=30)
            assert reply.status_code == 200, reply.text
        got = receiver.spans(6)  # a call span and its upstream batch span per call
    resource = {kv.key: kv.value.string_value for kv in got[0][0].attributes}
    assert resource["service.name"] == "gw-under-test"
    spans = [s for _, s in got]
    calls = [s for s in spans if s.kind == s.SPAN_KIND_SERVER]
    batches = [s for s in spans if s.kind == s.SPAN_KIND_CLIENT]
    assert len(calls) == 3 and len(batches) == 3
    for call in calls:
        assert call.name == "chat gpt-test"
        assert call.trace_id.hex() == TRACE_ID and call.parent_span_id.hex() == "00f067aa0ba902b7"
        a = attrs(call)
        assert a["multiplexer.face"] == "v1" and a["gen_ai.request.model"] == "gpt-test"
        assert a["multiplexer.route"] == "chat" and a["gen_ai.usage.input_tokens"] > 0
        assert call.end_time_unix_nano >= call.start_time_unix_nano > 0
        [batch] = [b for b in batches if b.parent_span_id == call.span_id]  # its upstream request
        assert [link.span_id for link in call.links] == [batch.span_id]
        assert attrs(batch)["multiplexer.batch.size"] == 1


def one_call(tracer: OtelTracer) -> None:
    span = tracer.start_call(Call("chat", {"model": "m"}, face="rpc"))
    item = Item("chat", "chat", "chat", {"model": "m"})
    item.trace = TraceSlot(span)
    tracer.routed(span, item, "oai", "openai")
    tracer.end_call(span, item.trace, Outcome(result={"usage": {"prompt_tokens": 2}}))


def test_a_child_that_dies_is_started_again_and_later_spans_arrive(receiver) -> None:
    processor = ProcessSpanProcessor(receiver.url + "/v1/traces", {"service.name": "t"}, restart_s=0.0)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = OtelTracer(provider)
    try:
        one_call(tracer)
        assert processor.force_flush()
        [(_, first)] = receiver.spans(1)
        assert first.name == "chat m" and attrs(first)["rpc.system"] == "jsonrpc"
        assert processor.child is not None
        processor.child.kill()
        processor.child.wait()
        one_call(tracer)
        processor.force_flush()  # the write to the dead child fails, or finds it gone: dropped
        one_call(tracer)
        assert processor.force_flush()  # a new child takes it
        [(_, later)] = receiver.spans(1)
        assert later.name == "chat m" and later.trace_id != first.trace_id
        assert processor.dropped <= 1
    finally:
        provider.shutdown()
    assert processor.child is None


def test_spans_left_at_shutdown_are_exported_before_the_child_exits(receiver) -> None:
    processor = ProcessSpanProcessor(receiver.url + "/v1/traces", {}, restart_s=0.0)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = OtelTracer(provider)
    for _ in range(5):
        one_call(tracer)
    provider.shutdown()  # no flush asked for: shutdown hands them over and waits for the child
    assert len(receiver.spans(5, timeout=1)) == 5


def test_a_queue_full_of_spans_drops_the_newest_and_counts_them(monkeypatch) -> None:
    from multiplexer.gateway import span_export

    monkeypatch.setattr(span_export, "MAX_QUEUE", 3)
    sink = [sys.executable, "-c", "import sys; sys.stdin.buffer.read()"]
    processor = ProcessSpanProcessor(None, {}, program=sink)
    processor._stop = True  # the sender thread stops at its next wake: the queue only fills
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = OtelTracer(provider)
    with processor._send_lock:  # hold the sender off while the queue fills
        for _ in range(5):
            one_call(tracer)
        assert len(processor.queue) == 3 and processor.dropped == 2
    provider.shutdown()
    assert not processor.queue


def test_an_unreachable_collector_holds_shutdown_at_most_the_drain_time() -> None:
    import time

    from multiplexer.gateway.span_export import DRAIN_S

    closed = free_port()  # nothing listens: every export attempt is refused and retried
    processor = ProcessSpanProcessor(f"http://127.0.0.1:{closed}/v1/traces", {}, restart_s=0.0)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    one_call(OtelTracer(provider))
    assert processor.force_flush()
    child = processor.child
    started = time.monotonic()
    provider.shutdown()
    assert child is not None and child.returncode is not None
    assert time.monotonic() - started < DRAIN_S + 2  # the child gave up, it was not killed
    assert child.returncode == 0


def test_other_libraries_spans_cross_the_pipe_whole() -> None:
    """The MCP SDK's spans (the SDK's own span objects) go through the same processor."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.trace import Link, SpanKind, StatusCode

    from multiplexer.gateway.span_export import compact, rebuild

    provider = TracerProvider()
    tracer = provider.get_tracer("mcp", "9.9")
    with tracer.start_as_current_span("linked") as first:
        pass
    span = tracer.start_span("tools/call x", kind=SpanKind.SERVER, attributes={"a": 1, "b": ("x", "y")},
                             links=[Link(first.get_span_context(), {"why": "batch"})])
    span.add_event("exception", {"exception.type": "ValueError"})
    span.set_status(StatusCode.ERROR, "boom")
    span.end()
    import pickle

    back = rebuild(pickle.loads(pickle.dumps(compact(span))), Resource({"service.name": "s"}))
    assert (back.name, back.kind, back.context.span_id, back.context.trace_id) == (
        "tools/call x", SpanKind.SERVER, span.context.span_id, span.context.trace_id)
    assert dict(back.attributes) == {"a": 1, "b": ("x", "y")}
    assert [(link.context.span_id, dict(link.attributes)) for link in back.links] == [
        (first.get_span_context().span_id, {"why": "batch"})]
    assert [(e.name, dict(e.attributes)) for e in back.events] == [
        ("exception", {"exception.type": "ValueError"})]
    assert back.status.status_code == StatusCode.ERROR and back.status.description == "boom"
    assert (back.start_time, back.end_time) == (span.start_time, span.end_time)
    assert back.instrumentation_scope.name == "mcp" and back.resource.attributes["service.name"] == "s"
