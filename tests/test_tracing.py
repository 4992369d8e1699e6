"""OpenTelemetry traces of the call path, read back from the SDK's in-memory exporter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import respx

from multiplexer.core.call import Call
from multiplexer.core.clock import MonotonicClock
from multiplexer.core.jsonrpc import call_from
from multiplexer.faces.http import create_app
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from providers.openai import OpenAIProvider
from tests.remote_helpers import chat_reply, embedding_reply, make_provider

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from multiplexer.gateway.otel import OtelTracer  # noqa: E402

pytestmark = pytest.mark.anyio
BASE = "http://oai.test/v1"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"



@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OtelTracer(provider), exporter


def gateway(tmp_path, tracer, router, **batch):
    config = parse_config({
        "providers": {"oai": {"kind": "openai", "base_url": BASE,
                              "batch": batch or {"max_items": 1}}},
        "routes": {"chat": {"provider": "oai", "operation": "chat", "models": ["gpt-x"]},
                   "embed": {"provider": "oai", "operation": "embeddings"}},
    })
    provider = make_provider(OpenAIProvider, {"base_url": BASE, "api_key": "k"}, tmp_path,
                             clock=MonotonicClock(), name="oai", tracer=tracer,
                             transport=httpx.MockTransport(router.async_handler))
    return Gateway(config, providers={"oai": provider}, tracer=tracer)


def by_kind(exporter, kind):
    return [s for s in exporter.get_finished_spans() if s.kind == kind]


def hex_id(n: int, width: int) -> str:
    return format(n, f"0{width}x")


async def test_a_call_continues_the_callers_trace_and_the_upstream_request_carries_its_batch(
        tmp_path, spans):
    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    upstream = router.post("/chat/completions").mock(
        return_value=httpx.Response(200, json=chat_reply("hi", prompt_tokens=5, completion_tokens=2)))
    body = {"jsonrpc": "2.0", "id": 1, "method": "chat",
            "params": {"model": "gpt-x", "max_tokens": 9,
                       "messages": [{"role": "user", "content": "hello"}]}}
    async with gateway(tmp_path, tracer, router) as gw:
        app = create_app(gw)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            reply = await c.post("/rpc", json=body, headers={"traceparent": TRACEPARENT})
    assert reply.json()["result"]["choices"][0]["message"]["content"] == "hi"

    [call] = by_kind(exporter, SpanKind.SERVER)
    [batch] = by_kind(exporter, SpanKind.CLIENT)
    assert call.name == "chat gpt-x" and batch.name == "chat gpt-x"
    assert hex_id(call.context.trace_id, 32) == TRACE_ID
    assert hex_id(call.parent.span_id, 16) == PARENT_ID
    assert {k: call.attributes[k] for k in (
        "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
        "gen_ai.request.max_tokens", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
        "gen_ai.response.id", "rpc.method", "multiplexer.route", "multiplexer.batch.size")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-x", "gen_ai.request.max_tokens": 9,
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 2,
        "gen_ai.response.id": "chatcmpl-1", "rpc.method": "chat", "multiplexer.route": "chat",
        "multiplexer.batch.size": 1}
    assert call.attributes["multiplexer.wait_ms"] >= 0
    # one caller: the batch is its child, and each links the other
    assert batch.parent.span_id == call.context.span_id
    assert [link.context.span_id for link in batch.links] == [call.context.span_id]
    assert [link.context.span_id for link in call.links] == [batch.context.span_id]
    sent = upstream.calls[0].request.headers["traceparent"]
    assert sent == f"00-{TRACE_ID}-{hex_id(batch.context.span_id, 16)}-01"


async def test_the_v1_face_continues_the_traceparent_header(tmp_path, spans):
    from multiplexer.faces.auth import Authenticator
    from multiplexer.faces.v1 import v1_routes

    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    router.post("/chat/completions").mock(return_value=httpx.Response(200, json=chat_reply("hi")))
    async with gateway(tmp_path, tracer, router) as gw:
        app = create_app(gw, v1_routes(gw, Authenticator({})))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            reply = await c.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                                 json={"model": "gpt-x", "messages": [{"role": "user", "content": "q"}]})
    assert reply.status_code == 200, reply.text
    [call] = by_kind(exporter, SpanKind.SERVER)
    assert call.attributes["multiplexer.face"] == "v1" and call.name == "chat gpt-x"
    assert hex_id(call.context.trace_id, 32) == TRACE_ID
    assert hex_id(call.parent.span_id, 16) == PARENT_ID


async def test_packed_calls_share_one_batch_span_linked_to_each_caller(tmp_path, spans):
    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)

    def embed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=embedding_reply(json.loads(request.content)["input"]))

    upstream = router.post("/embeddings").mock(side_effect=embed)
    calls = [Call("embed", {"model": "e", "input": f"text {i}"}) for i in range(3)]
    async with gateway(tmp_path, tracer, router, max_items=8, max_wait_ms=50, eager=False) as gw:
        outcomes = await gw.submit_many(calls)
    assert all(o.ok for o in outcomes) and upstream.call_count == 1

    callers = by_kind(exporter, SpanKind.SERVER)
    [batch] = by_kind(exporter, SpanKind.CLIENT)
    assert len(callers) == 3 and batch.parent is None  # a batch of many callers: its own trace
    assert batch.attributes["multiplexer.batch.size"] == 3
    assert batch.attributes["gen_ai.operation.name"] == "embeddings"
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in callers}
    for span in callers:
        assert span.name == "embeddings e"
        assert [link.context.span_id for link in span.links] == [batch.context.span_id]
        assert span.attributes["multiplexer.batch.size"] == 3
    traceparent = upstream.calls[0].request.headers["traceparent"]
    assert traceparent.split("-")[1:3] == [hex_id(batch.context.trace_id, 32),
                                           hex_id(batch.context.span_id, 16)]


async def test_calls_sharing_one_execution_say_so_and_link_the_same_batch(tmp_path, spans):
    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    router.post("/chat/completions").mock(return_value=httpx.Response(200, json=chat_reply("same")))
    params = {"model": "gpt-x", "temperature": 0, "messages": [{"role": "user", "content": "q"}]}
    async with gateway(tmp_path, tracer, router) as gw:
        outcomes = await gw.submit_many([Call("chat", dict(params)) for _ in range(3)])
    assert [o.result["choices"][0]["message"]["content"] for o in outcomes] == ["same"] * 3

    callers = by_kind(exporter, SpanKind.SERVER)
    [batch] = by_kind(exporter, SpanKind.CLIENT)
    assert sorted(s.attributes.get("multiplexer.dedup", "leader") for s in callers) == [
        "inflight", "inflight", "leader"]
    assert all([link.context.span_id for link in s.links] == [batch.context.span_id]
               for s in callers)
    assert batch.attributes["multiplexer.dedup.callers"] == 3
    assert batch.attributes["multiplexer.dedup.share"] == pytest.approx(2 / 3, abs=1e-3)


async def test_a_failed_call_ends_its_span_with_the_error(tmp_path, spans):
    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    router.post("/chat/completions").mock(return_value=httpx.Response(
        400, json={"error": {"message": "bad model", "type": "invalid_request_error"}}))
    async with gateway(tmp_path, tracer, router) as gw:
        outcome = await gw.submit(Call("chat", {"model": "m", "messages": [
            {"role": "user", "content": "q"}]}))
        unknown = await gw.submit(Call("no.such.method", {}))
    assert not outcome.ok and not unknown.ok
    failed = {s.name: s for s in by_kind(exporter, SpanKind.SERVER)}
    assert failed["chat m"].status.is_ok is False
    assert failed["chat m"].attributes["error.type"] == str(outcome.error.code)
    assert failed["no.such.method"].attributes["error.type"] == str(unknown.error.code)


async def test_mcp_meta_trace_context_and_tool_span_names(tmp_path, spans):
    tracer, exporter = spans
    call = call_from("chat", {"model": "gpt-x", "messages": [{"role": "user", "content": "q"}]},
                     {"traceparent": TRACEPARENT, "tracestate": "k=v", "priority": 1}, None)
    assert call.trace == {"traceparent": TRACEPARENT, "tracestate": "k=v"} and call.priority == 1
    call.face = "mcp"
    router = respx.MockRouter(base_url=BASE)
    router.post("/chat/completions").mock(return_value=httpx.Response(200, json=chat_reply("x")))
    async with gateway(tmp_path, tracer, router) as gw:
        assert (await gw.submit(call)).ok
    [span] = by_kind(exporter, SpanKind.SERVER)
    assert span.name == "tools/call chat"
    assert span.attributes["mcp.method.name"] == "tools/call"
    assert span.attributes["gen_ai.tool.name"] == "chat"
    assert span.attributes["gen_ai.request.model"] == "gpt-x"
    assert hex_id(span.context.trace_id, 32) == TRACE_ID


def test_off_by_default_and_opentelemetry_not_imported() -> None:
    script = (
        "import sys\n"
        "from multiplexer.gateway.config import parse_config\n"
        "from multiplexer.gateway.gateway import Gateway\n"
        "import multiplexer.server\n"
        "off = Gateway(parse_config({}))\n"
        "assert not off.tracer.enabled\n"
        "assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'multiplexer.gateway.otel'))], 'imported'\n"
        "on = Gateway(parse_config({'telemetry': {'otlp_endpoint': 'http://127.0.0.1:9'}}))\n"
        "assert on.tracer.enabled\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


async def test_the_lean_transports_hot_path_carries_the_traceparent_too(tmp_path, spans):
    import anyio
    import anyio.abc

    from providers.http1_transport import Http1Transport

    tracer, exporter = spans
    heads: list[bytes] = []
    reply = json.dumps(chat_reply("hi")).encode()

    async def upstream(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            heads.append(head)
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(reply), reply))

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    base = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}/v1"
    config = parse_config({"providers": {"oai": {"kind": "openai", "base_url": base}},
                           "routes": {"chat": {"provider": "oai", "operation": "chat"}}})
    provider = make_provider(OpenAIProvider, {"base_url": base, "api_key": "k"}, tmp_path,
                             clock=MonotonicClock(), name="oai", tracer=tracer,
                             transport=Http1Transport())
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, upstream)
        async with Gateway(config, providers={"oai": provider}, tracer=tracer) as gw:
            outcome = await gw.submit(Call("chat", {"model": "m", "messages": [
                {"role": "user", "content": "q"}]}, trace={"traceparent": TRACEPARENT}))
        tg.cancel_scope.cancel()
    assert outcome.ok
    [batch] = by_kind(exporter, SpanKind.CLIENT)
    assert f"traceparent: 00-{TRACE_ID}-{hex_id(batch.context.span_id, 16)}-01".encode() in heads[0]
    assert b"authorization: Bearer k" in heads[0] and b"content-length: " in heads[0]
