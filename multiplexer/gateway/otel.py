"""The call path's traces as OpenTelemetry spans (the ``otel`` extra).

Follows the GenAI and MCP semantic conventions (Development status, names as of
semantic-conventions-genai v0.1.0), plus ``multiplexer.*`` attributes where no
convention covers batching or dedup:

- **call span** (SERVER), one per accepted call, from admission to its one outcome.
  Named ``{gen_ai.operation.name} {model}`` for model calls, ``tools/call {tool}`` for
  MCP tool calls, else the method. Its parent is the caller's ``traceparent`` (HTTP
  header, or ``_meta`` in JSON-RPC and MCP), or the MCP SDK's own server span.
  ``multiplexer.batch.size``, ``multiplexer.wait_ms`` (queued before the batch left),
  ``multiplexer.dedup`` (``inflight`` or ``cache`` when it shared another call's
  execution), token usage and response ids from the result, and a link to the batch
  span it rode in. A streamed call adds ``gen_ai.response.time_to_first_chunk``
  (seconds from admission to the first chunk it sent back).
- **batch span** (CLIENT), one per upstream execution, linked to every call in it;
  the parent is the caller's span when the batch carries one call, else none (a batch
  belongs to many traces). It is current while the provider runs, so the upstream
  requests carry its ``traceparent`` (HTTP headers here, MCP ``_meta`` by the MCP SDK).
  ``multiplexer.batch.size``, ``multiplexer.dedup.callers`` (callers served) and
  ``multiplexer.dedup.share`` (the share of those that rode on another's item).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import MutableMapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from multiplexer.core.after import after
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.tracing import Tracer, TraceSlot
from multiplexer.core.version import VERSION
from multiplexer.gateway.span_export import Ids, ProcessSpanProcessor, ids_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace import Tracer as SdkTracer

    from multiplexer.core.batching import Pending

# our operations as GenAI operation names
GEN_AI_OPERATIONS = {"chat": "chat", "messages": "chat", "generate": "chat", "responses": "chat",
                     "embeddings": "embeddings", "embed": "embeddings"}
# provider kinds as gen_ai.provider.name (well-known values where there is one)
PROVIDER_NAMES = {"openai": "openai", "anthropic": "anthropic"}
_REQUEST_PARAMS = {"max_tokens": "gen_ai.request.max_tokens",
                   "max_output_tokens": "gen_ai.request.max_tokens",  # the Responses API's name
                   "temperature": "gen_ai.request.temperature", "top_p": "gen_ai.request.top_p"}
_FLAGS = {0: TraceFlags(TraceFlags.DEFAULT), 1: TraceFlags(TraceFlags.SAMPLED)}
_BATCH: ContextVar[Any] = ContextVar("multiplexer_batch_span", default=None)  # the running batch's
# _Span, for ``inject``
_UNSET = Status(StatusCode.UNSET)
_bits = random.getrandbits
_SCOPE = ("multiplexer", VERSION)


class _Span(ReadableSpan):
    """A span recorded by the call path itself: a ``ReadableSpan`` (what span processors and
    exporters take) filled in place, then handed to the processor when it ends.

    Why not the SDK's own spans: each one takes a lock per attribute call, builds bounded
    attribute maps and checks limits, about 130 µs per call for the three hooks a call runs
    (measured on the 2-core host), all on the event loop. These spans hold a plain dict and
    their ids as plain values (``ids``, what crosses the export pipe); the SDK's objects
    (``SpanContext``, ``Link``) are built only when something reads them (another span
    processor, the OTel context of an MCP upstream call), not on the hot path."""

    def __init__(self, tracer: OtelTracer, name: str, ids: Ids, parent_ids: Ids | None,
                 parent: SpanContext | None, kind: SpanKind, attributes: dict[str, Any],
                 link_ids: list[Any]) -> None:
        # ReadableSpan.__init__ would build an empty Resource per span: the fields are set here
        self.ids, self.parent_ids, self.link_ids = ids, parent_ids, link_ids
        self._remote_parent = parent
        self._ctx: SpanContext | None = None
        self._name, self._kind = name, kind
        self._attributes = self.attrs = attributes
        self._events = ()
        self._resource, self._instrumentation_scope = tracer.resource, tracer.scope
        self._instrumentation_info = None
        self._status = _UNSET
        self._start_time, self._end_time = time.time_ns(), None
        self._tracer = tracer

    # the SDK's objects, made when read (ReadableSpan's properties read these names)
    @property
    def ctx(self) -> SpanContext:
        found = self._ctx
        if found is None:
            found = self._ctx = _span_context(self.ids)
        return found

    @property
    def _context(self) -> SpanContext:  # type: ignore[override]
        return self.ctx

    @property
    def _parent(self) -> SpanContext | None:  # type: ignore[override]
        if self._remote_parent is not None or self.parent_ids is None:
            return self._remote_parent
        return _span_context(self.parent_ids)

    @property
    def _links(self) -> tuple[Link, ...]:  # type: ignore[override]
        return tuple(_sdk_links(self.link_ids))

    def get_span_context(self) -> SpanContext:
        return self.ctx

    def is_recording(self) -> bool:
        return self._end_time is None

    def update_name(self, name: str) -> None:
        self._name = name

    def set_attribute(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attrs.update(attributes)

    def add_link(self, context: SpanContext, attributes: dict[str, Any] | None = None) -> None:
        self.link_ids.append((ids_of(context), attributes))

    def link(self, other: _Span, attributes: dict[str, Any] | None = None) -> None:
        self.link_ids.append((other.ids, attributes))

    def set_status(self, status: Status) -> None:
        self._status = status

    def compact(self) -> tuple[Any, ...]:
        """The span as ``span_export.compact`` makes it, from the fields (no copies: it ended)."""
        s = self._status
        return (self._name, self.ids, self.parent_ids, self._kind.value, self._start_time,
                self._end_time, self.attrs, self.link_ids, [],
                s.status_code.value, s.description, _SCOPE)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is None:
            self._end_time = end_time or time.time_ns()
            take = self._tracer.take
            if take is None:
                self._tracer.processor.on_end(self)
            elif self.ids[2] & 1:  # sampled: straight to the export pipe's queue
                take(self.compact())


def _span_context(ids: Ids) -> SpanContext:
    trace_id, span_id, flags, pairs = ids
    return SpanContext(trace_id, span_id, False, _FLAGS[flags], TraceState(pairs) if pairs else None)


def _sdk_links(link_ids: list[Any]) -> list[Link]:
    """Links as the SDK's objects, from the plain ids a span keeps."""
    return [Link(_span_context(ids), attributes) for ids, attributes in link_ids]


