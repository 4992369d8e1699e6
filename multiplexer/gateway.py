"""The composition root: routes a call, shares it if safe, queues it, waits for its answer.

``Gateway.submit`` is the one path every face (/rpc, /mcp, stdio, SDK) uses, and
it returns exactly one ``Outcome`` per call, whatever happens upstream.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Hashable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from .batching import CountFormation, Pending
from .call import Call, Item, Outcome
from .clock import Clock, MonotonicClock
from .config import Config, ProviderConfig, RouteConfig
from .dedup import InFlight, TtlCache, canonical
from .errors import Code, RpcError, cancelled, internal_error, timeout_error
from .lane import Lane
from .limiter import RateLimiter
from .metrics import Metrics
from .provider import Provider, ProviderContext, ToolSpec
from .quota import Quotas
from .router import Resolved, Router

log = logging.getLogger(__name__)

Handler = Callable[[Call], Awaitable[Any]]


class Gateway:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        providers: dict[str, Provider] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or Metrics()
        self.router = Router(config.routes)
        self.providers: dict[str, Provider] = dict(providers or {})
        self.limiters: dict[str, RateLimiter] = {}
        self.lanes: dict[tuple[str, str | None], Lane] = {}
        self.inflight = InFlight()
        self.cache = TtlCache(self.clock, config.cache.max_entries)
        self.quotas = Quotas(self.clock, config.server.quotas)
        self.listeners: list[Any] = []
        self.methods: dict[str, tuple[Handler, ToolSpec]] = {}
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.closing = False

    # -- lifecycle -------------------------------------------------------------
    async def __aenter__(self) -> Gateway:
        from providers.registry import provider_class

        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            for name, pconf in self.config.providers.items():
                limiter = RateLimiter(self.clock, pconf.limits.rpm, pconf.limits.tpm)
                self.limiters[name] = limiter
                if name not in self.providers:
                    cls = provider_class(pconf.kind)
                    settings = cls.Settings.model_validate(pconf.extra)
                    ctx = ProviderContext(
                        name=name, config=pconf, settings=settings, clock=self.clock,
                        limiter=limiter, metrics=self.metrics,
                        store_path=Path(self.config.store.path), notify=self._notify,
                    )
                    self.providers[name] = cls(ctx)
                provider = self.providers[name]
                await provider.start()
                stack.push_async_callback(provider.aclose)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._abort_lanes)
            for rname, route in self.config.routes.items():
                self._lane_for(rname, route)
            from .jobs_face import register_job_methods  # batch jobs: jobs.* methods
            register_job_methods(self)
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
        with anyio.move_on_after(grace):
            while any(len(lane.queue) or lane.in_flight for lane in self.lanes.values()):
                await anyio.sleep(0.01)
        stack, self._stack = self._stack, None
        await stack.aclose()

    def _abort_lanes(self) -> None:
        for lane in self.lanes.values():
            lane.abort()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def _notify(self, event: str, data: dict[str, Any]) -> None:
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
                provider.execute, formation, self.clock, self.limiters[route.provider],
                max_queue=pconf.limits.max_queue, max_in_flight=pconf.limits.concurrency,
                # batch mode gathers until size or age; eager only if the route says so
                eager=policy.eager and (route.mode != "batch" or "eager" in policy.model_fields_set),
                metrics=self.metrics,
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
        label = call.method
        try:
            builtin = self.methods.get(call.method)
            if builtin is not None:
                outcome = Outcome(result=await builtin[0](call))
                self.metrics.calls.labels(call.method, "ok").inc()
                return outcome
            resolved = self.router.resolve(call.method)
            label = resolved.name
            outcome = await self._submit(call, resolved)
        except RpcError as e:
            outcome = Outcome.fail(e)
        except anyio.get_cancelled_exc_class():
            self.metrics.calls.labels(label, str(int(Code.CANCELLED))).inc()
            raise
        except Exception as e:
            log.exception("call %s failed inside the gateway", call.method)
            outcome = Outcome.fail(internal_error(type(e).__name__))
        self.metrics.calls.labels(label, "ok" if outcome.ok else str(outcome.error.code)).inc()
        return outcome

    async def _submit(self, call: Call, resolved: Resolved) -> Outcome:
        route = resolved.route
        async with self.quotas.admit(call.identity):
            timeout_ms = call.timeout_ms or route.timeout_ms or self.config.server.default_timeout_ms
            deadline = self.clock.now() + timeout_ms / 1000.0
            params = call.params
            if route.params and isinstance(params, dict | None):
                params = {**route.params, **(params or {})}
            item = Item(
                route=resolved.name, operation=route.operation, method=resolved.upstream_method,
                params=params, priority=call.priority or route.priority, deadline=deadline,
                identity=call.identity, notification=call.notification,
                options={**route.extra, "mode": route.mode, **call.extra_meta},
            )
            provider = self.providers[route.provider]
            provider.prepare(route, item)
            lane = self._lane_for(resolved.name, route)
            key = self._dedup_key(call, route, item, provider)
            if key is not None:
                item.options["idempotent"] = True
            if key is None:
                return await self._wait(lane, lane.submit(item), deadline)
            cached = self.cache.get(key)
            if cached is not None:
                self.metrics.dedup_hits.labels(resolved.name, "cache").inc()
                return cached
            pending = self.inflight.join(key)
            if pending is not None:
                self.metrics.dedup_hits.labels(resolved.name, "inflight").inc()
            else:
                pending = lane.submit(item)
                self.inflight.register(key, pending)
            try:
                outcome = await self._wait(lane, pending, deadline)
            finally:
                self.inflight.release(key, pending)
            if outcome.ok and route.cache_ttl_s and pending.future.done():
                self.cache.put(key, outcome, route.cache_ttl_s)
            return outcome

    def _dedup_key(
        self, call: Call, route: RouteConfig, item: Item, provider: Provider
    ) -> Hashable | None:
        allowed = route.dedup if route.dedup is not None else (
            call.idempotency_key is not None or provider.dedup_safe(item)
        )
        if not allowed or call.notification:
            return None
        scope = None if route.dedup_scope == "global" else call.identity
        body = call.idempotency_key if call.idempotency_key is not None else canonical(item.params)
        return (item.route, item.method, scope, body)

    async def _wait(self, lane: Lane, pending: Pending, deadline: float) -> Outcome:
        try:
            fired = await self.clock.wait_event(
                pending.future.event, None if deadline == math.inf else deadline
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                lane.withdraw(pending, Outcome.fail(cancelled("caller went away")))
            raise
        if fired:
            return pending.future.outcome()
        outcome = Outcome.fail(timeout_error(pending.state))
        lane.withdraw(pending, outcome)
        return outcome

    # -- discovery -------------------------------------------------------------
    async def list_tools(self) -> list[ToolSpec]:
        """Every route as a tool: exact routes from config, wildcard routes from their provider."""
        tools: list[ToolSpec] = [spec for _, spec in self.methods.values()]
        for name, route in self.config.routes.items():
            if name.endswith("*"):
                prefix = name[:-1]
                for spec in await self.providers[route.provider].list_tools():
                    tools.append(ToolSpec(prefix + spec.name, spec.description,
                                          spec.input_schema, spec.annotations, spec.meta))
            else:
                tools.append(ToolSpec(
                    name,
                    route.description or f"{route.operation} via {route.provider}",
                    route.input_schema or {"type": "object", "additionalProperties": True},
                ))
        return tools
