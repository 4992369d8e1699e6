"""The contract between the gateway and an upstream kind.

A provider turns a batch of routed items into one outcome per item, in order;
one item's failure never fails its neighbours. Everything else (queueing,
limits, dedup, deadlines) is the lane's job, so a provider stays small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from multiplexer.core.batching import Formation
from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.jobs import BatchJobs
from multiplexer.core.limiter import Limiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig, RouteConfig
from multiplexer.core.sink import ChunkSink
from multiplexer.core.tracing import NOOP, Tracer


class NoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(slots=True)
class ToolSpec:
    """A callable the provider exposes (an MCP tool, a model, ...), before namespacing."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    annotations: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ProviderContext:
    name: str
    config: ProviderConfig
    settings: Any
    clock: Clock
    limiter: Limiter  # a provider reports to it (observe, correct_tokens, pause); the lane charges
    metrics: Metrics
    store_path: Path
    notify: Callable[[str, dict[str, Any]], None] = lambda event, data: None
    # An httpx transport for an HTTP provider to send through instead of its own lean one:
    # tests hand in respx (``httpx.MockTransport(router.async_handler)``).
    transport: Any = None
    tracer: Tracer = NOOP  # puts the upstream batch's trace context into upstream requests
    store_url: str | None = None  # batch jobs in PostgreSQL (shared by replicas) instead of store_path
    store_lease_s: float = 30.0  # with store_url: how long a replica's claim on a batch lasts
    store_schema: str = "multiplexer"  # with store_url: the PostgreSQL schema of the job tables
    # The gateway's circuit breakers (``core/breaker.Breakers``): a provider with ``base_urls`` and
    # a ``breaker`` adds one per endpoint there (``<provider>@<base_url>``). None: no breakers.
    breakers: Any = None
    # Where a job's items go when their remote batch fails whole (``core/jobs.JobFallback``); None:
    # they fail with it.
    job_fallback: Any = None


class Provider:
    """Base class with the defaults most kinds want; override what differs.

    ``execute`` is the one required method; ``start``/``aclose`` are the lifecycle;
    ``prepare``, ``dedup_safe`` and ``formation`` tune the lane. Anything more a kind
    can do is a capability below, which the faces discover with ``isinstance``.
    """

    Settings: ClassVar[type[BaseModel]] = NoSettings
    # A route's keys beyond ``RouteConfig``'s that this kind reads (from ``item.options``): the
    # loader refuses any other, so a typo in a route is an error, never a key silently ignored.
    RouteSettings: ClassVar[type[BaseModel]] = NoSettings
    # Lane slots when the config sets no ``limits.concurrency``: a kind whose calls hold a slot
    # long (streams, generation) or that learns its limits from the upstream sets its own.
    default_concurrency: ClassVar[int | None] = None
    # True for a kind that puts the batch span's ``traceparent`` on its upstream requests itself
    # (``tracer.inject``): its lane skips attaching the OpenTelemetry context, which only
    # libraries that propagate it on their own (the MCP SDK) read.
    injects_trace: ClassVar[bool] = False

    def __init__(self, ctx: ProviderContext) -> None:
        self.ctx = ctx
        self.name = ctx.name

    async def start(self) -> None:
        """Open connections or children; called once before the first call."""

    async def aclose(self) -> None:
        """Release everything ``start`` opened, on every shutdown path."""

    def prepare(self, route: RouteConfig, item: Item) -> None:
        """Validate params and set ``item.group`` / ``item.tokens``; raise RpcError -32602."""
        item.group = (item.operation,)

    def routes_changed(self, names: Iterable[str]) -> None:
        """A config reload changed or removed these routes of a provider it kept: forget what was
        built from their own keys (built again from the new ones on their next call)."""

    def dedup_safe(self, item: Item) -> bool:
        """Whether identical concurrent calls may share one execution when the route is silent."""
        return False

    def formation(self, policy: Any) -> Formation | None:
        """A custom batch formation (local models use token budgets); None for the default."""
        return None

    @classmethod
    def answers(cls, route: RouteConfig, settings: Any) -> str:
        """What a route on this kind answers, for faces that pick it by endpoint (``/v1``): its
        ``operation``, or, for a kind whose generic ``call`` routes answer one thing (a local
        model's task), that thing. A class method on the validated settings, so a config can be
        checked without starting a provider."""
        return route.operation

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        raise NotImplementedError


# -- capabilities: what some kinds can do beyond ``execute`` ------------------------------


@runtime_checkable
class ToolSource(Protocol):
    """Lists its tools, for wildcard routes (``tools_*``) and the MCP face."""

    async def list_tools(self) -> list[ToolSpec]: ...


@runtime_checkable
class McpUpstream(ToolSource, Protocol):
    """An upstream MCP server: its tool results are already MCP ``CallToolResult`` objects,
    and an exact route to one of its tools takes that tool's schema."""

    mcp_upstream: bool

    def tools_ttl_ms(self) -> int | None:
        """How long its tool list stays fresh, by the upstream's own hint (None: until it says)."""
        ...

    def listing_ttl_ms(self, method: str) -> int | None:
        """The upstream's ``ttlMs`` on its last ``resources/list``, ``prompts/list``, ... (None: none)."""
        ...


@runtime_checkable
class ResourceSource(Protocol):
    """MCP resources in wire form (camelCase dicts). Reads bypass lanes: they are not routes."""

    name: str  # the provider's configured name: which upstream owns a URI
    async def list_resources(self) -> list[dict[str, Any]]: ...

    async def list_resource_templates(self) -> list[dict[str, Any]]: ...

    async def read_resource(self, uri: str) -> dict[str, Any]:
        """A ``ReadResourceResult``; RpcError -32602 is "no such resource" (the face asks elsewhere)."""
        ...


@runtime_checkable
class PromptSource(Protocol):
    """MCP prompts in wire form; a prompt's name is the provider's own, without the route's prefix."""

    name: str
    async def list_prompts(self) -> list[dict[str, Any]]: ...

    async def get_prompt(self, name: str, arguments: dict[str, str] | None) -> dict[str, Any]: ...


@runtime_checkable
class BatchCapable(Protocol):
    """Runs calls through an asynchronous batch API: the ``jobs.*`` face hands it jobs."""

    jobs: BatchJobs


@runtime_checkable
class Readiness(Protocol):
    """Says whether the provider can serve now, for ``/readyz``: ``up``, ``starting`` (connecting,
    loading) or ``failing``, with the last error or a detail. A provider without it is ``up`` once
    its ``start`` has returned."""

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]: ...


@runtime_checkable
class Describes(Protocol):
    """Says what an operator's dashboard shows about the provider beyond its lane and limits
    (an MCP upstream's era and tools, a local model's device and budget): plain JSON values,
    read on the event loop, cheap (no I/O)."""

    def describe(self) -> dict[str, Any]: ...


STREAM = "_stream"  # item.options key: the sink of a streamed call (set by the gateway only)


def stream_sink(item: Item) -> ChunkSink | None:
    """The sink a streamed item's chunks go to; type-checked, so nothing a client sends passes."""
    sink = item.options.get(STREAM)
    return sink if isinstance(sink, ChunkSink) else None


@runtime_checkable
class Streamer(Protocol):
    """Answers one call as a stream of chunks in its upstream's wire shape (OpenAI chunks,
    Anthropic events). The lane runs ``stream`` where it would run ``execute``: the call holds
    its concurrency slot until the stream ends. The returned outcome carries the final
    ``usage`` (the provider corrects its token charge from it) or the error that ended it."""

    async def stream(self, item: Item, sink: ChunkSink) -> Outcome: ...
