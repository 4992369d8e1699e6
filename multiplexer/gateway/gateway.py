"""The composition root: routes a call, shares it if safe, queues it, waits for its answer.

``Gateway.submit`` is the one path every face (/rpc, /mcp, stdio, SDK) uses, and
it returns exactly one ``Outcome`` per call, whatever happens upstream.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Coroutine, Hashable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from multiplexer.access.compose import directory_for, keys_running
from multiplexer.core.after import after
from multiplexer.core.batching import CountFormation
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import Clock, MonotonicClock, remaining
from multiplexer.core.dedup import ProgressFanout, TtlCache
from multiplexer.core.errors import RpcError, cancelled, internal_error, timeout_error
from multiplexer.core.lane import Lane
from multiplexer.core.limiter import Limiter
from multiplexer.core.logs import LogFanout
from multiplexer.core.metrics import UNROUTED, Metrics, code_label
from multiplexer.core.provider import STREAM, Provider, ProviderContext, ToolSpec, stream_sink
from multiplexer.core.quota import FREE, Grant
from multiplexer.core.router import Resolved, Router
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.shared_quota import SharedQuotas
from multiplexer.core.sink import ChunkSink
from multiplexer.core.streaming import with_streams
from multiplexer.core.tracing import Tracer
from multiplexer.gateway.admission import Plan, caller_route, claim_of, method_plan, routed_item, sharing
from multiplexer.gateway.catalog import route_tools
from multiplexer.gateway.config import Config, ProviderConfig, RouteConfig
from multiplexer.gateway.fallbacks import Fallbacks
from multiplexer.gateway.flights import CachedOutcome, Unsent
from multiplexer.gateway.job_fallbacks import JobFallbacks
from multiplexer.gateway.provider_life import ProviderLives
from multiplexer.gateway.replicas import flights_for, limiter_for, open_state, quotas_for
from multiplexer.gateway.request_log import request_log_for
from multiplexer.gateway.semantic import ask_cache, semantic_for
from multiplexer.gateway.spend import money_for, reserve_budgets, shared_how
from multiplexer.gateway.telemetry import tracer_for
from multiplexer.gateway.tickets import Handler, Ticket, run_here, settle
from multiplexer.money.meter import SEMANTIC
from multiplexer.money.prices import tokens_of

log = logging.getLogger(__name__)


def with_kind_defaults(pconf: ProviderConfig, cls: type[Provider]) -> ProviderConfig:
    """The provider's config with its kind's defaults where the file is silent, decided here once
    (before limiters and lanes are built from it), never by the provider changing its config."""
    default = cls.default_concurrency
    if default is None or "concurrency" in pconf.limits.model_fields_set:
        return pconf
    return pconf.model_copy(update={"limits": pconf.limits.model_copy(update={"concurrency": default})})


def used_tokens(outcome: Outcome, shared: str | None) -> int | None:
    """The tokens a call used, as its answer's usage says; 0 when it shared another's execution,
    which cost it none; None when unknown (a failure too: it may have used them upstream), and
    its estimate stands, as a provider's own tpm counts it."""
    if shared is not None:
        return 0
    if outcome.error is not None:
        return None
    result = outcome.built()
    tokens = tokens_of(result.get("usage")) if type(result) is dict else None
    return None if tokens is None else tokens.input + tokens.output


def _went_upstream(t: Ticket) -> bool:
    """Whether a call that ends in an error had already gone upstream, so the provider may bill
    it: withdrawn (its caller gone, its deadline passed) while its batch ran, or a stream that
    handed its caller chunks. A call refused, queued or answered with an upstream error did not
    (a provider bills no refused request)."""
    p = t.pending
    if p is None or t.shared is not None:
        return False
    if p.state == "running":
        return True
    sink = p.item.options.get(STREAM)
    return isinstance(sink, ChunkSink) and sink.started


