"""The attempt loop: a call that fails in a way another route may not moves to the next route.

Routing above routes. A plan names an ordered list of routes (a route's ``fallbacks``, a model
group's routes in its strategy's order); each attempt is a call on one lane with its own limits,
dedup and batching. The loop runs on the caller's ticket, with no task of its own: when an
attempt's outcome arrives, ``settle`` either starts the next attempt on the same ticket or
lets the gateway answer the call (exactly once, under its own id).

- Fallback on 429 (after the route's own retries), 5xx, connection failures, timeouts,
  malformed replies, a full queue and an open breaker (``on:`` narrows or widens the set);
  a context-length refusal goes to ``context_window_fallbacks`` only; a caller's own error
  never falls back.
- One budget per call (``max_attempts``) counts upstream requests over all routes, retries
  included (``core/attempts.py``).
- A stream falls back only while nothing has reached its client (``ChunkSink.started``).
- Circuit breakers (``core/breaker.py``) per provider: an open one sends the call straight on.
- Cache affinity (``gateway/affinity.py``): a group's calls that share a prompt-cache key keep
  to their rendezvous pick while it is healthy and not saturated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from multiplexer.core.asking import carry
from multiplexer.core.attempts import BUDGET, Budget
from multiplexer.core.breaker import Breakers, SharesBreakers, State
from multiplexer.core.cache_affinity import AFFINITY_KEY, CACHE_MOVED
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.errors import Code, RpcError, upstream_unavailable
from multiplexer.core.failures import UNWELL, matches, reason_of
from multiplexer.core.logs import LogFanout
from multiplexer.core.policy import DEFAULT_FALLBACK_ON, GroupConfig, RouteConfig
from multiplexer.core.provider import STREAM, Streamer
from multiplexer.core.router import Resolved
from multiplexer.core.sink import ChunkSink
from multiplexer.core.tracing import TraceSlot
from multiplexer.gateway.admission import Plan, own_model, route_item, tagged
from multiplexer.gateway.affinity import affinities, moves_tally, saturated
from multiplexer.gateway.chains import context_fallbacks, expand, plain_fallbacks
from multiplexer.gateway.tickets import Ticket

log = logging.getLogger(__name__)

_STATE_VALUE = {"closed": 0, "open": 1, "half_open": 2}
# what a ``mode: batch`` call may fall back on: refusals before a batch job accepted it, and its
# remote batch failing whole (once per call: never a second resubmission)
AT_SUBMISSION = ("overloaded", "breaker_open", "batch_failed")


class Attempts:
    """One call's walk over its routes."""

    __slots__ = ("budget", "call", "context", "group", "home", "mark", "number", "on", "queue",
                 "route", "sink", "span", "trace", "tried", "why")

    def __init__(self, call: Call, route: str, queue: list[str], context: list[str],
                 on: tuple[str | int, ...], budget: Budget | None, span: Any,
                 sink: ChunkSink | None) -> None:
        self.call = call
        self.route = route  # the route of the attempt under way
        self.queue = queue  # routes still to try on a fallback reason
        self.context = context  # ... and on a context-length refusal
        self.on = on
        self.budget = budget  # None: no cap beyond each route's retry policy
        self.span = span
        self.sink = sink  # a streamed call's sink, shared by its attempts
        self.tried: list[tuple[str, str]] = []  # (route, why it moved on)
        self.mark = 0  # the budget's requests spent when the attempt under way began
        self.number = 0  # attempts begun
        self.trace: Any = None  # the attempt's span, when calls are traced
        self.why = ""  # why the last lane refused an attempt (``Fallbacks._queue``)
        self.group = ""  # the model group the caller named ("" none)
        self.home: str | None = None  # the affinity pick the call went to, until it moves on


def breaker_policies(config: Any) -> dict[str, Any]:
    """Each provider's breaker policy; a provider with base_urls has a breaker per endpoint
    instead (providers/endpoints.py)."""
    return {name: p.breaker for name, p in config.providers.items()
            if p.breaker is not None and not p.extra.get("base_urls")}


