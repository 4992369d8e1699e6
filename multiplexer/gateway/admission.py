"""Admission's first stage: a call's ``Plan``, decided from the config alone.

``Gateway.submit_many`` admits in three stages: ``admit(call) -> Plan`` (here: route,
operation, item, dedup key, what the call claims of its key's quota; no state read,
nothing changed), ``decide`` (the one place that consults quotas, local or shared, one
``Grant`` per plan) and ``enqueue(plan, grant)``, the only step with effects. The jobs
face builds its items with ``route_item`` too, so a batch job's call is the call a
live one would be.

``Gateway.admit`` is a short sequence of the steps below, each one decision: a gateway
method's plan (``method_plan``); the route a caller's call takes (``caller_route``: access,
a model group's pick, ``mode: auto``, the deadline); its item there (``routed_item``: the
caller's options, trace slot and stream); what it may share (``sharing``: grouping tags and
dedup key); what it claims of its key's quota (``claim_of``). Each writes only the plan and
its item: admission runs once per call, so none allocates beyond what the call needs.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from multiplexer.core.asking import carry
from multiplexer.core.cache_affinity import SESSION
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.dedup import canonical
from multiplexer.core.errors import RpcError, invalid_params
from multiplexer.core.jobs import FALLBACK_ROUTES
from multiplexer.core.logs import LogFanout
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import STREAM, Provider, Streamer
from multiplexer.core.quota import Claim, Quotas
from multiplexer.core.router import Resolved, Router
from multiplexer.core.sink import ChunkSink
from multiplexer.core.tracing import Tracer, TraceSlot
from multiplexer.gateway.auto_mode import deadline_mode
from multiplexer.gateway.config import Config
from multiplexer.gateway.idempotency import IdempotencyKey
from multiplexer.gateway.tickets import Handler


@dataclass(slots=True, eq=False)
class Plan:
    """What admission decided for one call before anything was charged or queued.

    Exactly one of ``error`` (refused: nothing will be charged), ``handler`` (a gateway
    method) or ``item`` (a routed call) says what happens next."""

    call: Call
    label: str  # the metrics label: a route or gateway method, never the client's string
    deadline: float
    started: float = 0.0  # the clock's time at admission (the call's latency counts from here)
    claim: Claim | None = None  # None: the call asks nothing of a quota
    error: RpcError | None = None
    handler: Handler | None = None
    route: RouteConfig | None = None
    item: Item | None = None
    dedup_key: Hashable | None = None
    span: Any = None  # the call's trace span, when calls are traced
    attempts: Any = None  # gateway/fallbacks.Attempts: the call may move on to other routes
    reservation: Any = None  # what a budget reserved for it (money/budgets.py), settled as it ends
    auto: bool = False  # ``mode: auto`` chose the route's mode by the call's deadline
    cached: Outcome | None = None  # the semantic cache's answer (gateway/semantic.py)
    first_chunk_s: float | None = None  # a stream's time to its first chunk (the request log's)


def own_model(route: RouteConfig, params: Any) -> Any:
    """The params for a route the caller did not name: the route's own model, unless the
    caller's model is one the route lists."""
    if not isinstance(params, dict):
        return params
    model = route.params.get("model") or (route.models[0] if route.models else None)
    if model is None or params.get("model") in route.models:
        return params
    return {**params, "model": model}


def route_item(resolved: Resolved, params: Any, *, identity: str | None,
               operation: str | None = None, priority: int = 0, deadline: float | None = None,
               notification: bool = False) -> Item:
    """A call's item on its route: the route's params under the caller's, its operation unless
    a face asked for another, its own options and mode."""
    route = resolved.route
    if route.params and isinstance(params, dict | None):
        params = {**route.params, **(params or {})}
    return Item(route=resolved.name, operation=operation or route.operation,
                method=resolved.upstream_method, params=params,
                priority=priority or route.priority, deadline=deadline, identity=identity,
                notification=notification, options={**route.extra, "mode": route.mode})


class Picks(Protocol):
    """The fallbacks' part in admission (``gateway/fallbacks.Fallbacks``)."""

    watched: set[str]  # routes whose calls may move on (fallbacks, breakers, max_attempts)

    def pick(self, resolved: Resolved, call: Call | None = None) -> Resolved: ...

    def for_job(self, resolved: Resolved, takes: Callable[[str], bool]) -> tuple[Resolved, list[str]]: ...

    def refusal(self, call: Call, name: str, route: RouteConfig) -> RpcError | None: ...