def _new_ids(trace_id: int, flags: int, state: Any = None) -> Ids:
    return trace_id, _bits(64) or 1, flags, list(state.items()) if state else None


class _Batch:
    """The batch span current while its provider runs (``OtelTracer.batch``): a plain context
    manager, cheaper than a generator's."""

    __slots__ = ("attach", "mine", "span", "token")

    def __init__(self, span: _Span, attach: bool) -> None:
        self.span, self.attach = span, attach
        self.token: Any = None

    def __enter__(self) -> None:
        if self.attach:  # the OTel context, for what reads it (the MCP SDK's propagation)
            self.token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(self.span.ctx)))
        self.mine = _BATCH.set(self.span)

    def __exit__(self, kind: Any, e: Any, tb: Any) -> None:
        span = self.span
        if e is not None:
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
        _BATCH.reset(self.mine)
        if self.token is not None:
            otel_context.detach(self.token)
        after(span.end, time.time_ns())  # ended now, recorded once the answer is written


class OtelTracer(Tracer):
    """The gateway's hooks as OpenTelemetry spans, recorded by ``_Span`` and handed to the span
    processors of ``provider`` (an SDK ``TracerProvider``: its sampler, resource and
    processors; the exporter is configured there, as usual)."""

    enabled = True

    def __init__(self, provider: TracerProvider, exporting: Any = None) -> None:
        """``exporting``: the provider's ``span_export.ProcessSpanProcessor`` when it is the only
        one, so an ended span goes straight to its queue."""
        self._provider = provider
        sdk = cast("SdkTracer", provider.get_tracer("multiplexer", VERSION))
        self.processor: SpanProcessor = sdk.span_processor
        self.take = exporting.take if exporting is not None else None
        self.sampler = sdk.sampler
        # the SDK's default sampler (parent-based, always on) decided here without its call
        self.default_sampler = sampler_is_default(self.sampler)
        # the default propagators (W3C trace context, and baggage, always empty in a batch):
        # ``inject`` formats the header itself
        self.plain_propagation = os.environ.get("OTEL_PROPAGATORS", "tracecontext,baggage").replace(
            " ", "") in ("tracecontext,baggage", "tracecontext", "baggage,tracecontext")
        self.resource = sdk.resource
        self.scope = InstrumentationScope(*_SCOPE)

    def _child(self, name: str, parent: _Span, kind: SpanKind, attributes: dict[str, Any],
               link_ids: list[Any] | None = None) -> _Span:
        pids = parent.ids
        return _Span(self, name, (pids[0], _bits(64) or 1, pids[2], pids[3]), pids, None, kind,
                     attributes, link_ids or [])

    def _root(self, name: str, kind: SpanKind, attributes: dict[str, Any], link_ids: list[Any],
              parent_context: Any) -> _Span:
        """A span whose parent is remote, or the current OTel span (the MCP SDK's), or none:
        the sampler decides, as the SDK's tracer would."""
        parent = trace.get_current_span(parent_context).get_span_context()
        valid = parent.is_valid
        trace_id = parent.trace_id if valid else (_bits(128) or 1)
        if self.default_sampler:
            flags, state = (int(parent.trace_flags) & 1, parent.trace_state) if valid else (1, None)
        else:
            decision = self.sampler.should_sample(parent_context, trace_id, name, kind, attributes,
                                                  _sdk_links(link_ids))
            flags, state = (1 if decision.decision.is_sampled() else 0), decision.trace_state
            if decision.attributes:
                attributes.update(decision.attributes)
        return _Span(self, name, _new_ids(trace_id, flags, state), ids_of(parent) if valid else None,
                     parent if valid else None, kind, attributes, link_ids)

    # -- calls -----------------------------------------------------------------
    def start_call(self, call: Call) -> Any:
        parent = None
        if call.trace and not trace.get_current_span().get_span_context().is_valid:
            parent = propagate.extract(call.trace)
        attributes: dict[str, Any] = {"multiplexer.face": call.face or "api"}
        name = call.method
        if call.face == "mcp":
            name = f"tools/call {call.method}"
            attributes.update({"mcp.method.name": "tools/call", "gen_ai.tool.name": call.method,
                               "gen_ai.operation.name": "execute_tool"})
        elif call.face == "rpc":
            attributes.update({"rpc.system": "jsonrpc", "rpc.method": call.method})
        if call.identity is not None:
            attributes["multiplexer.key"] = call.identity
        return self._root(name, SpanKind.SERVER, attributes, [], parent)

    def routed(self, span: Any, item: Item, provider: str, provider_kind: str) -> None:
        """Named and described once the answer is written (core/after.py), from the params as
        they are now: a provider's ``prepare`` or a model group may change them before the call goes."""
        params = item.params
        after(_routed, span, item.route, item.operation,
              dict(params) if isinstance(params, dict) else {}, provider, provider_kind)

    def shared(self, span: Any, how: str) -> None:
        span.set_attribute("multiplexer.dedup", how)

    def first_chunk(self, span: Any, seconds: float) -> None:
        if span.is_recording():  # a caller gone before the first chunk ended its span already
            span.set_attribute("gen_ai.response.time_to_first_chunk", seconds)

    def end_call(self, span: Any, slot: TraceSlot | None, outcome: Outcome,
                 ended_ns: int | None = None) -> None:
        attributes = span.attrs
        if slot is not None and slot.batch is not None:
            span.link(slot.batch, _BATCH_LINK)
            attributes["multiplexer.batch.size"] = slot.batch_size
            attributes["multiplexer.wait_ms"] = round(slot.wait_s * 1000, 3)
        if outcome.error is not None:
            attributes["error.type"] = str(outcome.error.code)
            span.set_status(Status(StatusCode.ERROR, outcome.error.message))
        elif isinstance(outcome.result, dict):
            attributes.update(_gen_ai_response(outcome.result))
        cost = outcome.cost_pico
        if outcome.error is None and cost is not None:  # what the call cost and saved, in USD
            attributes["multiplexer.cost_usd"] = cost / 1e12
            if outcome.saved_pico:
                attributes["multiplexer.saved_usd"] = outcome.saved_pico / 1e12
        span.end(ended_ns)

    def attempt(self, span: Any, route: str, number: int) -> Any:
        return self._child(f"attempt {route}", span, SpanKind.INTERNAL,
                           {"multiplexer.route": route, "multiplexer.attempt": number})

    def end_attempt(self, attempt: Any, result: str, outcome: Outcome) -> None:
        attempt.set_attribute("multiplexer.attempt.result", result)
        if outcome.error is not None:
            attempt.set_attribute("error.type", str(outcome.error.code))
            attempt.set_status(Status(StatusCode.ERROR, outcome.error.message))
        attempt.end()

    # -- batches ---------------------------------------------------------------
    def batch(self, lane: str, pending: Sequence[Pending], now: float,
              attach: bool = True) -> contextlib.AbstractContextManager[None]:
        traced = [p for p in pending if p.item.trace is not None]
        first = pending[0].item
        callers = sum(p.waiters for p in pending)
        attributes: dict[str, Any] = {
            "multiplexer.lane": lane, "multiplexer.batch.size": len(pending),
            "multiplexer.dedup.callers": callers,
            "multiplexer.dedup.share": round(1 - len(pending) / callers, 4) if callers else 0.0,
        }
        op, model = GEN_AI_OPERATIONS.get(first.operation), _model(first.params)
        if op is not None:
            attributes["gen_ai.operation.name"] = op
            if model is not None:
                attributes["gen_ai.request.model"] = model
        name = f"{op} {model}" if op is not None and model is not None else first.method
        link_ids = [(p.item.trace.span.ids, None) for p in traced]
        # one caller: its trace holds the upstream request; several: a trace of its own
        if len(pending) == 1 and callers == 1 and traced:
            span = self._child(name, traced[0].item.trace.span, SpanKind.CLIENT, attributes, link_ids)
        else:
            span = self._root(name, SpanKind.CLIENT, attributes, link_ids, otel_context.Context())
        for p in traced:
            slot = p.item.trace
            slot.batch, slot.batch_size, slot.wait_s = span, len(pending), max(0.0, now - p.enqueued)
        # current while the provider runs: ``inject`` reads it, and with ``attach`` the OTel
        # context too (the MCP SDK propagates that; HTTP providers inject the header themselves)
        return _Batch(span, attach or not self.plain_propagation)

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        span = _BATCH.get() if self.plain_propagation else None
        if span is None:
            propagate.inject(carrier)
            return
        trace_id, span_id, flags, state = span.ids
        carrier["traceparent"] = f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
        if state:
            carrier["tracestate"] = ",".join(f"{k}={v}" for k, v in state)

    def close(self) -> None:
        self._provider.shutdown()


