"""Traces of the call path: the few hooks the gateway, lanes and providers call, no-op by default.

Why an interface here: the core must not import OpenTelemetry, so tracing costs
nothing when it is off (the default). The composition root installs the OTel
implementation (``multiplexer/gateway/otel.py``) when the config or the standard
``OTEL_*`` variables ask for traces. What it records:

- a span per call, from admission to its one outcome (``start_call`` .. ``end_call``),
  continuing the caller's ``traceparent`` (HTTP header or MCP ``_meta``);
- a span per upstream batch (``batch``), linked to every call that rode in it; the
  providers' upstream requests carry its ``traceparent`` (``inject``);
- on each call, which batch it rode in (a link), the batch size, its wait in the
  queue and whether it shared another call's execution (dedup);
- on a streamed call, the time from its admission to its first chunk (``first_chunk``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multiplexer.core.call import Call, Item, Outcome

if TYPE_CHECKING:
    from multiplexer.core.batching import Pending


@dataclass(slots=True)
class TraceSlot:
    """A traced call's span and the batch it rode in, on its ``Item`` (None when off)."""

    span: Any
    batch: Any = None  # the upstream batch span, once the lane sends it
    batch_size: int = 0
    wait_s: float = 0.0


class Tracer:
    """Does nothing; ``enabled`` lets hot paths skip even the calls."""

    enabled = False

    def start_call(self, call: Call) -> Any:
        """A span for one call as it arrives; None when not tracing."""
        return None

    def routed(self, span: Any, item: Item, provider: str, provider_kind: str) -> None:
        """The call found its route: name the span for what it does (model, tool)."""

    def shared(self, span: Any, how: str) -> None:
        """The call shares another's execution: ``inflight`` or ``cache``."""

    def first_chunk(self, span: Any, seconds: float) -> None:
        """A streamed call's first chunk left ``seconds`` after the call was admitted."""

    def end_call(self, span: Any, slot: TraceSlot | None, outcome: Outcome,
                 ended_ns: int | None = None) -> None:
        """The call's one outcome; ``slot`` is the item it waited on (its own or a shared one);
        ``ended_ns``: when it ended (``time.time_ns()``), where that was before this runs."""

    def attempt(self, span: Any, route: str, number: int) -> Any:
        """A call with fallbacks starts its ``number``-th attempt, on ``route``: a child span."""
        return None

    def end_attempt(self, attempt: Any, result: str, outcome: Outcome) -> None:
        """That attempt ended: ``result`` is ``ok`` or why it failed (a fallback reason)."""

    def batch(self, lane: str, pending: Sequence[Pending], now: float, attach: bool = True
              ) -> contextlib.AbstractContextManager[None]:
        """Around one upstream execution of a batch; current while it runs, so ``inject``
        puts its context into the upstream request. ``attach``: make it the current
        OpenTelemetry context too (for libraries that propagate that themselves)."""
        return _NULL

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        """Put the current span's ``traceparent`` (and ``tracestate``) into ``carrier``."""

    def close(self) -> None:
        """Send what is buffered; the gateway is stopping."""


_NULL = contextlib.nullcontext()
NOOP = Tracer()


TRACE_KEYS = ("traceparent", "tracestate")


def trace_carrier(source: Any) -> dict[str, str] | None:
    """The W3C trace context in HTTP headers or an MCP ``_meta`` object; None when absent."""
    parent = source.get("traceparent") if source else None
    if not isinstance(parent, str):
        return None
    state = source.get("tracestate")
    return {"traceparent": parent, "tracestate": state} if isinstance(state, str) else {
        "traceparent": parent}


def http_trace(headers: Mapping[bytes, bytes]) -> dict[str, str] | None:
    """The W3C trace context in raw (ASGI) request headers."""
    parent = headers.get(b"traceparent")
    if parent is None:
        return None
    state = headers.get(b"tracestate")
    return trace_carrier({"traceparent": parent.decode("latin-1"),
                          "tracestate": None if state is None else state.decode("latin-1")})