class Admits(Protocol):
    """What the steps read of the gateway they admit for (``Gateway``): its config and parts,
    never its lanes or its state."""

    @property
    def config(self) -> Config: ...
    @property
    def router(self) -> Router: ...
    @property
    def fallbacks(self) -> Picks: ...
    @property
    def providers(self) -> dict[str, Provider]: ...
    @property
    def quotas(self) -> Quotas: ...
    @property
    def tracer(self) -> Tracer: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def metrics(self) -> Metrics: ...

    def check_access(self, identity: str, route: str, params: Any, face: str) -> None: ...


def method_plan(gw: Admits, plan: Plan, handler: Handler) -> None:
    """A gateway method's plan (``jobs.*``): its handler, the server's timeout, and one call of
    its key's quota, like any call."""
    call = plan.call
    plan.label, plan.handler = call.method, handler
    plan.deadline = plan.started + (call.timeout_ms or gw.config.server.default_timeout_ms) / 1000.0
    plan.claim = claim_of(gw.quotas, call.identity, 0)


def caller_route(gw: Admits, plan: Plan) -> Resolved:
    """The route this caller's call takes, and its deadline there: the name resolved, the key's
    access checked, a model group's first route by its strategy, ``mode: auto`` made batch or
    sync by the call's deadline. Raises the refusal."""
    call = plan.call
    resolved = allowed_route(gw, call)
    if resolved.group is not None:  # the first member the caller may use with its own model
        resolved = gw.fallbacks.pick(resolved, call)
    plan.label = resolved.name
    if resolved.route.mode == "auto":  # the batch API or now
        plan.auto = True
        resolved = deadline_mode(resolved, call.timeout_ms, gw.providers[resolved.route.provider],
                                 call.sink is not None)
    route = plan.route = resolved.route
    timeout_ms = call.timeout_ms or route.timeout_ms or gw.config.server.default_timeout_ms
    plan.deadline = plan.started + timeout_ms / 1000.0
    return resolved


def allowed_route(gw: Admits, call: Call) -> Resolved:
    """The route the name the caller called resolves to, once its key may call it (the name and
    the model its params name). Raises the refusal: an unknown name's points at names it may use."""
    try:
        resolved = gw.router.resolve(call.method)
    except RpcError as e:
        raise unknown(gw, call, e) from None
    if call.identity is not None:
        gw.check_access(call.identity, call.method, call.params, call.face)
    return resolved


def unknown(gw: Admits, call: Call, error: RpcError) -> RpcError:
    """The refusal of a name no route serves: a keyed caller's points only at a name its key may
    call (looked for again only then, so a served call makes nothing for it)."""
    identity = call.identity
    if identity is None:
        return error
    return gw.router.unknown(call.method, lambda name: may_call(gw, identity, name, call.face))


def may_call(gw: Admits, identity: str, name: str, face: str) -> bool:
    try:
        gw.check_access(identity, name, None, face)
    except RpcError:
        return False
    return True


def job_item(gw: Admits, call: Call, takes: Container[str]) -> Item:
    """A batch job's line as an item (``jobs.submit``, ``/v1/batches``, MCP tasks): its key's
    access checked as a live call's, its route (a group's pick among the routes on a provider in
    ``takes``, those with a batch API) and the routes it may be resubmitted to if its remote
    batch fails whole, its params there, prepared by its provider. Raises the refusal."""
    resolved = allowed_route(gw, call)
    routes = gw.config.routes
    resolved, fallbacks = gw.fallbacks.for_job(resolved, lambda name: routes[name].provider in takes)
    route = resolved.route
    if route.provider not in takes:
        raise invalid_params(f"route {resolved.name!r} has no batch support "
                             f"(provider {route.provider!r})")
    params = call.params
    if resolved.group is not None:
        params = own_model(route, params)
        if call.identity is not None:  # a group's member is checked with its own model
            refusal = gw.fallbacks.refusal(call, resolved.name, route)
            if refusal is not None:
                raise refusal
    if call.identity is not None:  # resubmitted only where the key may go, with that route's model
        fallbacks = [n for n in fallbacks if gw.fallbacks.refusal(call, n, routes[n]) is None]
    item = route_item(resolved, params, identity=call.identity, operation=call.operation)
    if fallbacks:
        item.options[FALLBACK_ROUTES] = fallbacks
    gw.providers[route.provider].prepare(route, item)
    return item


def call_most(gw: Admits, call: Call, most_of: Callable[[str, RouteConfig, Item, bool], int | None],
              ) -> int | None:
    """The most a call can cost (nano-dollars; ``most_of``: ``Budgets.most_of``) on the route it
    would take now, its item built and prepared as admission would; None when unpriced or when
    it would be refused (it then fails alone, costing nothing)."""
    try:
        resolved = gw.router.resolve(call.method)
        params = call.params
        if resolved.group is not None:
            resolved = gw.fallbacks.pick(resolved, call)
            params = own_model(resolved.route, params)
        route = resolved.route
        item = route_item(resolved, params, identity=call.identity, operation=call.operation)
        gw.providers[route.provider].prepare(route, item)
    except RpcError:
        return None
    return most_of(resolved.name, route, item, False)


