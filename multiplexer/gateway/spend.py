"""Composing the money side (``spend:``, ``budgets:``, ``price:``) into a gateway, and the budget
decision of admission's second stage. Kept out of ``gateway.py``: with ``spend.enabled: false``
none of it runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError
from multiplexer.core.metrics import Metrics
from multiplexer.core.quota import Grant, Quotas
from multiplexer.core.state import SharedState
from multiplexer.gateway.admission import Plan
from multiplexer.gateway.config import Config
from multiplexer.money import stored_counters as stored
from multiplexer.money.budgets import Reservation, Scope, budgets_of_config, team_of_config
from multiplexer.money.ledger import Money
from multiplexer.money.prices import Prices


class _Lookup:
    """A directory's lookup with the ``get`` that the config's dicts have."""

    def __init__(self, find: Any) -> None:
        self.get = find


def money_for(config: Config, clock: Clock, metrics: Metrics, state: SharedState | None,
              directory: Any = None) -> Money | None:
    """``directory``: the keys (``access.directory.KeyDirectory``: the YAML's and the store's);
    without one, the config's keys alone."""
    if not config.spend.enabled:
        return None
    keys: Any = config.server.api_keys
    teams: Any = config.server.teams
    if directory is not None:  # stored keys too: looked up as the config's are
        keys, teams = _Lookup(directory.entry), _Lookup(directory.team)
    known: dict[str | None, list[Scope]] = {}
    seen = [getattr(directory, "version", 0)]

    def budgets_of(identity: str | None) -> list[Scope]:
        """The budgets a caller answers to: its key's and its team's, stored or configured."""
        version = getattr(directory, "version", 0)
        if version != seen[0] or len(known) >= 100_000:  # the store changed: look again
            known.clear()
            seen[0] = version
        found = known.get(identity)
        if found is None:
            found = known[identity] = budgets_of_config(identity, keys, teams)
        return found

    def team_of(identity: str | None) -> str | None:
        return team_of_config(identity, keys)

    opened = stored.budget_store_for(config.store.path, config.store.url, config.store.schema_)
    counters: Any
    make = getattr(state, "budget_counters", None)
    if make is not None:
        counters = make()  # one Redis script: every replica decides on the same counters
    elif config.server.worker_count() > 1 or config.store.url:
        counters = stored.StoreCounters(clock.wall, opened)  # workers or replicas: one count, in the store
    else:
        counters = stored.WriteBehindCounters(clock.wall, opened)  # decided here, kept in the store
    money = Money(config.spend, config.budgets, Prices(config.providers, config.routes), clock, metrics,
                  budgets_of=budgets_of, team_of=team_of, store_path=config.store.path,
                  store_url=config.store.url, store_schema=config.store.schema_, counters=counters,
                  fail_open=config.state.on_failure == "open")
    if make is not None:  # a counter Redis lost starts again from the spend the store recorded
        counters.seed = stored.seed_from_spend(money.open_store)
    return money


async def reserve_budgets(money: Money, quotas: Quotas, plans: Sequence[Plan],
                          grants: Sequence[Grant]) -> None:
    """Admission's budget decision, after the quotas': each admitted plan that a budget covers
    reserves the most it can cost, or is refused (``plan.error``, its quota charge given back)
    before anything is sent."""
    budgets = money.budgets
    todo, scopes = [], []
    for i, p in enumerate(plans):
        if p.error is not None or p.item is None or grants[i].refusal is not None or \
                p.cached is not None:  # a semantic cache hit costs nothing: nothing to reserve
            continue
        found = budgets.budgets_of(p.call.identity)
        if not found:
            continue
        if p.call.budget is not None:  # a batch's line: its part of what the batch reserved
            p.reservation = budgets.draw(p.call.budget, budgets.most(p))
            continue
        if budgets.local:  # counters in this process: decided here, in order, with no await
            _decided(quotas, p, grants[i], budgets.reserve_here(p, found))
        else:
            todo.append(i)
            scopes.append(found)
    if not todo:
        return
    decided = await budgets.reserve([plans[i] for i in todo], scopes)
    for i, d in zip(todo, decided, strict=True):
        _decided(quotas, plans[i], grants[i], d)


def _decided(quotas: Quotas, plan: Plan, grant: Grant, d: Reservation | RpcError | None) -> None:
    if isinstance(d, Reservation):
        plan.reservation = d
    elif d is not None:
        plan.error = d
        quotas.refund(grant)


def shared_how(ticket_shared: str | None, outcome: Any) -> str | None:
    """How a caller shared another's execution: joined here, or an answer another replica ran."""
    if ticket_shared is not None:
        return ticket_shared
    return getattr(outcome, "shared", None)
