"""OpenTelemetry traces of the call path, read back from the SDK's in-memory exporter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import httpx
import pytest
import respx

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import ManualClock, MonotonicClock
from multiplexer.core.jsonrpc import call_from
from multiplexer.core.provider import Provider
from multiplexer.faces.http import create_app
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
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


async def test_a_responses_call_is_a_chat_span_with_its_usage(tmp_path, spans):
    from multiplexer.faces.auth import Authenticator
    from multiplexer.faces.v1 import v1_routes

    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    reply = {"id": "resp_1", "object": "response", "model": "gpt-x", "status": "completed", "output": [],
             "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}}
    router.post("/responses").mock(return_value=httpx.Response(200, json=reply))
    async with gateway(tmp_path, tracer, router) as gw:
        app = create_app(gw, v1_routes(gw, Authenticator({})))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
            got = await c.post("/v1/responses", json={"model": "gpt-x", "input": "q", "max_output_tokens": 9})
    assert got.status_code == 200, got.text
    [call] = by_kind(exporter, SpanKind.SERVER)
    assert call.name == "chat gpt-x" and call.attributes["gen_ai.request.max_tokens"] == 9
    assert call.attributes["gen_ai.usage.input_tokens"] == 3
    assert call.attributes["gen_ai.usage.output_tokens"] == 4


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

    from multiplexer.transport.http1 import Http1Transport

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


class GatedStream(Provider):
    """A chat provider that streams two OpenAI chunks once the test opens ``gate``."""

    def __init__(self, clock: ManualClock) -> None:
        self.name, self.clock = "p", clock
        self.started, self.gate = anyio.Event(), anyio.Event()

    async def execute(self, operation, items):
        raise AssertionError("only streamed calls here")

    async def stream(self, item, sink):
        self.started.set()
        await self.gate.wait()
        for n, text in enumerate(("hello", " world")):
            await sink.send({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                             "model": "gpt-x", "choices": [{"index": 0, "finish_reason": None,
                                                            "delta": {"content": text}}]})
            if n == 0:
                await self.clock.advance(1.0)  # later chunks do not move the first one
        return Outcome(result={"usage": {}})


def ttfc(metrics_text: str, route: str) -> tuple[float, float]:
    """(count, sum) of a route's time-to-first-chunk histogram in a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {s.name: s.value for f in text_string_to_metric_families(metrics_text)
             for s in f.samples if s.labels.get("route") == route
             and s.name.startswith("multiplexer_time_to_first_chunk_seconds_")}
    return (found.get("multiplexer_time_to_first_chunk_seconds_count", 0.0),
            found.get("multiplexer_time_to_first_chunk_seconds_sum", 0.0))


async def test_a_streams_time_to_first_chunk_on_its_span_and_in_metrics(tmp_path, spans):
    """Measured on the gateway's clock from admission to the first chunk: the manual clock
    moves 0.25 s while the upstream holds its first chunk, then 1 s more before the second."""
    import openai

    tracer, exporter = spans
    config = parse_config({
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"p": {"kind": "echo"}},
        "routes": {"chat": {"provider": "p", "operation": "chat", "models": ["gpt-x"]}},
    })
    clock = ManualClock()
    provider = GatedStream(clock)
    gw = Gateway(config, clock=clock, providers={"p": provider}, tracer=tracer)
    ask = [{"role": "user", "content": "q"}]
    async with (running(config, port=0, gateway=gw) as (_, url),
                openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client):
        pieces: list[str] = []

        async def read() -> None:
            stream = await client.chat.completions.create(model="gpt-x", messages=ask, stream=True)
            pieces.extend([c.choices[0].delta.content async for c in stream])

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await provider.started.wait()
            await clock.advance(0.25)
            provider.gate.set()
        async with httpx.AsyncClient() as http:
            page = (await http.get(url + "/metrics")).text
    assert pieces == ["hello", " world"]
    [call] = by_kind(exporter, SpanKind.SERVER)
    assert call.name == "chat gpt-x" and call.attributes["gen_ai.request.stream"] is True
    assert call.attributes["gen_ai.response.time_to_first_chunk"] == 0.25
    assert ttfc(page, "chat") == (1.0, 0.25)