class Fallbacks:
    """The gateway's fallbacks, model groups and breakers."""

    def __init__(self, gateway: Any) -> None:
        """``gateway``: the ``Gateway`` that owns this (its lanes, providers, metrics, ``_finish``)."""
        self.gw = gateway
        config = gateway.config
        self.metrics = gateway.metrics
        policies = breaker_policies(config)
        state = gateway.state
        store = state.breaker_store() if isinstance(state, SharesBreakers) and policies else None
        self.breakers = Breakers(policies, gateway.clock, store, self._breaker_changed)
        for name in policies:
            self.metrics.breaker_state.labels(name).set(0)
        self.busy: dict[str, int] = {}  # attempts in flight per route (least_busy)
        self.latency: dict[str, float] = {}  # recent seconds per route (latency)
        self._started: dict[int, float] = {}
        self.read_config(config, policies)
        self.cache_moves = moves_tally(self.metrics)
        # pick to attempts, within one admission: (call, its routes in order, why it left home,
        # its affinity key, which the route's base_urls reuse: providers/endpoints.py)
        self._ranked: tuple[Call, list[str], str | None, int | None] | None = None

    def read_config(self, config: Any, policies: dict[str, Any]) -> None:
        """What the fallbacks read of the config: at start, and again by a reload (breakers'
        states, busy counts and latencies carry on)."""
        self.routes = config.routes
        self.groups: dict[str, GroupConfig] = dict(config.groups)
        # routes whose calls walk: fallbacks, an explicit max_attempts, or a provider with a breaker
        self.watched = {name for name, r in self.routes.items()
                        if r.fallbacks or r.context_window_fallbacks or "max_attempts" in r.model_fields_set
                        or r.provider in policies}
        self.affinity = affinities(self.groups, self.routes)

    @property
    def shared(self) -> bool:
        return self.breakers.store is not None

    def _breaker_changed(self, name: str, state: State) -> None:
        self.metrics.breaker_state.labels(name).set(_STATE_VALUE[state])
        self.gw.notify("breaker", {"endpoint": name, "state": state})

    # -- admission ---------------------------------------------------------------
    def order(self, group: GroupConfig, ranked: list[str] | None = None) -> list[str]:
        """A group's routes in the order its strategy tries them; open breakers last.
        ``ranked``: a call's affinity ranking instead, saturated members after the others."""
        names = list(group.routes)
        if ranked is not None:
            full = saturated(names, self.busy)
            names = [n for n in ranked if n not in full] + [n for n in ranked if n in full]
        elif group.strategy == "weighted":
            names = _weighted_order(names, group.weights)
        elif group.strategy == "latency":
            names.sort(key=lambda n: self.latency.get(n, 0.0))
        else:  # least_busy; ties keep the config's order
            names.sort(key=lambda n: self.busy.get(n, 0))
        open_last = [n for n in names if not self.may_try(n)]
        return [n for n in names if n not in open_last] + open_last

    def may_try(self, name: str) -> bool:
        """Whether route ``name``'s breaker lets a call try it (it is not open)."""
        breaker = self.breakers.get(self.routes[name].provider)
        return breaker is None or breaker.state != "open"

    def pick(self, resolved: Resolved, call: Call | None = None) -> Resolved:
        """The route a call to a model group tries first: the first in its strategy's order that
        the caller may use with that route's own model (``call``: None, any)."""
        assert resolved.group is not None
        group = self.groups[resolved.group]
        affinity = self.affinity.get(resolved.group) if call is not None else None
        key = affinity.key(call.params, call.session) if affinity is not None and call is not None else None
        ranked = affinity.ranking(key) if affinity is not None and key is not None else None
        order = self.order(group, ranked)
        first = order[0]
        if call is not None and call.identity is not None:
            refusal = None
            for name in order:
                refusal = self.refusal(call, name, self.routes[name])
                if refusal is None:
                    first = name
                    break
            if refusal is not None:
                raise refusal
        if ranked is not None and call is not None:
            why = None if first == ranked[0] else self._why_not(ranked[0], group)
            self._ranked = (call, order, why, key)
        route = self.routes[first]
        return Resolved(first, route, route.method or first, resolved.group)

    def _why_not(self, home: str, group: GroupConfig) -> str:
        """Why a call did not go to its affinity pick."""
        if not self.may_try(home):
            return "breaker_open"
        return "overloaded" if home in saturated(group.routes, self.busy) else "forbidden"

    def _affinity_of(self, call: Call, group: str, name: str, item: Item
                     ) -> tuple[list[str] | None, str | None]:
        """The order ``pick`` made for this call by its affinity, and its home (None: it has none,
        or it went elsewhere already, counted here: only a call admitted counts, never a price);
        the key goes on ``item`` for its route's ``base_urls``."""
        held, self._ranked = self._ranked, None
        if held is None or held[0] is not call:
            return None, None
        _, order, why, key = held
        if key is not None:
            item.options[AFFINITY_KEY] = key
        if why is None:
            return order, name
        self.cache_moves.add((group, why))
        item.options[CACHE_MOVED] = True  # booked as a move, with what it cost (money/meter.py)
        return order, None

    def _left_home(self, t: Ticket, att: Attempts, reason: str) -> None:
        """The call's attempt on its affinity pick failed and another route took it: counted once
        (and booked as a move on the attempt's item, which the call is priced as)."""
        if att.home is not None:  # set only while the call's attempts were all on it
            why = reason if reason in ("breaker_open", "overloaded") else "fallback"
            self.cache_moves.add((att.group, why))
            if t.plan is not None and t.plan.item is not None:
                t.plan.item.options[CACHE_MOVED] = True
        att.home = None

    def refusal(self, call: Call, name: str, route: RouteConfig) -> RpcError | None:
        """Why the caller may not be served by route ``name`` (the params it would get there: its
        own model, ``own_model``); None when it may. A member of the group the caller named passes
        the route globs by that name (which admission checked); a fallback outside it by its own."""
        if call.identity is None:
            return None
        group = self.groups.get(call.method)
        called = call.method if group is not None and name in group.routes else name
        return self.gw.attempt_refusal(call.identity, called, own_model(route, call.params), call.face)

    def for_job(self, resolved: Resolved, takes: Callable[[str], bool]) -> tuple[Resolved, list[str]]:
        """A batch job's item: its route (for a group, the first in its strategy's order that
        ``takes`` job items, as a live call's pick) and the routes it may be resubmitted to, once,
        when its remote batch fails whole (empty: none, by ``on`` or ``max_attempts: 1``)."""
        group = self.groups.get(resolved.group) if resolved.group is not None else None
        if group is not None:
            order = self.order(group)
            name = next((n for n in order if takes(n)), order[0])
            route = self.routes[name]
            resolved = Resolved(name, route, route.method or name, resolved.group)
            queue = [*(n for n in order if n != name), *group.fallbacks]
            on, max_attempts = group.on, group.max_attempts
        else:
            name, route = resolved.name, resolved.route
            queue = list(route.fallbacks)
            on, max_attempts = route.on, route.max_attempts
        if max_attempts < 2 or "batch_failed" not in (on if on is not None else DEFAULT_FALLBACK_ON):
            return resolved, []
        return resolved, expand(queue, self.routes, plain_fallbacks, {name})

    def attempts(self, plan: Plan, resolved: Resolved) -> Attempts | None:
        """The walk of a call whose route falls back, is a group's, or has a breaker; it also
        gives a group's pick its own model. None: the call is a plain one."""
        group = self.groups.get(resolved.group) if resolved.group is not None else None
        if group is None and resolved.name not in self.watched:
            return None
        call, item = plan.call, plan.item
        assert item is not None
        name = resolved.name
        home = None
        if group is not None:
            assert resolved.group is not None
            order, home = self._affinity_of(call, resolved.group, name, item)
            item.params = own_model(resolved.route, item.params)
            rest = [n for n in (order or self.order(group)) if n != name]
            queue = expand([*rest, *group.fallbacks], self.routes, plain_fallbacks, {name})
            context = expand(group.context_window_fallbacks, self.routes, context_fallbacks, {name})
            on, max_attempts = group.on, group.max_attempts
        else:
            route = resolved.route
            queue = expand(route.fallbacks, self.routes, plain_fallbacks, {name})
            context = expand(route.context_window_fallbacks, self.routes, context_fallbacks, {name})
            on, max_attempts = route.on, route.max_attempts
        capped = bool(queue or context) or (
            group is None and "max_attempts" in resolved.route.model_fields_set)
        budget = None
        if capped:
            budget = Budget(max_attempts)
            budget.reserve = min(len(queue), max_attempts - 1)
            item.options[BUDGET] = budget
        call.route = name
        reasons = tuple(on if on is not None else DEFAULT_FALLBACK_ON)
        if resolved.route.mode == "batch":  # a batch job's call falls back only at submission, or
            reasons = tuple(r for r in reasons if r in AT_SUBMISSION  # once when its batch failed
                            and (r != "batch_failed" or max_attempts > 1))
            context = []
            if budget is not None:
                item.options.pop(BUDGET, None)
                budget = None
        sink = item.options.get(STREAM)
        if not isinstance(sink, ChunkSink):
            sink = None
        elif queue or context:
            sink.hold = True
        att = Attempts(call, name, queue, context, reasons, budget, plan.span, sink)
        if home is not None:
            att.group, att.home = resolved.group or "", home
        return att

    def may_run(self, t: Ticket, plan: Plan) -> bool:
        """Before the first attempt is queued: False when its breaker is open (the call then
        went on to its next route, or failed fast)."""
        att = t.attempts
        assert att is not None and plan.route is not None
        breaker = self.breakers.get(plan.route.provider)
        if breaker is not None and not breaker.allow():
            error = self._open_error(plan.route.provider, breaker.retry_after())
            self.metrics.attempts.labels(att.route, "breaker_open").inc()
            if "breaker_open" not in att.on or not self._next(t, att, error, "breaker_open",
                                                               opened=[att.route]):
                self._final(att)
                t.attempts = None  # answered as it is: no attempt of it ran
                self.gw._finish(t, Outcome.fail(error))
            return False
        self._began(att.route, t)
        return True

    @staticmethod
    def _open_error(provider: str, retry_after: float) -> RpcError:
        error = upstream_unavailable(provider, f"circuit breaker open for {provider}; "
                                               f"no call goes there for {retry_after:.1f} s")
        assert error.data is not None
        error.data.update(breaker="open", retry_after=round(max(retry_after, 0.001), 3))
        return error

    def _began(self, name: str, t: Ticket) -> None:
        att = t.attempts
        assert att is not None
        att.number += 1
        if att.budget is not None:
            att.mark = att.budget.spent
        if att.span is not None:
            att.trace = self.gw.tracer.attempt(att.span, name, att.number)
        self.busy[name] = self.busy.get(name, 0) + 1
        self._started[id(t)] = self.gw.clock.now()

    # -- the loop ----------------------------------------------------------------
    def settle(self, t: Ticket, outcome: Outcome, withdraw: bool) -> bool:
        """An attempt ended: True when the next one is under way (the call is not answered)."""
        att = t.attempts
        assert att is not None
        name = att.route
        route = self.routes[name]
        self.busy[name] = max(self.busy.get(name, 1) - 1, 0)
        started = self._started.pop(id(t), None)
        error = outcome.error
        reason = reason_of(error) if error is not None else None
        if error is None and started is not None:
            seconds = self.gw.clock.now() - started
            self.latency[name] = seconds if name not in self.latency else \
                self.latency[name] + 0.2 * (seconds - self.latency[name])
        breaker = self.breakers.get(route.provider)
        if breaker is None or route.mode == "batch":
            pass  # no breaker, or a batch job's result: it says nothing of the endpoint's health now
        elif error is None:
            self.breakers.record(route.provider, False)
        elif withdraw or (reason in (None, "overloaded", "breaker_open")
                          and error.code != Code.UPSTREAM_ERROR):
            breaker.release()  # no verdict on the endpoint (a cancel, a deadline, our own queue)
        else:
            self.breakers.record(route.provider, reason in UNWELL)
        result = "ok" if error is None else "withdrawn" if withdraw else reason or "client_error"
        self.metrics.attempts.labels(name, result).inc()
        if att.trace is not None:
            self.gw.tracer.end_attempt(att.trace, result, outcome)
            att.trace = None
        if error is None or withdraw or not self._may_move(t, att, error, reason):
            self._final(att)
            return False
        if att.budget is not None and att.budget.spent == att.mark and reason != "overloaded":
            att.budget.spend()  # a provider without a retry loop: the attempt was one request
        self._leave(t)
        if self._next(t, att, error, reason or "status"):
            return True
        self._final(att)
        return False

    def _may_move(self, t: Ticket, att: Attempts, error: RpcError, reason: str | None) -> bool:
        if self.gw.clock.now() >= t.deadline:
            return False
        if att.budget is not None and att.budget.left <= 0:
            return False
        if att.sink is not None and att.sink.started:
            return False  # the client has bytes of this answer: never another provider's
        if reason == "context_window":
            return bool(att.context)
        if reason == "batch_failed" and any(why == "batch_failed" for _, why in att.tried):
            return False  # a call's failed batch is resubmitted once
        return bool(att.queue) and matches(error, reason, att.on)

    def _leave(self, t: Ticket) -> None:
        """Let go of what the failed attempt held: its shared flight, its fanouts."""
        gw = self.gw
        if t.key is not None and t.pending is not None:
            gw.flights.release(t.key, t.pending)
        t.key = t.cache_ttl = None
        t.leave_fanouts()

    def _next(self, t: Ticket, att: Attempts, error: RpcError, reason: str,
              opened: list[str] | None = None) -> bool:
        """Queue the next route that may run; False when none is left.

        ``opened``: routes this walk passed over for an open breaker. When nothing else is left,
        the first of them takes the call anyway, once: breakers keep calls off a failing
        endpoint while another can serve, and with none left a refusal would be an error some
        provider might not have made (as a load balancer's panic mode sends to unhealthy hosts
        when too few are healthy). A route alone, with no fallback, still fails fast."""
        queue = att.context if reason == "context_window" else att.queue
        opened = list(opened or ())
        came_from, first_reason = att.route, reason
        while queue:
            name = queue.pop(0)
            route = self.routes.get(name)
            if route is None or route.provider not in self.gw.providers:  # gone in a config reload
                continue
            if att.budget is not None:
                att.budget.reserve = min(len(att.queue), max(att.budget.left - 1, 0))
            provider = self.gw.providers[route.provider]
            if att.sink is not None and not isinstance(provider, Streamer):
                continue
            self.metrics.fallbacks.labels(came_from, name, reason).inc()
            att.tried.append((came_from, reason))
            breaker = self.breakers.get(route.provider)
            if breaker is not None and not breaker.allow():
                self.metrics.attempts.labels(name, "breaker_open").inc()
                if "breaker_open" not in att.on:
                    return False
                opened.append(name)
                came_from, reason = name, "breaker_open"
                continue
            if self._queue(t, att, name, route):
                self._left_home(t, att, first_reason)
                return True
            came_from, reason = name, att.why
        if opened and (att.number > 0 or len(opened) >= 2):  # only open routes were left
            for name in opened:
                self.metrics.attempts.labels(name, "all_open").inc()
                if self._queue(t, att, name, self.routes[name]):
                    self._left_home(t, att, first_reason)
                    return True
        return False

    def _queue(self, t: Ticket, att: Attempts, name: str, route: RouteConfig) -> bool:
        """The attempt on ``name`` queued on its lane; False when the caller may not use it (its
        access, its budget at the attempt's own price) or the lane refused it (why in ``att.why``).
        An attempt is admitted as the call itself was: re-checked, re-priced, re-reserved."""
        refusal = self.refusal(att.call, name, route)
        if refusal is not None:
            self.metrics.attempts.labels(name, "forbidden").inc()
            att.why = "forbidden"
            return False
        item = self._item(t, att, name, route)
        plan = t.plan
        if plan is not None:  # money is on: the attempt is priced and reserved as itself
            earlier = plan.label, plan.route, plan.item
            plan.label, plan.route, plan.item = name, route, item
            if self.gw.rebudget(plan) is not None:
                plan.label, plan.route, plan.item = earlier
                self.metrics.attempts.labels(name, "budget").inc()
                att.why = "budget"
                return False
        try:
            lane = self.gw._lane_for(name, route)
            pending = lane.submit(item)
        except RpcError as e:
            self.metrics.attempts.labels(name, reason_of(e) or "client_error").inc()
            att.why = reason_of(e) or "overloaded"
            return False
        att.route = att.call.route = name
        t.pending, t.lane = pending, lane
        self._began(name, t)
        if t.waiter is not None:  # settling: wake it when this attempt ends
            pending.future.add_done_callback(t)
        return True

    def _item(self, t: Ticket, att: Attempts, name: str, route: RouteConfig) -> Item:
        """The call's item on another route, as admission would have made it there."""
        call, gw = att.call, self.gw
        resolved = Resolved(name, route, route.method or name)
        item = route_item(resolved, own_model(route, call.params), identity=call.identity,
                          operation=call.operation, priority=call.priority, deadline=t.deadline,
                          notification=call.notification)
        if call.progress is not None:
            item.options["progress"] = call.progress
        if call.log is not None:
            item.options["log"] = LogFanout([call.log])
        if call.ask is not None:
            carry(item, call.ask)
        if att.budget is not None:
            item.options[BUDGET] = att.budget
        if att.span is not None:
            item.trace = TraceSlot(att.span)
            gw.tracer.routed(att.span, item, route.provider, gw.config.providers[route.provider].kind)
        provider = gw.providers[route.provider]
        if att.sink is not None:
            item.options[STREAM] = att.sink
        provider.prepare(route, item)
        if att.sink is not None:
            item.group = tagged(item.group, "stream")
        elif route.mode == "batch" and call.identity is not None:
            item.group = tagged(item.group, call.identity)
        return item

    @staticmethod
    def _final(att: Attempts) -> None:
        """The call is answered now: a stream held open for a fallback closes."""
        if att.sink is not None and att.sink.hold:
            att.sink.hold = False
            att.sink.close()


def _weighted_order(names: list[str], weights: dict[str, float]) -> list[str]:
    """Names drawn one by one at random by weight (default 1): the first is the pick."""
    left = list(names)
    out: list[str] = []
    while left:
        chosen = random.choices(left, [weights.get(n, 1.0) for n in left])[0]
        out.append(chosen)
        left.remove(chosen)
    return out

