"""Admission's first stage: a call's ``Plan``, decided from the config alone.

``Gateway.submit_many`` admits in three stages: ``admit(call) -> Plan`` (here: route,
operation, item, dedup key, what the call claims of its key's quota; no state read,
nothing changed), ``decide`` (the one place that consults quotas, local or shared, one
``Grant`` per plan) and ``enqueue(plan, grant)``, the only step with effects. The jobs
face builds its items with ``route_item`` too, so a batch job's call is the call a
live one would be.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from multiplexer.core.call import Call, Item
from multiplexer.core.errors import RpcError
from multiplexer.core.policy import RouteConfig
from multiplexer.core.quota import Claim
from multiplexer.core.router import Resolved
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