_BATCH_LINK = {"multiplexer.link": "batch"}


def sampler_is_default(sampler: Any) -> bool:
    """Whether ``sampler`` decides as the SDK's default: parent-based, always on at the root."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    return bool(sampler.get_description() == ParentBased(ALWAYS_ON).get_description())


def _model(params: Any) -> str | None:
    model = params.get("model") if isinstance(params, dict) else None
    return model if isinstance(model, str) else None


def _routed(span: Any, route: str, operation: str, params: dict[str, Any], provider: str,
            provider_kind: str) -> None:
    span.set_attributes({"multiplexer.route": route, "multiplexer.provider": provider,
                         **_gen_ai_request(operation, params, provider_kind)})
    op, model = GEN_AI_OPERATIONS.get(operation), _model(params)
    if op is not None and model is not None and not span.name.startswith("tools/call"):
        span.update_name(f"{op} {model}")


def _gen_ai_request(operation: str, params: dict[str, Any], provider_kind: str) -> dict[str, Any]:
    op = GEN_AI_OPERATIONS.get(operation)
    if op is None:
        return {}
    out: dict[str, Any] = {"gen_ai.operation.name": op,
                           "gen_ai.provider.name": PROVIDER_NAMES.get(provider_kind, provider_kind)}
    model = _model(params)
    if model is not None:
        out["gen_ai.request.model"] = model
    if params.get("stream"):
        out["gen_ai.request.stream"] = True
    for key, attribute in _REQUEST_PARAMS.items():
        value = params.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[attribute] = value
    return out


def _gen_ai_response(result: dict[str, Any]) -> dict[str, Any]:
    """Usage, id, model and finish reasons from an OpenAI- or Anthropic-shaped result."""
    out: dict[str, Any] = {}
    usage = result.get("usage")
    if isinstance(usage, dict):
        for attribute, keys in (("gen_ai.usage.input_tokens", ("prompt_tokens", "input_tokens")),
                                ("gen_ai.usage.output_tokens",
                                 ("completion_tokens", "output_tokens"))):
            for key in keys:
                if isinstance(usage.get(key), int):
                    out[attribute] = usage[key]
                    break
    for attribute, key in (("gen_ai.response.id", "id"), ("gen_ai.response.model", "model")):
        if isinstance(result.get(key), str):
            out[attribute] = result[key]
    choices = result.get("choices")
    reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)] if isinstance(
        choices, list) else [result.get("stop_reason")]
    reasons = [r for r in reasons if isinstance(r, str)]
    if reasons:
        out["gen_ai.response.finish_reasons"] = tuple(reasons)  # as the SDK keeps a sequence
    return out


def exporting_tracer(endpoint: str | None, service_name: str | None) -> OtelTracer:
    """A tracer whose spans an exporting child process sends to an OTLP/HTTP collector
    (``span_export``); also the process's global provider, so the MCP SDK's own spans go to
    the same place."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.version": VERSION})  # with OTEL_RESOURCE_ATTRIBUTES, ...
    if service_name:
        resource = resource.merge(Resource.create({"service.name": service_name}))
    elif str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource.create({"service.name": "multiplexer"}))
    if endpoint is not None and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=resource)
    exporting = ProcessSpanProcessor(endpoint, dict(resource.attributes))
    provider.add_span_processor(exporting)
    trace.set_tracer_provider(provider)
    return OtelTracer(provider, exporting)
