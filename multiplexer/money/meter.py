"""Each answered call's cost and saving, from the usage its provider returned.

The gateway calls ``Meter.bill`` once per answered call. It reads the provider's ``usage``
(never building a result the provider left unbuilt), prices it, sets the caller's
``Outcome.cost`` and ``Outcome.saved``, counts it in ``/metrics`` and appends one small tuple
for the spend writer: nothing here waits, locks or touches the database.

What a call saved is measured against the same call sent alone and synchronously with no
prompt cache: the batch discount, a prompt-cache read's discount, and for a call that shared
another's execution (joined in flight, or answered from the cache) the whole cost.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from multiplexer.core.call import Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.metrics import Metrics
from multiplexer.money.prices import Prices, tokens_of, usd_of

# What a call's saving came from (the ledger's and /metrics' ``how``): a fixed set.
SYNC, BATCH, INFLIGHT, CACHE = "sync", "batch", "dedup", "cache"
MAX_PENDING = 1_000_000  # records waiting for the writer; beyond this they are counted as dropped


# (wall time, key, route, provider, model, cost or None, saved, how, prompt-cache saved,
#  upstream requests saved: 1 for a shared call, a packed call's part of those its batch saved);
# amounts in integer pico-dollars
Record = tuple[float, str | None, str, str, str, int | None, int, str, int, float]


class MoneyMetrics:
    """The spend counters, on the gateway's registry; label values are routes and providers from
    the config and the fixed ``how`` set, never a client's string."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.spend = Counter("multiplexer_spend_usd", "Cost of answered calls in US dollars",
                             ["provider", "route"], registry=r)
        self.saved = Counter("multiplexer_saved_usd", "What the gateway saved on answered calls, by"
                             " what saved it (batch, dedup, cache, prompt_cache)", ["route", "how"],
                             registry=r)
        self.unknown = Counter("multiplexer_unknown_cost_calls", "Answered calls on a model nobody"
                               " prices (cost unknown, never counted as 0)", ["route"], registry=r)
        self.budget_refused = Counter("multiplexer_budget_refusals", "Calls refused by a budget",
                                      ["scope", "period"], registry=r)
        self.budget_alerts = Counter("multiplexer_budget_alerts", "Budgets that crossed their "
                                     "alert_at share (once per period)", ["scope", "period"], registry=r)
        self.dropped = Counter("multiplexer_spend_records_dropped", "Spend records dropped because "
                               "the writer fell behind", registry=r)
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, counter: Counter, *labels: str) -> Any:
        key = (counter._name, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = counter.labels(*labels)
        return found


class Meter:
    def __init__(self, prices: Prices, clock: Clock, metrics: MoneyMetrics) -> None:
        self.prices = prices
        self.clock = clock
        self.metrics = metrics
        self.records: list[Record] = []

    def bill(self, plan: Any, outcome: Outcome, answer: Outcome, shared: str | None) -> Outcome:
        """The caller's answer with its cost and saving (a copy where the provider's outcome is
        shared with other callers); answers of calls that are not priced come back as they are.

        ``plan``: the call's admission ``Plan``; ``outcome``: the provider's; ``shared``: how this
        caller shared another's execution (``dedup``, ``cache``) or None. Integer pico-dollars
        throughout; ``Decimal`` only for what the caller reads."""
        item, route = plan.item, plan.route
        if item is None or route is None:
            return answer
        params = item.params
        model = params.get("model") if isinstance(params, dict) else None
        model = model if isinstance(model, str) else None
        rates = self.prices.rates(plan.label, route.provider, model)
        cost: int | None
        saved = cache_saved = 0
        how = shared or SYNC
        if rates is None:
            if model is None:
                return answer  # no model and no price: not a metered call (a tool, a JSON-RPC method)
            cost = None
        else:
            result = outcome.built()
            tokens = tokens_of(result.get("usage")) if type(result) is dict else None
            if tokens is None:
                cost = None if rates.priced_tokens else rates.p_call
                alone = cost or 0
            else:
                cost = rates.pico(tokens)
                alone = rates.pico_uncached(tokens)
                cache_saved = alone - cost
            if cost is not None:
                if shared is not None:
                    cost, saved, cache_saved = 0, alone, 0
                elif item.options.get("mode") == "batch":
                    how = BATCH
                    num, den = self.prices.batch_kept(plan.label, route.provider)
                    cost = cost * num // den
                    saved = alone - cost
                else:
                    saved = cache_saved
        if answer is outcome:  # the provider's outcome may be every sharer's: this caller's own
            answer = outcome.copy()
        if cost is not None:
            answer.cost = usd_of(cost)
            if saved:
                answer.saved = usd_of(saved)
        m = self.metrics
        if cost is None:
            m.child(m.unknown, plan.label).inc()
        else:
            if cost:
                m.child(m.spend, route.provider, plan.label).inc(cost / 1e12)
            if saved:
                m.child(m.saved, plan.label, how if how != SYNC else "prompt_cache").inc(saved / 1e12)
        if shared is not None:
            requests_saved = 1.0
        else:
            share = item.options.get("upstream_share")
            requests_saved = 1.0 - share if isinstance(share, float) else 0.0
        if len(self.records) < MAX_PENDING:
            self.records.append((self.clock.wall(), item.identity, plan.label, route.provider,
                                 model or "", cost, saved, how, cache_saved, requests_saved))
        else:
            m.dropped.inc()
        return answer

    def take(self) -> list[Record]:
        """The records since the last take (the writer's batch)."""
        records, self.records = self.records, []
        return records