async def test_every_v1_stream_records_its_first_chunk_and_whole_calls_do_not(tmp_path, spans):
    """Chat and messages streams through the fakes (the lanes, the real providers): each span
    has a time to first chunk within its own duration; a whole call has none."""
    import anthropic
    import openai

    from tests.remote_helpers import fakes
    from tests.test_v1_openai import KEY, v1_config

    tracer, exporter = spans
    ask = [{"role": "user", "content": "one two"}]
    async with fakes() as f:
        config = parse_config(v1_config(f, tmp_path))
        async with (running(config, port=0, gateway=Gateway(config, tracer=tracer)) as (gw, url),
                    openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as oai,
                    anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as claude):
            await oai.chat.completions.create(model="gpt-4o-mini", messages=ask)
            chunks = [c async for c in await oai.chat.completions.create(
                model="gpt-4o-mini", messages=ask, stream=True)]
            async with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=9,
                                              messages=ask) as stream:
                text = await stream.get_final_text()
            page = gw.metrics.render().decode()
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text == "echo: one two"
    calls = by_kind(exporter, SpanKind.SERVER)
    streamed = {s.attributes["multiplexer.route"]: s for s in calls
                if s.attributes.get("gen_ai.request.stream")}
    [whole] = [s for s in calls if not s.attributes.get("gen_ai.request.stream")]
    assert "gen_ai.response.time_to_first_chunk" not in whole.attributes
    assert sorted(streamed) == ["chat", "claude"]
    for route, span in streamed.items():
        first = span.attributes["gen_ai.response.time_to_first_chunk"]
        assert 0 <= first <= (span.end_time - span.start_time) / 1e9
        assert ttfc(page, route)[0] == 1.0


async def test_a_priced_call_carries_its_cost_on_its_span(tmp_path, spans):
    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    router.post("/chat/completions").mock(return_value=httpx.Response(200, json=chat_reply("hi")))
    async with gateway(tmp_path, tracer, router) as gw:
        out = await gw.submit(Call("chat", {"model": "gpt-4o",
                                            "messages": [{"role": "user", "content": "q"}]}))
    assert out.ok
    [call] = by_kind(exporter, SpanKind.SERVER)
    # 5 input and 2 output tokens at gpt-4o's $2.50 and $10 per million
    assert call.attributes["multiplexer.cost_usd"] == pytest.approx(0.0000325)
    assert call.attributes["gen_ai.usage.input_tokens"] == 5


class SeesContext(Provider):
    """Echoes, and notes the OpenTelemetry span current while its batch runs."""

    def __init__(self, injects: bool) -> None:
        self.name, self.injects_trace, self.seen = "p", injects, []  # type: ignore[misc]

    async def execute(self, operation, items):
        from opentelemetry import trace

        self.seen.append(trace.get_current_span().get_span_context())
        return [Outcome(result={"ok": True}) for _ in items]


@pytest.mark.parametrize("injects", [False, True])
async def test_the_batch_span_is_the_current_otel_span_only_for_providers_that_need_it(
        tmp_path, spans, injects):
    """A kind that propagates through the OpenTelemetry context (the MCP SDK does) runs its batch
    with the batch span current; one that puts the traceparent on its requests itself
    (``injects_trace``) is spared attaching it, and its spans are the same."""
    tracer, exporter = spans
    config = parse_config({"providers": {"p": {"kind": "echo"}}, "routes": {"echo": {"provider": "p"}}})
    provider = SeesContext(injects)
    async with Gateway(config, providers={"p": provider}, tracer=tracer) as gw:
        [outcome] = await gw.submit_many([Call("echo", {"x": 1})])
    assert outcome.result == {"ok": True}
    [batch] = by_kind(exporter, SpanKind.CLIENT)
    [call] = by_kind(exporter, SpanKind.SERVER)
    assert batch.parent.span_id == call.context.span_id
    assert [link.context.span_id for link in call.links] == [batch.context.span_id]
    [seen] = provider.seen
    if injects:
        assert not seen.is_valid
    else:
        assert (seen.trace_id, seen.span_id) == (batch.context.trace_id, batch.context.span_id)


async def test_on_the_direct_path_a_calls_span_is_described_after_its_answer_from_what_admission_saw(
        tmp_path, spans, monkeypatch):
    """The direct HTTP path holds the bookkeeping until the reply is written (core/after.py): the
    call's span does not end before, and its route attributes are those of the params as admission
    saw them, though the provider's ``prepare`` changes them before the request goes."""
    from multiplexer.core.after import hold, release

    tracer, exporter = spans
    router = respx.MockRouter(base_url=BASE)
    upstream = router.post("/chat/completions").mock(
        return_value=httpx.Response(200, json=chat_reply("hi")))
    prepare = OpenAIProvider.prepare

    def deploys(self, route, item):  # as a provider that sends its own deployment name would
        item.params["model"] = "deployment-7"
        prepare(self, route, item)

    monkeypatch.setattr(OpenAIProvider, "prepare", deploys)
    async with gateway(tmp_path, tracer, router) as gw:
        held = hold()
        outcome = await gw.submit(Call("chat", {"model": "gpt-x", "max_tokens": 9,
                                                "messages": [{"role": "user", "content": "q"}]}))
        assert outcome.ok and by_kind(exporter, SpanKind.SERVER) == []  # held until the answer is out
        release(held)
    assert json.loads(upstream.calls[0].request.content)["model"] == "deployment-7"
    [call] = by_kind(exporter, SpanKind.SERVER)
    assert call.name == "chat gpt-x"
    assert {k: call.attributes[k] for k in ("multiplexer.route", "gen_ai.request.model",
                                            "gen_ai.request.max_tokens")} == {
        "multiplexer.route": "chat", "gen_ai.request.model": "gpt-x", "gen_ai.request.max_tokens": 9}
