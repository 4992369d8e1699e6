"""Token-budget batch formation for local models: which queued items share one forward pass.

A forward pass costs its padded size (rows x longest row), so the decision
groups items of similar length under a padded-token budget, a row cap and a
padding tolerance (a share of the batch, or a few tokens that cost less than
a pass's fixed overhead), anchored on the item that has the best claim to go next:
its priority plus an aging credit, so low priorities cannot starve. The
decisions are pure functions of the queue and the time; ``GatedFormation`` is
the thin stateful shell that holds a model's next batch back while its
previous ones still run, so batches keep growing while the model is busy.

A decision looks at most ``WINDOW`` batches' rows deep into the queue (its head
in priority order, plus the anchor wherever it stands): with thousands of calls
queued, grouping all of them by length at every batch cost the event loop more
per call than the rest of the call's path, and a batch of similar lengths is
found among a few batches' worth of candidates.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from multiplexer.core.batching import Decision, Formation, Pending

from .prepared import shape

WINDOW = 4  # batches' worth of queued rows a decision considers (see the module's docstring)


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """Implements ``multiplexer.core.batching.Formation`` for one model's queue."""

    max_rows: int = 64
    max_tokens: int = 16384
    max_wait: float = 0.002
    max_padding: float = 0.1
    length_grouping: bool = True
    aging: float = 1.0
    padding_slack: int = 0

    def decide(self, pending: Sequence[Pending], now: float) -> Decision:
        return form_batch(pending, now, self)


def anchor_index(pending: Sequence[Pending], now: float, aging: float) -> int:
    """The item that goes next: highest priority plus one level per ``aging`` seconds waited."""
    best, best_score = 0, -math.inf
    for i, p in enumerate(pending):
        score = float(p.item.priority)
        if aging > 0:
            score += (now - p.enqueued) / aging
        if score > best_score:
            best, best_score = i, score
    return best


def form_batch(pending: Sequence[Pending], now: float, b: TokenBudget) -> Decision:
    if not pending:
        return Decision()
    anchor = anchor_index(pending, now, b.aging) if b.length_grouping else 0
    depth = WINDOW * b.max_rows
    candidates: Sequence[int] = range(len(pending))
    if len(pending) > depth:
        candidates = [*range(depth), anchor] if anchor >= depth else range(depth)
    shapes = [shape(pending[i].item) for i in candidates]
    if b.length_grouping:
        chosen, full = _grow_by_length(shapes, candidates.index(anchor), b)
    else:
        chosen, full = _grow_in_order(shapes, b)
    oldest = min(p.enqueued for p in pending)
    if full or oldest + b.max_wait <= now:
        return Decision(take=tuple(sorted(candidates[j] for j in chosen)))
    return Decision(wait_until=oldest + b.max_wait)


def _grow_in_order(shapes: list[tuple[int, int, int]], b: TokenBudget) -> tuple[list[int], bool]:
    """Arrival (priority) order, no grouping: the fixed-batch baseline."""
    rows, top = 0, 0
    chosen: list[int] = []
    for i, (r, longest, _) in enumerate(shapes):
        if chosen and (rows + r > b.max_rows or (rows + r) * max(top, longest) > b.max_tokens):
            return chosen, True
        chosen.append(i)
        rows, top = rows + r, max(top, longest)
    return chosen, rows >= b.max_rows


def _grow_by_length(
    shapes: list[tuple[int, int, int]], anchor: int, b: TokenBudget
) -> tuple[list[int], bool]:
    """Widen a window around the anchor in length order, cheapest padding first.

    ``full`` is True when growth stopped at the row or token cap (the batch is as
    big as it may be), False when it stopped for lack of similar items (waiting
    may still bring some).
    """
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i][1], i))
    pos = order.index(anchor)
    lo = hi = pos
    rows, top, real = shapes[anchor]
    chosen = [anchor]
    if rows >= b.max_rows or rows * top >= b.max_tokens:
        return chosen, True
    while True:
        options: list[tuple[int, int, int]] = []  # (added padding, side, index)
        capped = False
        for side, j in ((0, lo - 1), (1, hi + 1)):
            if not 0 <= j < len(order):
                continue
            r, longest, re = shapes[order[j]]
            n_rows, n_top, n_real = rows + r, max(top, longest), real + re
            padded = n_rows * n_top
            if n_rows > b.max_rows or padded > b.max_tokens:
                capped = True
                continue
            if padded - n_real > max(b.max_padding * padded, b.padding_slack):
                continue
            options.append(((padded - n_real) - (rows * top - real), side, j))
        if not options:
            return chosen, capped
        _, side, j = min(options)
        r, longest, re = shapes[order[j]]
        rows, top, real = rows + r, max(top, longest), real + re
        chosen.append(order[j])
        if side == 0:
            lo = j
        else:
            hi = j