class Gateway:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        providers: dict[str, Provider] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.config = config
        # OpenTelemetry only when the config or OTEL_* ask for it (then imported, never before)
        self.tracer = tracer if tracer is not None else tracer_for(config.telemetry)
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or Metrics()
        self.router = Router(config.routes, {g: c.routes for g, c in config.groups.items()})
        self.providers: dict[str, Provider] = dict(providers or {})
        self.limiters: dict[str, Limiter] = {}
        self.lanes: dict[tuple[str, str | None], Lane] = {}
        self.cache = TtlCache(self.clock, config.cache.max_entries)
        self.state = open_state(config.state)  # None: in-process state, one gateway
        # single flight: joined here, or claimed across the replicas that share the state
        self.flights = flights_for(self.state, self.clock, self.metrics, self.start_background)
        self.share = config.server.worker_count()  # processes that split the limits apart
        self.quotas = quotas_for(config, self.clock, self.state, self.metrics, self.share)
        self.fallbacks = Fallbacks(self)  # fallbacks, model groups, circuit breakers
        self.job_fallbacks = JobFallbacks(self)  # a job's items out of a batch that failed whole
        self.keys = directory_for(config, self.quotas)  # YAML and stored keys, their access
        self.money = money_for(config, self.clock, self.metrics, self.state, self.keys)  # None: unpriced
        self.listeners: list[Any] = [] if self.money is None else [self.money.on_event]
        self.semantic = semantic_for(self)  # None: no route, key or team semantically cached
        self.requests = request_log_for(config, self.clock, self.metrics, self.keys)  # None: log off
        if self.requests is not None:  # a batch job's lines, after the money priced them
            self.listeners.append(self.requests.on_event)
        self.methods: dict[str, tuple[Handler, ToolSpec]] = {}
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.faces: dict[str, Any] = {}  # what composers attached (the jobs.* face, ...), by name
        self.started: set[str] = set()  # providers whose start has returned
        self.lives = ProviderLives()  # each provider's own task: started and closed in it
        self.closing = False

    # -- lifecycle -------------------------------------------------------------
    def provider_context(self, name: str, pconf: ProviderConfig, cls: type[Provider], limiter: Limiter,
                         config: Config) -> ProviderContext:
        """What a provider is built with, at start or by a reload (``config``: the one it serves)."""
        return ProviderContext(
            name=name, config=pconf, settings=cls.Settings.model_validate(
                pconf.extra, context=config.paths_context()),
            clock=self.clock, limiter=limiter, metrics=self.metrics,
            store_path=Path(config.store.path), notify=self.notify, store_url=config.store.url,
            store_lease_s=config.store.lease_s, store_schema=config.store.schema_, tracer=self.tracer,
            breakers=self.fallbacks.breakers, job_fallback=self.job_fallbacks)

    async def __aenter__(self) -> Gateway:
        from multiplexer.gateway.registry import provider_class

        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            if self.state is not None:
                await self.state.start()
                stack.push_async_callback(self.state.aclose)
            self.lives = await stack.enter_async_context(ProviderLives())
            for name, pconf in list(self.config.providers.items()):
                cls = type(self.providers[name]) if name in self.providers else provider_class(pconf.kind)
                pconf = self.config.providers[name] = with_kind_defaults(pconf, cls)
                limiter = limiter_for(name, pconf, self.clock, self.state, self.metrics, self.share)
                self.limiters[name] = limiter
                if name not in self.providers:
                    self.providers[name] = cls(self.provider_context(name, pconf, cls, limiter, self.config))
                await self.lives.start(self.providers[name])  # closed when drained or as we stop
                self.started.add(name)
            await stack.enter_async_context(keys_running(self.keys, self.config))
            if self.money is not None:  # its last batch written once the lanes and the writer
                stack.push_async_callback(self.money.aclose)  # task stopped (closed after them)
            if self.requests is not None:  # its last records written after the writer task stopped
                stack.push_async_callback(self.requests.aclose)
            if self.semantic is not None:  # its last writes sent once its task has stopped
                stack.push_async_callback(self.semantic.aclose)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._abort_lanes)
            if self.semantic is not None:
                self._tg.start_soon(self.semantic.run)
            if self.money is not None:  # spend written and budgets settled off the call path
                self._tg.start_soon(self.money.run)
            if self.requests is not None:  # the request log written off the call path
                self._tg.start_soon(self.requests.run)
            if self.state is not None:
                self._tg.start_soon(self.state.heartbeat_forever)
                for limiter in self.limiters.values():
                    if isinstance(limiter, SharedLimiter):
                        self._tg.start_soon(limiter.run)
                if isinstance(self.quotas, SharedQuotas):
                    self._tg.start_soon(self.quotas.run)
                if self.fallbacks.shared:
                    self._tg.start_soon(self.fallbacks.breakers.run)
            for rname, route in self.config.routes.items():
                self._lane_for(rname, route)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, grace: float | None = None) -> None:
        """Stop admitting, let in-flight work finish within the grace period, then fail the rest."""
        if self._stack is None:
            return
        self.closing = True
        grace = self.config.server.grace_period_s if grace is None else grace
        for lane in self.lanes.values():
            lane.close()
        until = self.clock.now() + grace
        for lane in list(self.lanes.values()):  # each lane says when it has drained: no polling
            if not await self.clock.wait_event(lane.drained, until):
                break
        with anyio.move_on_after(2.0):  # hand the shared slots back now, not at lease expiry
            for limiter in self.limiters.values():
                if isinstance(limiter, SharedLimiter):
                    await limiter.drain()
        stack, self._stack = self._stack, None
        await stack.aclose()
        if self.tracer.enabled:
            await anyio.to_thread.run_sync(self.tracer.close)  # send the last spans

    def _abort_lanes(self) -> None:
        for lane in self.lanes.values():
            lane.abort()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def start_background(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``fn(*args)`` for the gateway's lifetime (cancelled when it closes)."""
        assert self._tg is not None, "the gateway is not running"
        self._tg.start_soon(fn, *args)

    def notify(self, event: str, data: dict[str, Any]) -> None:
        """Tell the listeners (MCP faces, tests) about an event."""
        for listener in list(self.listeners):
            try:
                listener(event, data)
            except Exception:
                log.exception("listener failed on %s", event)

    # -- lanes ---------------------------------------------------------------
    def _lane_for(self, rname: str, route: RouteConfig) -> Lane:
        own = route.batch is not None or route.mode == "batch"
        key = (route.provider, rname if own else None)
        lane = self.lanes.get(key)
        if lane is None:
            pconf: ProviderConfig = self.config.providers[route.provider]
            policy = route.batch or pconf.batch
            provider = self.providers[route.provider]
            formation = provider.formation(policy) or CountFormation(
                policy.max_items, policy.max_wait_ms / 1000.0, policy.max_tokens
            )
            lane = Lane(
                f"{route.provider}" if not own else f"{route.provider}:{rname}",
                with_streams(provider),
                formation, self.clock,
                self.limiters[route.provider],
                max_queue=pconf.limits.max_queue,
                # batch mode gathers until size or age; eager only if the route says so
                eager=policy.eager and (route.mode != "batch" or "eager" in policy.model_fields_set),
                metrics=self.metrics, tracer=self.tracer, provider=route.provider,
                attach_trace=not provider.injects_trace,
            )
            self.lanes[key] = lane
            assert self._tg is not None
            self._tg.start_soon(lane.run)
        return lane

    # -- the call path -----------------------------------------------------------
    def resolve(self, method: str) -> Resolved:
        return self.router.resolve(method)

    def register_method(self, spec: ToolSpec, handler: Handler) -> None:
        """A gateway-level method (batch jobs, ...): answered here, not routed to a provider."""
        self.methods[spec.name] = (handler, spec)

    async def submit(self, call: Call) -> Outcome:
        return (await self.submit_many([call]))[0]

    async def submit_many(self, calls: Sequence[Call]) -> list[Outcome]:
        """Admit every call at once, then wait for all of them with one waiter.

        Three stages: ``admit`` plans each call from the config, ``decide`` grants
        or refuses each plan (the one step that consults state), ``enqueue`` acts on it.
        Outcomes come back in input order, one per call. A batch of a thousand calls parks
        a thousand small tickets, not a thousand tasks.
        """
        plans = [self.admit(call) for call in calls]
        if self.semantic is not None:  # admitted (access checked), not yet charged
            await ask_cache(self, self.semantic, plans)
        grants = await self.decide(plans)
        tickets = [self.enqueue(p, g, alone=len(plans) == 1) for p, g in zip(plans, grants, strict=True)]
        try:
            if tickets[0].batch is not None:  # a lone call on an idle lane: run in this task
                await run_here(tickets[0], self.clock, self._finish)
            handlers = [t for t in tickets if t.handler is not None and t.outcome is None]
            if len(handlers) == 1:
                await self._run_handler(handlers[0])
            elif handlers:  # at once, each under its own deadline: one slow jobs.* waits for no other
                async with anyio.create_task_group() as tg:
                    for t in handlers:
                        tg.start_soon(self._run_handler, t)
            await settle(tickets, self.clock, self._finish)
            await self.quotas.flush()
        except Exception as e:  # a bug here must not reach a face as a traceback: each call fails
            log.exception("calls failed inside the gateway")
            failed = Outcome.fail(internal_error(type(e).__name__))
            for t in tickets:
                self._finish(t, failed, withdraw=True)
        except BaseException:
            gone = Outcome.fail(cancelled("caller went away"))
            for t in tickets:
                self._finish(t, gone, withdraw=True)
            raise
        return [t.outcome for t in tickets]  # type: ignore[misc]

    async def decide(self, plans: Sequence[Plan]) -> Sequence[Grant]:
        """Stage two, the one place that reads state: each plan's quotas (rpm, tpm, concurrency,
        batch calls) and budgets decided together, all or nothing: a plan refused by a budget has
        its quota charge given back (``plan.error`` says why). One ``Grant`` per plan, by plan."""
        if any(p.claim is not None for p in plans):
            grants: Sequence[Grant] = await self.quotas.decide([p.claim for p in plans])
        else:
            grants = [FREE] * len(plans)
        if self.money is not None:
            await reserve_budgets(self.money, self.quotas, plans, grants)
        return grants

    def admit(self, call: Call) -> Plan:
        """Stage one: everything about a call that needs no state (route, operation, item,
        dedup key, what it claims of its key's quota), one step of ``gateway/admission.py``
        each. Reads the config and the clock only; a refusal here is the plan's ``error`` and
        charges nothing."""
        # labelled by route, never by the client's method string: unknown names would grow the
        # metrics without bound (and a lone surrogate would break /metrics)
        plan = Plan(call, UNROUTED, math.inf, started=self.clock.now())
        plan.span = self.tracer.start_call(call) if self.tracer.enabled else None
        try:
            builtin = self.methods.get(call.method)
            if builtin is not None:
                method_plan(self, plan, builtin[0])
                return plan
            resolved = caller_route(self, plan)
            route = resolved.route
            provider = self.providers[route.provider]
            item = plan.item = routed_item(self, plan, resolved, provider)
            if resolved.group is not None or resolved.name in self.fallbacks.watched:
                plan.attempts = self.fallbacks.attempts(plan, resolved)
            provider.prepare(route, item)
            sharing(plan, item, provider)
            plan.claim = claim_of(self.quotas, call.identity, 1 if route.mode == "batch" else 0,
                                  item.tokens)
        except RpcError as e:
            plan.error = e
        except Exception as e:
            log.exception("call %s failed inside the gateway", call.method)
            plan.error = internal_error(type(e).__name__)
        return plan

    def check_access(self, identity: str, route: str, params: Any, face: str) -> None:
        """Raise why this key may not call ``route`` (a method or tool name, as called) or the model
        its params name: its team's globs and its own (``access.rules``)."""
        refusal = self.attempt_refusal(identity, route, params, face)
        if refusal is not None:
            raise refusal

    def attempt_refusal(self, identity: str, route: str, params: Any, face: str) -> RpcError | None:
        """Why this key may not have a call served by ``route`` with ``params`` (a fallback's or
        a group member's attempt, checked as admission checks the call itself); None: it may."""
        rules = self.keys.rules.get(identity)
        return None if rules is None else rules.refusal(route, params, face)

    def rebudget(self, plan: Plan) -> RpcError | None:
        """A call moved to another route (a fallback): its budget reservation made the most that
        route can cost, or the refusal when its budget has no room for the difference."""
        if self.money is None:
            return None
        return self.money.budgets.rereserve(plan)

    def enqueue(self, plan: Plan, grant: Grant, *, alone: bool = False) -> Ticket:
        """Stage three, the only one with effects: answer from the cache, join an identical call
        in flight, or queue the item on its lane. A call refused here never ran, so its batch
        charge is given back. ``alone``: the caller's only call, which an idle lane hands back to
        run in the caller's task (``Lane.express``) unless it is shared or has fallbacks (a
        stream also on a busy lane with nothing queued)."""
        call = plan.call
        ticket = Ticket(plan.label, call.identity, plan.deadline, started=plan.started)
        ticket.span, ticket.grant = plan.span, grant
        if self.money is not None or self.requests is not None:
            ticket.plan = plan
        if call.shape is not None:
            ticket.shape = call.shape
        if plan.error is not None or grant.refusal is not None:
            self._finish(ticket, Outcome.fail(plan.error or grant.refusal))  # type: ignore[arg-type]
            return ticket
        if plan.cached is not None:  # the semantic cache's answer: no quota, no budget, no lane
            ticket.shared = SEMANTIC
            if plan.span is not None:
                self.tracer.shared(plan.span, SEMANTIC)
            self._finish(ticket, plan.cached)
            return ticket
        try:
            if plan.handler is not None:
                ticket.handler, ticket.call = plan.handler, call
            else:
                route, item = plan.route, plan.item
                assert route is not None and item is not None
                ticket.attempts = plan.attempts
                if plan.attempts is None or self.fallbacks.may_run(ticket, plan):
                    ticket.lane = lane = self._lane_for(plan.label, route)
                    if plan.dedup_key is None:
                        batch = None
                        if (alone and plan.attempts is None and plan.deadline > plan.started):
                            batch = lane.express(item, stream_sink(item) is not None)
                        if batch is None:
                            ticket.pending = lane.submit(item)
                        else:
                            ticket.pending, ticket.batch = batch[0][0], batch
                    else:
                        self._join_or_submit(ticket, plan, route, item, lane, plan.dedup_key)
        except RpcError as e:
            self.quotas.refund(grant)
            self._finish(ticket, Outcome.fail(e))
        except Exception as e:
            log.exception("call %s failed inside the gateway", call.method)
            self.quotas.refund(grant)
            self._finish(ticket, Outcome.fail(internal_error(type(e).__name__)))
        if ticket.outcome is None:  # answered later: in flight until then
            ticket.in_flight = self.metrics.call_started(ticket.label)
        return ticket

    def _join_or_submit(self, ticket: Ticket, plan: Plan, route: RouteConfig, item: Item, lane: Lane,
                        key: Hashable) -> None:
        """A deduplicable call: the cached answer, the identical call in flight, or a new one."""
        call, span = plan.call, plan.span
        item.options["idempotent"] = True
        sink = item.options.get("progress")
        cached = self.cache.get(key)
        if cached is not None:
            self.metrics.dedup_hits.labels(plan.label, "cache").inc()
            ticket.shared = "cache"
            if span is not None:
                self.tracer.shared(span, "cache")
            self._finish(ticket, cached)
            return
        fan: Any = ProgressFanout()  # later sharers may ask for progress
        item.options["progress"] = fan
        logs = item.options.setdefault("log", LogFanout())  # ... and for log messages
        pending, joined = self.flights.start(key, item, lane, route.cache_ttl_s or 0.0)
        if joined:  # this item's fanouts are never used
            shared = pending.item  # the queue drops it once every caller's deadline has passed
            shared.deadline = None if shared.deadline is None else max(shared.deadline, ticket.deadline)
            self.metrics.dedup_hits.labels(plan.label, "inflight").inc()
            ticket.shared = "dedup"
            if span is not None:
                self.tracer.shared(span, "inflight")
            fan = pending.item.options.get("progress")
            logs = pending.item.options.get("log")
        if callable(sink) and isinstance(fan, ProgressFanout):
            fan.add(sink)
            ticket.progress = (fan, sink)
        if isinstance(logs, LogFanout) and call.log is not None:
            if joined:  # its own fanout was never used
                logs.add(call.log)
            ticket.log = (logs, call.log)
        ticket.pending, ticket.key, ticket.cache_ttl = pending, key, route.cache_ttl_s

    async def _run_handler(self, t: Ticket) -> None:
        assert t.handler is not None and t.call is not None
        try:
            with anyio.move_on_after(remaining(self.clock, t.deadline)) as scope:
                outcome = Outcome(result=await t.handler(t.call))
            if scope.cancelled_caught:
                outcome = Outcome.fail(timeout_error("running"))
        except RpcError as e:
            outcome = Outcome.fail(e)
        except Exception as e:
            log.exception("method %s failed inside the gateway", t.label)
            outcome = Outcome.fail(internal_error(type(e).__name__))
        self._finish(t, outcome)

    def _finish(self, t: Ticket, outcome: Outcome, *, withdraw: bool = False) -> None:
        """Give a ticket its one outcome and release what it held."""
        if t.outcome is not None:
            return
        if t.attempts is not None and self.fallbacks.settle(t, outcome, withdraw):
            return  # the call moved on to its next route
        if isinstance(outcome, Unsent):  # its lane refused the shared flight it won: it never ran
            self.quotas.refund(t.grant)
        answer = outcome if t.shape is None or outcome.error is not None else self._shaped(t, outcome)
        plan = t.plan
        if plan is not None and self.money is not None:  # its cost, its saving, its budget settled
            answer = self.money.finish(plan, outcome, answer, shared_how(t.shared, outcome),
                                       answer.error is not None and _went_upstream(t))
        t.outcome = answer
        if plan is not None:
            t.plan = None
            if self.requests is not None:  # its record, queued for the request log's writer
                self.requests.ended(plan, outcome, answer, t.lane.name if t.lane is not None else None,
                                    t.shared, self.clock.now() - t.started)
        if t.span is not None:  # ended now, recorded once the answer is written
            after(self.tracer.end_call, t.span, t.pending.item.trace if t.pending is not None else None,
                  answer, time.time_ns())
            t.span = None
        t.leave_fanouts()
        if t.pending is not None:
            if withdraw and t.lane is not None:
                t.lane.withdraw(t.pending, outcome)
            if t.key is not None:
                self.flights.release(t.key, t.pending)
                if outcome.ok and t.cache_ttl and not withdraw:
                    ttl = t.cache_ttl  # a shared cache hit: what it had left there, no more
                    if isinstance(outcome, CachedOutcome):
                        ttl = min(ttl, outcome.ttl_s)
                    self.cache.put(t.key, outcome, ttl)  # the provider's: each caller shapes its own
        if t.grant.tokens:  # a key with tpm: its charge settled to what the call used
            self.quotas.release(t.grant, used_tokens(outcome, shared_how(t.shared, outcome)))
        else:
            self.quotas.release(t.grant)
        code = "ok" if answer.error is None else code_label(answer.error.code)
        self.metrics.call_answered(t.label, code, self.clock.now() - t.started)
        if t.in_flight is not None:
            t.in_flight.n -= 1
            t.in_flight = None
        t.pending = t.lane = t.call = t.waiter = t.shape = None

    @staticmethod
    def _shaped(t: Ticket, outcome: Outcome) -> Outcome:
        """The face's answer built from a successful outcome; a failure to build it is the call's."""
        assert t.shape is not None
        try:
            return t.shape(outcome)
        except RpcError as e:
            return Outcome.fail(e)
        except Exception as e:
            log.exception("route %s: its result could not be answered", t.label)
            return Outcome.fail(internal_error(type(e).__name__))

    # -- discovery -------------------------------------------------------------
    async def list_tools(self) -> list[ToolSpec]:
        """Every route as a tool: exact routes from config, wildcard routes from their provider."""
        builtins = [spec for _, spec in self.methods.values()]
        return await route_tools(self.config.routes, self.providers, builtins, self.config.groups)
