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

from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from multiplexer.core.after import after
from multiplexer.core.cache_affinity import CACHE_MOVED
from multiplexer.core.call import Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.metrics import Metrics
from multiplexer.core.provider import STREAM
from multiplexer.core.sink import ChunkSink
from multiplexer.money.prices import UNBILLED, Prices, Tokens, out_budget, tokens_of, usage_of

# What a call's saving came from (the ledger's and /metrics' ``how``): a fixed set.
SYNC, BATCH, INFLIGHT, CACHE = "sync", "batch", "dedup", "cache"
SEMANTIC = "semantic_cache"  # answered by the semantic cache (multiplexer/cache/)
MAX_PENDING = 1_000_000  # records waiting for the writer; beyond this they are counted as dropped


# (wall time, key, route, provider, model, cost or None, saved, how, prompt-cache saved,
#  upstream requests saved: 1 for a shared call, a packed call's part of those its batch saved,
#  what its prompt-cache writes cost beyond plain input, whether it was a cache move (1: affinity
#  sent it off the route holding its prefix) and what the move cost at most (``Rates.pico_unread``),
#  input tokens and the prompt-cache reads among them, as the provider's usage said: 0 for a
#  call that sent none upstream or whose usage is unknown); amounts in integer pico-dollars
Record = tuple[float, str | None, str, str, str, int | None, int, str, int, float, int, int, int,
               int, int]