def plan_chunks(lengths: Sequence[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Split rows that exceed a budget into forward passes, shortest first; else one pass in order."""
    if not lengths:
        return []
    if len(lengths) <= max_rows and len(lengths) * max(lengths) <= max_tokens:
        return [list(range(len(lengths)))]
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) + 1 > max_rows or (len(current) + 1) * lengths[i] > max_tokens):
            chunks.append(current)
            current = []
        current.append(i)
    chunks.append(current)
    return chunks


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Each item leaves at once, alone: generation batches inside its engine, step by step."""

    def decide(self, pending: Sequence[Pending], now: float) -> Decision:
        return Decision(take=(0,)) if pending else Decision()


Policy = Callable[[Hashable], tuple[Formation, int | None]]


class GatedFormation:
    """Runs each group's formation only while the group has fewer than ``capacity`` batches running.

    ``policy(group)`` gives the group's formation and capacity (None: never held back).

    The lane owns the queue and calls ``decide`` again whenever a batch ends, so
    the running batches are recognised from the ``Pending`` objects it took: a
    batch this formation chose is running once the queue has handed its items
    out (``running``) and finished once they are all ``done``; one the lane did
    not take is forgotten. That costs a look at each running batch per decision,
    not a pass over the queue, which the lane asks again at every arrival.

    With a capacity over one, a token budget's batch takes at most its share of
    the rows queued and running (``balanced``), so the batches running side by
    side stay alike in size and so do the cores' loads. Without it, callers
    that share a batch come back together and queue together: a budget that
    lets a batch take everything queued settled, with 64 callers on two
    batches at once, into one batch of 63 beside a stream of single rows.
    """

    tracks_batches = True  # every batch must be one it chose: the lane runs none around it

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._batches: dict[Hashable, list[tuple[Pending, ...]]] = {}

    def running(self, group: Hashable) -> int:
        # a batch's items turn running together when the queue hands them out, and done together
        # when it ends; withdrawn ones turn done in the queue, expired ones as the lane takes them
        live = [batch for batch in self._batches.get(group, []) if any(p.state == "running" for p in batch)]
        self._batches[group] = live
        return len(live)

    def decide(self, pending: Sequence[Pending], now: float) -> Decision:
        if not pending:
            return Decision()
        group = pending[0].item.group
        formation, capacity = self._policy(group)
        if capacity is None:  # ungated
            return formation.decide(pending, now)
        if self.running(group) >= capacity:
            return Decision(blocked=True)  # the lane asks again when a batch ends
        decision = self.balanced(formation, capacity, group, pending).decide(pending, now)
        if decision.take:
            self._batches[group].append(tuple(pending[i] for i in decision.take))
        return decision

    def balanced(self, formation: Formation, capacity: int, group: Hashable,
                 pending: Sequence[Pending]) -> Formation:
        """``formation`` with its row cap lowered to this batch's share (call after ``running``)."""
        if capacity <= 1 or not isinstance(formation, TokenBudget):
            return formation
        enough = capacity * formation.max_rows  # rows past which every batch may take its cap
        rows = 0
        for p in itertools.chain(pending, itertools.chain.from_iterable(self._batches.get(group, ()))):
            rows += shape(p.item)[0]
            if rows >= enough:
                return formation
        share = max(1, -(-rows // capacity))
        return formation if share >= formation.max_rows else dataclasses.replace(formation, max_rows=share)
