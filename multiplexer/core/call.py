"""The units of work that cross the gateway: a call in, one outcome out."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import anyio

from multiplexer.core.errors import RpcError
from multiplexer.core.logs import LogSink

_seq = itertools.count()


class Outcome:
    """Exactly one of ``result`` / ``error`` is meaningful: an error when ``error`` is set.

    ``result_json`` optionally carries ``result`` already encoded as JSON, built by
    the provider off the event loop (an embedding's floats); faces that write JSON
    send it as it is instead of encoding ``result`` again. Such a provider may hand
    over ``later`` instead of ``result``: it builds the result on its first read, so a
    call answered from ``result_json`` alone never builds it (an embedding's 384
    floats as Python objects cost the worker thread their making and the event loop
    their freeing). Read-only once made, but for ``cost_pico`` and ``saved_pico``: what this
    caller's call cost and what the gateway saved on it, in integer pico-dollars (the ledger's
    unit; None: unknown or not priced), set by the gateway on the caller's own outcome as it is
    answered. ``cost`` and ``saved`` are the same in US dollars, made only when read: the hot
    path writes the amounts as text straight from the integers (``money/report.pico_text``).
    """

    __slots__ = ("_later", "_result", "cost_pico", "error", "result_json", "saved_pico")

    def __init__(self, result: Any = None, error: RpcError | None = None,
                 result_json: bytes | None = None, *, later: Callable[[], Any] | None = None) -> None:
        self._result = result
        self._later = later
        self.error = error
        self.result_json = result_json
        self.cost_pico: int | None = None
        self.saved_pico = 0

    @property
    def result(self) -> Any:
        later = self._later
        if later is not None:  # two first reads at once build equal results; either is kept
            self._result, self._later = later(), None
        return self._result

    def built(self) -> Any:
        """The result if it is built (a provider's ``later`` one is not built for this)."""
        return None if self._later is not None else self._result

    def copy(self) -> Outcome:
        """The same answer as an outcome of its own (a caller's cost on a shared execution)."""
        twin = Outcome(self._result, self.error, self.result_json, later=self._later)
        twin.cost_pico, twin.saved_pico = self.cost_pico, self.saved_pico
        return twin

    @property
    def cost(self) -> Decimal | None:
        """What the call cost in US dollars; None when unknown or not priced."""
        return None if self.cost_pico is None else Decimal(self.cost_pico).scaleb(-12)

    @property
    def saved(self) -> Decimal | None:
        """What the gateway saved on the call in US dollars; None when nothing."""
        return Decimal(self.saved_pico).scaleb(-12) if self.saved_pico else None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def fail(cls, error: RpcError) -> Outcome:
        return cls(error=error)

    def __repr__(self) -> str:
        shown = "<not built>" if self._later is not None else repr(self._result)
        return f"Outcome(result={shown}, error={self.error!r})"


@dataclass(slots=True)
class Call:
    """A call as a client made it, after decoding and before routing."""

    method: str
    params: Any = None
    priority: int = 0
    timeout_ms: float | None = None
    idempotency_key: str | None = None
    identity: str | None = None
    notification: bool = False
    # Where progress notifications for this call go (the MCP face's sink for a progressToken).
    # Set by a face, never from the wire: client ``_meta`` keys never reach the providers' options.
    progress: Callable[..., Any] | None = None
    # Where the upstream's log messages for this call go, at or above the caller's level (the MCP
    # face's sink); None: the caller asked for none. Set by a face, never from the wire.
    log: LogSink | None = None
    # How an upstream's questions during this call reach its client (``core/asking.Asker``: the
    # MCP face's, for elicitation, sampling and roots); None: it cannot be asked. Set by a face.
    ask: Any = None
    # Where a streamed call's chunks go (an anyio memory stream the face reads); None: not streamed.
    sink: Any = None
    # The caller's trace context (``traceparent``, ``tracestate``) from an HTTP header or MCP
    # ``_meta``, and the face it came by (``rpc``, ``mcp``, ``v1``): for traces only.
    trace: dict[str, str] | None = None
    face: str = ""
    # The provider operation asked for instead of the route's (``/v1/responses`` on a chat route).
    # Set by a face that checked the provider serves it, never from the wire.
    operation: str | None = None
    # Who a ``jobs.submit`` stores its job for (``task``: the MCP task face), shown by ``jobs.*``.
    # Set by a face, never from the wire; None: the client's own job.
    job_source: str | None = None
    # The face's last step on a successful outcome (its API's shape, its JSON), run by the gateway
    # before the call counts as answered: a result the face cannot send counts as the error it
    # becomes, not as ok. Its exceptions are the gateway's to catch. None: the outcome as it is.
    shape: Callable[[Outcome], Outcome] | None = None
    # The route that served the call, set by the gateway when it may differ from ``method`` (a
    # model group, a fallback): faces say it (``x-multiplexer-route``). None: ``method``'s route.
    route: str | None = None
    # The caller asked to be told that route (JSON-RPC ``_meta.want_route``): ``_meta.route`` on
    # its result, ``data.route`` on its error.
    want_route: bool = False
    # The caller asked for the call's cost with its result (``_meta.want_cost: true``).
    want_cost: bool = False
    # A batch's budget reservation (``money/budgets.Reservation``) this line draws its own from,
    # reserved whole when the batch was made. Set by a face, never from the wire.
    budget: Any = None
    # The client's batch this call is a line of (a ``/v1/batches`` id), for the request log. Set by
    # a face, never from the wire.
    batch_id: str | None = None
    # The caller's session (``/v1``'s ``x-session-id`` header), a prompt-cache affinity key for
    # model groups and ``base_urls`` (``core/cache_affinity.py``). Set by a face; None: none.
    session: str | None = None
    # What the face tells the semantic cache (opted out, the request's id) and what the cache
    # answers (a hit, its similarity, the original request's id). Set by a face and the gateway.
    cache: CacheNote | None = None


@dataclass(slots=True)
class CacheNote:
    """A call and the semantic cache (``multiplexer/cache/``): ``off`` when the caller said
    ``cache-control: no-cache`` or ``x-multiplexer-cache: off``; ``how`` (``semantic``) when the
    answer came from it, with the stored answer's similarity and original request id."""

    off: bool = False
    request_id: str | None = None
    how: str | None = None
    similarity: float | None = None
    original_request_id: str | None = None


@dataclass(slots=True, eq=False)
class Item:
    """What a provider sees: one routed call ready to go upstream.

    ``group`` decides which items may share one upstream batch (same operation,
    same model, ...); ``tokens`` is the estimated cost charged to token limits.
    """

    route: str
    operation: str
    method: str
    params: Any
    group: Hashable = None
    tokens: int = 1
    priority: int = 0
    deadline: float | None = None
    identity: str | None = None
    notification: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    seq: int = field(default_factory=lambda: next(_seq))
    trace: Any = None  # a core.tracing.TraceSlot when calls are traced
    # The limit (rpm, tpm, concurrency, retry_after) a taken item waits for before it goes upstream
    # (shared limits, extra requests of a batch); None once it goes: a deadline then says so.
    held: str | None = None


class Future:
    """A one-shot result slot: the first outcome wins, later ones are ignored.

    This is where "every accepted call ends exactly once" is enforced: a timeout,
    a cancel and a late upstream answer may race, only one reaches the caller.
    Waiting is by callback; no event is allocated unless someone awaits ``wait``,
    which keeps tens of thousands of parked calls cheap.
    """

    __slots__ = ("_callbacks", "_outcome")

    def __init__(self) -> None:
        self._outcome: Outcome | None = None
        self._callbacks: list[Callable[[], object]] | None = None

    def set(self, outcome: Outcome) -> bool:
        if self._outcome is not None:
            return False
        self._outcome = outcome
        callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            cb()
        return True

    def done(self) -> bool:
        return self._outcome is not None

    def add_done_callback(self, cb: Callable[[], object]) -> None:
        if self._outcome is not None:
            cb()
        elif self._callbacks is None:
            self._callbacks = [cb]
        else:
            self._callbacks.append(cb)

    def outcome(self) -> Outcome:
        assert self._outcome is not None
        return self._outcome

    async def wait(self) -> Outcome:
        if self._outcome is None:
            event = anyio.Event()
            self.add_done_callback(event.set)
            await event.wait()
        assert self._outcome is not None
        return self._outcome