class MoneyMetrics:
    """The money counters, on the gateway's registry. Spend, savings and unknown-cost calls are
    plain sums the meter adds to (no lock, no label lookup per call), read by ``/metrics`` at
    scrape time; label values are routes and providers from the config and the fixed ``how``
    set, never a client's string."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.spend: dict[tuple[str, str], float] = {}  # (provider, route) -> USD
        self.saved: dict[tuple[str, str], float] = {}  # (route, how) -> USD
        self.unknown: dict[str, int] = {}  # route -> calls
        self.tokens: dict[str, list[int]] = {}  # route -> [input tokens, prompt-cache reads]
        r.register(_Sums(self))
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


class _Sums(Collector):
    def __init__(self, m: MoneyMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        spend = CounterMetricFamily("multiplexer_spend_usd", "Cost of answered calls in US dollars",
                                    labels=["provider", "route"])
        for labels, value in list(self.m.spend.items()):
            spend.add_metric(labels, value)
        saved = CounterMetricFamily("multiplexer_saved_usd", "What the gateway saved on answered calls,"
                                    " by what saved it (batch, dedup, cache, semantic_cache, prompt_cache)",
                                    labels=["route", "how"])
        for labels, value in list(self.m.saved.items()):
            saved.add_metric(labels, value)
        unknown = CounterMetricFamily("multiplexer_unknown_cost_calls", "Answered calls on a model "
                                      "nobody prices (cost unknown, never counted as 0)", labels=["route"])
        for route, n in list(self.m.unknown.items()):
            unknown.add_metric([route], n)
        sent = CounterMetricFamily("multiplexer_input_tokens", "Input tokens of answered calls, as "
                                   "their providers' usage said, by route", labels=["route"])
        read = CounterMetricFamily("multiplexer_cache_read_tokens", "The input tokens among them "
                                   "a provider read from its prompt cache, by route", labels=["route"])
        for route, (n, r) in list(self.m.tokens.items()):
            sent.add_metric([route], n)
            read.add_metric([route], r)
        return iter([spend, saved, unknown, sent, read])


class Meter:
    def __init__(self, prices: Prices, clock: Clock, metrics: MoneyMetrics) -> None:
        self.prices = prices
        self.clock = clock
        self.metrics = metrics
        self.records: list[Record] = []

    def bill(self, plan: Any, outcome: Outcome, answer: Outcome, shared: str | None) -> Outcome:
        return self.price(plan, outcome, answer, shared)[0]

    def price(self, plan: Any, outcome: Outcome, answer: Outcome,
              shared: str | None) -> tuple[Outcome, int | None]:
        """The caller's answer with its cost and saving (a copy where the provider's outcome is
        shared with other callers); answers of calls that are not priced come back as they are.

        ``plan``: the call's admission ``Plan``; ``outcome``: the provider's; ``shared``: how this
        caller shared another's execution (``dedup``, ``cache``) or None. Integer pico-dollars
        throughout; ``Decimal`` only for what the caller reads."""
        metered = self._metered(plan)
        if metered is None:
            return answer, None
        item, route, model, rates = metered
        cost: int | None
        saved = cache_saved = sent = read = writes = move_cost = 0
        moved = 1 if shared is None and item.options.get(CACHE_MOVED) else 0
        how = shared or SYNC
        result = outcome.built()
        tokens = tokens_of(usage_of(result)) if type(result) is dict else None
        if tokens is not None and shared is None:  # a shared call sent nothing upstream
            sent, read = tokens.input, tokens.cache_read
        if rates is None:
            cost = None
        else:
            if tokens is None:
                cost = None if rates.priced_tokens else rates.p_call
                alone = cost or 0
            else:
                cost = rates.pico(tokens)
                alone = rates.pico_uncached(tokens)
                cache_saved = alone - cost
                writes = rates.pico_writes(tokens)
                if moved:
                    move_cost = rates.pico_unread(tokens)
            if cost is not None:
                if shared is not None:
                    cost, saved, cache_saved = 0, alone, 0
                elif item.options.get("mode") == "batch":
                    how = BATCH
                    num, den = self.prices.batch_kept(plan.label, route.provider)
                    cost = cost * num // den
                    writes, move_cost = writes * num // den, move_cost * num // den
                    saved = alone - cost
                else:
                    saved = cache_saved
        if answer is outcome:  # the provider's outcome may be every sharer's: this caller's own
            answer = outcome.copy()
        answer.cost_pico, answer.saved_pico = cost, saved
        if shared is not None:
            requests_saved = 1.0
        else:
            share = item.options.get("upstream_share")
            requests_saved = 1.0 - share if isinstance(share, float) else 0.0
        if shared is not None:
            writes = 0
        after(self._book, (self.clock.wall(), item.identity, plan.label, route.provider, model or "",
                           cost, saved, how, cache_saved, requests_saved, writes, moved, move_cost,
                           sent, read))
        return answer, cost

    def _metered(self, plan: Any) -> tuple[Any, Any, str | None, Any] | None:
        """A call's (item, route, model, rates), or None when it is not metered: no routed item, an
        operation that bills nothing, or neither a model nor a price (a tool, a JSON-RPC method).
        Rates are None for a model nobody prices: its cost is unknown, never 0."""
        item, route = plan.item, plan.route
        if item is None or route is None or item.operation in UNBILLED:
            return None
        params = item.params
        model = params.get("model") if isinstance(params, dict) else None
        model = model if isinstance(model, str) else None
        rates = self.prices.rates(plan.label, route.provider, model)
        if rates is None and model is None:
            return None
        return item, route, model, rates

    def used(self, plan: Any, most: int | None) -> int | None:
        """What a call that went upstream and then failed used, booked like an answered call's
        cost: a stream's chunks handed over (one output token each) over its estimated input,
        else ``most`` (pico-dollars: what it could cost at most); None when its model has no
        price. Nothing is saved on it."""
        metered = self._metered(plan)
        if metered is None:
            return None
        item, route, model, rates = metered
        if rates is None:
            cost = None
        else:
            sink = item.options.get(STREAM)
            if isinstance(sink, ChunkSink):
                # the provider's estimate counts the reply's budget too (``Budgets.most``)
                given = out_budget(item.params) or 0
                cost = rates.pico(Tokens(input=max(int(item.tokens or 0) - given, 1), output=sink.sent))
            else:
                cost = most
        after(self._book, (self.clock.wall(), item.identity, plan.label, route.provider, model or "",
                           cost, 0, SYNC, 0, 0.0, 0, 0, 0, 0, 0))
        return cost

    def _book(self, record: Record) -> None:
        """A priced call into the spend metrics and the writer's records, once its answer is
        written (core/after.py): the caller's headers need only its cost."""
        _, _, label, provider, _, cost, saved, how, *_, sent, read = record
        m = self.metrics
        if sent:
            counts = m.tokens.get(label)
            if counts is None:
                counts = m.tokens[label] = [0, 0]
            counts[0] += sent
            counts[1] += read
        if cost is None:
            m.unknown[label] = m.unknown.get(label, 0) + 1
        else:
            if cost:
                key = (provider, label)
                m.spend[key] = m.spend.get(key, 0.0) + cost / 1e12
            if saved:
                key = (label, how if how != SYNC else "prompt_cache")
                m.saved[key] = m.saved.get(key, 0.0) + saved / 1e12
        if len(self.records) < MAX_PENDING:
            self.records.append(record)
        else:
            m.dropped.inc()

    def lines(self, identity: str | None, provider: str, batch: bool,
              lines: list[tuple[str, str | None, Any]]) -> list[int | None]:
        """A client's batch job's finished lines (route, model, usage): each priced and recorded
        like a call, at the batch price when they went through the batch API. Their costs in
        pico-dollars (None: unknown), in order."""
        m = self.metrics
        wall = self.clock.wall()
        costs: list[int | None] = []
        for route, model, usage in lines:
            rates = self.prices.rates(route, provider, model)
            tokens = tokens_of(usage)
            if rates is None or tokens is None:
                costs.append(None)
                if model is not None:
                    m.unknown[route] = m.unknown.get(route, 0) + 1
                    self.records.append((wall, identity, route, provider, model, None, 0, BATCH, 0, 0.0,
                                         0, 0, 0, 0 if tokens is None else tokens.input,
                                         0 if tokens is None else tokens.cache_read))
                continue
            alone = rates.pico_uncached(tokens)
            cost = full = rates.pico(tokens)
            if batch:
                num, den = self.prices.batch_kept(route, provider)
                cost = full * num // den
            saved = alone - cost
            if cost:
                m.spend[(provider, route)] = m.spend.get((provider, route), 0.0) + cost / 1e12
            if saved:
                how = BATCH if batch else "prompt_cache"
                m.saved[(route, how)] = m.saved.get((route, how), 0.0) + saved / 1e12
            writes = rates.pico_writes(tokens)
            if batch:
                writes = writes * num // den
            self.records.append((wall, identity, route, provider, model or "", cost, saved,
                                 BATCH if batch else SYNC, alone - full, 0.0, writes, 0, 0,
                                 tokens.input, tokens.cache_read))
            costs.append(cost)
        return costs

    def take(self) -> list[Record]:
        """The records since the last take (the writer's batch)."""
        records, self.records = self.records, []
        return records
