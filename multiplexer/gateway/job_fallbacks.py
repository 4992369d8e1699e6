"""A batch job's items whose remote batch failed whole, resubmitted once to their fallback route.

A job's item carries, from its submission, the routes it may go to (``core/jobs.FALLBACK_ROUTES``:
its route's fallbacks, or its group's other routes and fallbacks). When a part's remote batch fails
as a whole (failed, expired, cancelled by the vendor, its submission refused), the part's driver
calls ``JobFallbacks`` before failing what is left: each unfinished item goes to the first of its
routes that takes it now (a provider that runs batch jobs, breaker not open), made as that route
makes items, with no fallback routes left (so once only). The move is one store transaction, and
the new provider's manager plans the items: now, or on its resume after a restart. A route with
``mode: batch`` (or ``auto``) sends them to its batch API, any other to its live endpoint, a
request at a time under its limits. Items that succeeded, or failed on their own line, stay.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from multiplexer.core.call import Item
from multiplexer.core.jobrows import ItemRow, NewItem, PartRow
from multiplexer.core.jobs import FALLBACK_ROUTES, FELL_BACK, LIVE, BatchJobs, JobStore
from multiplexer.core.provider import BatchCapable
from multiplexer.core.router import Resolved
from multiplexer.gateway.admission import own_model, route_item


class JobFallbacks:
    """The gateway's ``core/jobs.JobFallback``: handed to every provider in its context."""

    def __init__(self, gateway: Any) -> None:
        """``gateway``: the ``Gateway`` (its routes, providers, breakers and metrics)."""
        self.gw = gateway

    def taker(self, chain: list[Any]) -> tuple[str, BatchJobs] | None:
        """The first route of ``chain`` that takes job items now, and its provider's job manager:
        one whose provider runs batch jobs, its breaker not open."""
        for name in chain:
            route = self.gw.config.routes.get(name) if isinstance(name, str) else None
            if route is None:
                continue
            provider = self.gw.providers.get(route.provider)
            if isinstance(provider, BatchCapable) and self.gw.fallbacks.may_try(name):
                return name, provider.jobs
        return None

    async def __call__(self, store: JobStore, part: PartRow) -> int:
        rows: list[ItemRow] = await store.run(store.part_items, part.id, True)
        job = await store.run(store.job, part.job_id)
        if job is None:
            return 0
        moves: list[NewItem] = []
        targets: dict[int, BatchJobs] = {}
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for row in rows:
            options = json.loads(row.options or "{}")
            chain = options.get(FALLBACK_ROUTES)
            if not isinstance(chain, list):
                continue
            taker = self.taker(chain)
            if taker is None:
                continue
            name, manager = taker
            moves.append(manager.new_item(part.job_id, row.idx, self._item(row, name, job.identity)))
            targets[id(manager)] = manager
            counts[(row.route or "", name)] += 1
        if not moves:
            return 0
        moved = await store.run(store.reroute, part.id, part.job_id, moves)
        for (came_from, name), n in counts.items():
            self.gw.metrics.fallbacks.labels(came_from, name, "batch_failed").inc(n)
        for manager in targets.values():
            await manager.plan(part.job_id)
        return moved

    def _item(self, row: ItemRow, name: str, identity: str | None) -> Item:
        """The stored item as route ``name`` makes it: its own model, params, options and mode."""
        route = self.gw.config.routes[name]
        params = json.loads(row.params or "null")
        origin = self.gw.config.routes.get(row.route or "")
        if isinstance(params, dict) and origin is not None:
            # a value the first route put in (not the caller) gives way to this route's own
            params = {k: v for k, v in params.items()
                      if not (k in route.params and k in origin.params and origin.params[k] == v)}
        params = own_model(route, params)
        item = route_item(Resolved(name, route, route.method or name), params, identity=identity,
                          operation=row.operation)
        item.options[FELL_BACK] = row.route
        if route.mode not in ("batch", "auto"):
            item.options[LIVE] = True
        item.tokens = row.tokens
        self.gw.providers[route.provider].prepare(route, item)
        return item