def routed_item(gw: Admits, plan: Plan, resolved: Resolved, provider: Provider) -> Item:
    """The call's item on its route, with what the caller listens on (progress, log messages,
    a stream's chunks) and the slot its trace spans hang from."""
    call, route, span = plan.call, resolved.route, plan.span
    item = route_item(resolved, call.params, identity=call.identity, operation=call.operation,
                      priority=call.priority, deadline=plan.deadline, notification=call.notification)
    if call.session is not None:
        item.options[SESSION] = call.session  # a cache-affinity key (core/cache_affinity.py)
    if call.progress is not None:
        item.options["progress"] = call.progress
    if call.log is not None:
        item.options["log"] = LogFanout([call.log])
    if call.ask is not None:
        carry(item, call.ask)
    if span is not None:
        item.trace = TraceSlot(span)
        gw.tracer.routed(span, item, route.provider, gw.config.providers[route.provider].kind)
    if call.sink is not None:
        streamable(resolved.name, route, provider)
        item.options[STREAM] = ChunkSink(call.sink, first_chunk(gw, resolved.name, span, plan))
    return item


def sharing(plan: Plan, item: Item, provider: Provider) -> None:
    """What the prepared item may share: the batches it may ride in (``item.group`` narrowed)
    and, where safe, the identical calls it may share one execution with (``plan.dedup_key``)."""
    call, route = plan.call, plan.route
    assert route is not None
    if call.sink is not None:  # a stream rides alone and is never shared
        item.group = tagged(item.group, "stream")
        return
    if route.mode == "batch" and call.identity is not None:
        item.group = tagged(item.group, call.identity)  # one job per owner (jobs.*)
    if plan.auto and route.mode == "batch":  # never in one upstream batch with its sync calls
        item.group = tagged(item.group, "batch")
    plan.dedup_key = dedup_key(call, route, item, provider)


def claim_of(quotas: Quotas, identity: str | None, batch_calls: int, tokens: int = 0) -> Claim | None:
    """What a call asks of its key's quota; None for keyless callers and keys without one.
    ``tokens``: the estimate its provider made (``Item.tokens``, what its lane charges to the
    provider's tpm), asked only of a key with tpm."""
    quota = quotas.quotas.get(identity) if identity is not None else None
    if quota is None:
        return None
    return Claim(identity, call=True, batch_calls=batch_calls,
                 tokens=tokens if quota.tpm is not None else 0)


def dedup_key(call: Call, route: RouteConfig, item: Item, provider: Provider) -> Hashable | None:
    """The key identical calls share one execution under; None when they may not. An idempotency
    key is the caller's own, even on a ``dedup_scope: global`` route, and is bound to the params
    (``gateway/idempotency.py``: the flights refuse its reuse with other params)."""
    allowed = route.dedup if route.dedup is not None else (
        call.idempotency_key is not None or provider.dedup_safe(item)
    )
    if not allowed or call.notification:
        return None
    if call.idempotency_key is not None:
        return IdempotencyKey(item.route, item.method, call.identity, call.idempotency_key,
                              canonical(item.params))
    scope = None if route.dedup_scope == "global" else call.identity
    return (item.route, item.method, scope, canonical(item.params))


def tagged(group: Hashable, tag: Hashable) -> tuple[Hashable, ...]:
    """``group`` narrowed by ``tag``: a tuple extended, any other group (None: the provider lets any
    calls share a batch) kept whole as the first element, never unpacked."""
    return (*group, tag) if isinstance(group, tuple) else (group, tag)


def streamable(name: str, route: RouteConfig, provider: Provider) -> None:
    """Raise why a call on this route cannot stream."""
    if not isinstance(provider, Streamer):
        raise invalid_params(f"route {name} cannot stream (its provider has no streaming)",
                             param="stream")
    if route.mode == "batch":
        raise invalid_params(f"route {name} runs as batch jobs and cannot stream", param="stream")


def first_chunk(gw: Admits, route: str, span: Any, plan: Plan | None = None) -> Callable[[], None]:
    """What a stream admitted now does when its first chunk leaves: its time to first chunk
    in ``/metrics`` and on its span."""
    start = gw.clock.now()

    def first() -> None:
        seconds = gw.clock.now() - start
        gw.metrics.time_to_first_chunk.labels(route).observe(seconds)
        if plan is not None:
            plan.first_chunk_s = seconds
        if span is not None:
            gw.tracer.first_chunk(span, seconds)

    return first
