"""Token-budget formation for local models: pure decisions, no torch, no clocks."""

from __future__ import annotations

import math

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from local_models.formation import (
    WINDOW,
    GatedFormation,
    PassThrough,
    TokenBudget,
    form_batch,
    plan_chunks,
)
from local_models.prepared import KEY, Prepared
from multiplexer.core.batching import Pending
from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.lane import Lane
from multiplexer.core.limiter import RateLimiter

pytestmark = pytest.mark.anyio


def pend(tokens: int, *, enqueued: float = 0.0, priority: int = 0, rows: int = 1) -> Pending:
    item = Item(route="r", operation="call", method="m", params={}, group=("m",), tokens=tokens,
                priority=priority)
    if rows > 1:
        item.options[KEY] = Prepared("m", ["x"] * rows, False, ids=[[0] * tokens] * rows)
    return Pending(item, enqueued)


def ordered(ps: list[Pending]) -> list[Pending]:
    return sorted(ps, key=lambda p: p.sort_key)


def lengths(ps: list[Pending], take: tuple[int, ...]) -> list[int]:
    return [ps[i].item.tokens for i in take]


def test_groups_similar_lengths_around_the_oldest() -> None:
    ps = ordered([pend(n, enqueued=i * 0.001) for i, n in enumerate([5, 150, 6, 148, 7, 152, 40])])
    d = TokenBudget(max_padding=0.2).decide(ps, now=1.0)
    assert lengths(ps, d.take) == [5, 6, 7]


def test_padding_slack_lets_short_items_of_different_lengths_share_a_pass() -> None:
    ps = ordered([pend(n, enqueued=0.0) for n in [5, 9, 6, 8, 150, 140]])
    assert lengths(ps, TokenBudget(max_padding=0.1).decide(ps, now=1.0).take) == [5, 6]
    slack = TokenBudget(max_padding=0.1, padding_slack=16).decide(ps, now=1.0)
    assert sorted(lengths(ps, slack.take)) == [5, 6, 8, 9]  # 4 x 9 = 36, 8 padding tokens


def test_a_deep_queue_is_grouped_from_its_head_and_the_anchor() -> None:
    """Thousands queued: a decision groups the first WINDOW batches' rows in priority order and
    the anchor wherever it stands, and what it takes is what it would take from those alone."""
    b = TokenBudget(max_rows=8, max_padding=0.0)
    depth = WINDOW * b.max_rows
    head = [pend(10 + i % 5, enqueued=1.0, priority=1) for i in range(depth)]
    deep = [pend(10 + i % 5, enqueued=1.0, priority=1) for i in range(2000)]
    starved = pend(12, enqueued=-10.0, priority=0)  # low priority, but waited longest: the anchor
    ps = ordered([*head, *deep, starved])
    assert ps[-1] is starved
    d = b.decide(ps, now=1000.0)
    assert len(ps) - 1 in d.take and all(i < depth or i == len(ps) - 1 for i in d.take)
    # the anchor and the six of its length in the window, though hundreds more wait deeper
    assert lengths(ps, d.take) == [12] * 7
    window = [*ps[:depth], starved]
    alone = b.decide(window, now=1000.0)
    assert [window[i] for i in alone.take] == [ps[i] for i in d.take]


def test_a_deep_queue_without_length_grouping_takes_its_head() -> None:
    ps = ordered([pend(10, enqueued=float(i)) for i in range(5000)])
    assert TokenBudget(max_rows=16, length_grouping=False).decide(ps, now=0.0).take == tuple(range(16))


def test_padded_budget_caps_the_batch_and_a_full_batch_leaves_at_once() -> None:
    ps = ordered([pend(100, enqueued=10.0) for _ in range(8)])
    d = TokenBudget(max_tokens=400, max_wait=1.0).decide(ps, now=10.0)  # nobody has waited
    assert len(d.take) == 4


def test_partial_batch_waits_for_max_wait_then_leaves() -> None:
    ps = ordered([pend(10, enqueued=5.0), pend(11, enqueued=5.002)])
    b = TokenBudget(max_wait=0.01)
    d = b.decide(ps, now=5.004)
    assert not d.take and d.wait_until == pytest.approx(5.01)
    assert b.decide(ps, now=5.01).take == (0, 1)


def test_row_cap() -> None:
    ps = ordered([pend(10) for _ in range(10)])
    assert len(TokenBudget(max_rows=4).decide(ps, now=1.0).take) == 4


def test_multi_row_item_counts_as_its_padded_size() -> None:
    ps = ordered([pend(50, rows=6), pend(50), pend(50)])
    assert TokenBudget(max_tokens=400).decide(ps, now=1.0).take == (0, 1, 2)  # 8 rows x 50
    assert TokenBudget(max_tokens=399).decide(ps, now=1.0).take == (0, 1)
    assert TokenBudget(max_rows=7).decide(ps, now=1.0).take == (0, 1)


def test_an_item_over_the_budget_still_leaves_alone() -> None:
    ps = ordered([pend(500), pend(10)])
    assert TokenBudget(max_tokens=100).decide(ps, now=1.0).take == (0,)


def test_higher_priority_anchors_the_batch() -> None:
    ps = ordered([pend(10, enqueued=0.0), pend(100, enqueued=0.5, priority=5), pend(101, enqueued=0.6)])
    d = TokenBudget(aging=1.0).decide(ps, now=1.0)
    assert sorted(lengths(ps, d.take)) == [100, 101]


def test_aging_lets_an_old_low_priority_item_overtake() -> None:
    ps = ordered([pend(10, enqueued=0.0, priority=0), pend(100, enqueued=2.9, priority=2)])
    assert lengths(ps, TokenBudget(aging=1.0).decide(ps, now=3.0).take) == [10]
    assert lengths(ps, TokenBudget(aging=0.0).decide(ps, now=3.0).take) == [100]


def test_low_priority_is_not_starved_by_a_steady_high_priority_stream() -> None:
    """One high-priority item arrives per tick and one batch leaves per tick; the low one still goes."""
    b = TokenBudget(max_rows=1, aging=0.5, max_wait=0.0)
    queue = [pend(10, enqueued=0.0, priority=0)]
    low = queue[0]
    for tick in range(1, 100):
        now = float(tick)
        queue = ordered([*queue, pend(10, enqueued=now, priority=3)])
        [i] = b.decide(queue, now).take
        if queue.pop(i) is low:
            break
    assert tick <= 3


def test_no_grouping_takes_arrival_order() -> None:
    ps = ordered([pend(n, enqueued=0.0) for n in [5, 150, 6, 148] * 10])
    d = TokenBudget(max_rows=32, max_tokens=10**9, length_grouping=False).decide(ps, now=1.0)
    assert d.take == tuple(range(32))


def test_eager_lane_asks_with_infinite_time_without_nan() -> None:
    ps = ordered([pend(10, enqueued=1.0), pend(12, enqueued=2.0)])
    assert TokenBudget(max_wait=5.0).decide(ps, now=math.inf).take == (0, 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3), st.floats(0, 2)), min_size=1, max_size=60),
    st.integers(1, 32), st.integers(16, 4096), st.floats(0, 0.5), st.integers(0, 64),
)
def test_every_batch_respects_its_limits(items, max_rows, max_tokens, max_padding, slack) -> None:
    ps = ordered([pend(n, priority=p, enqueued=t) for n, p, t in items])
    b = TokenBudget(max_rows=max_rows, max_tokens=max_tokens, max_padding=max_padding, max_wait=0.0,
                    padding_slack=slack)
    d = form_batch(ps, 5.0, b)
    assert d.take and len(set(d.take)) == len(d.take)
    chosen = lengths(ps, d.take)
    if len(chosen) > 1:
        padded = len(chosen) * max(chosen)
        assert len(chosen) <= max_rows and padded <= max_tokens
        assert padded - sum(chosen) <= max(max_padding * padded, slack) + 1e-9


def test_plan_chunks_keeps_small_batches_whole_and_splits_big_ones_by_length() -> None:
    assert plan_chunks([3, 9, 4], 8, 100) == [[0, 1, 2]]
    chunks = plan_chunks([100, 3, 90, 4, 5], 8, 200)
    assert sorted(i for c in chunks for i in c) == [0, 1, 2, 3, 4]
    for c in chunks:
        assert len(c) == 1 or len(c) * max([100, 3, 90, 4, 5][i] for i in c) <= 200
    assert chunks[0] == [1, 3, 4]


def taken_from(queue: list[Pending], take: tuple[int, ...]) -> list[Pending]:
    """What the lane's queue does with a decision: hands the items out, marked running."""
    for i in take:
        queue[i].state = "running"
    return [p for i, p in enumerate(queue) if i not in take]


def test_gated_formation_holds_a_group_while_its_batch_runs() -> None:
    gated = GatedFormation(lambda group: (TokenBudget(max_wait=0.0), 1))
    queue = ordered([pend(10), pend(11)])
    d = gated.decide(queue, 1.0)
    taken = [queue[i] for i in d.take]
    assert not taken_from(queue, d.take)
    newer = [pend(12, enqueued=1.0)]
    held = gated.decide(newer, 2.0)
    assert not held.take and held.blocked  # the first batch runs: only its end can move the group
    for p in taken:
        p.state = "done"
    assert gated.decide(newer, 2.0).take == (0,)


def test_gated_formation_forgets_a_batch_the_lane_did_not_take() -> None:
    gated = GatedFormation(lambda group: (TokenBudget(max_wait=0.0), 1))
    queue = ordered([pend(10)])
    assert gated.decide(queue, 1.0).take == (0,)
    assert gated.decide(queue, 1.0).take == (0,)  # still queued: it never ran


def test_concurrent_batches_each_take_their_share_of_the_rows() -> None:
    """Two batches at once: each takes half of what is queued and running, so the callers that
    come back together do not all land in one batch beside a stream of single rows."""
    gated = GatedFormation(lambda group: (TokenBudget(max_wait=0.0, max_padding=1.0), 2))
    queue = ordered([pend(10 + i % 7) for i in range(64)])
    first = gated.decide(queue, 1.0).take
    assert len(first) == 32
    rest = taken_from(queue, first)
    second = gated.decide(rest, 1.0).take
    assert len(second) == 32  # the first batch runs: 32 queued + 32 running
    taken_from(rest, second)
    returning = ordered([pend(10) for _ in range(3)])
    assert not gated.decide(returning, 1.0).take  # two batches run: held back
    for p in queue:
        p.state = "done"
    both = gated.decide(returning, 1.0).take
    assert both == (0, 1)  # both free: two rows here, one there
    assert gated.decide(taken_from(returning, both), 1.0).take == (0,)
    for p in returning:
        p.state = "done"
    multi = ordered([pend(10, rows=40)])  # one call over the share still goes, whole
    assert gated.decide(multi, 1.0).take == (0,)


def test_one_batch_at_a_time_takes_everything_its_budget_allows() -> None:
    gated = GatedFormation(lambda group: (TokenBudget(max_wait=0.0, max_padding=1.0), 1))
    assert len(gated.decide(ordered([pend(10) for _ in range(64)]), 1.0).take) == 64


def test_pass_through_is_ungated() -> None:
    gated = GatedFormation(lambda group: (PassThrough(), None))
    queue = ordered([pend(10), pend(10)])
    assert gated.decide(queue, 1.0).take == (0,)
    assert gated.decide(queue[1:], 1.0).take == (0,)


async def test_lane_forms_the_next_batch_while_the_model_is_busy() -> None:
    """With capacity 1 the lane keeps items queued while a batch runs, so the next one is bigger."""
    clock = ManualClock()
    release = anyio.Event()
    seen: list[list[int]] = []

    async def execute(op: str, items) -> list[Outcome]:
        seen.append([it.tokens for it in items])
        if len(seen) == 1:
            await release.wait()
        return [Outcome(result=it.tokens) for it in items]

    gated = GatedFormation(lambda group: (TokenBudget(max_wait=0.0, max_padding=0.5), 1))
    lane = Lane("local", execute, gated, clock, RateLimiter(clock, concurrency=64))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        first = lane.submit(pend(10).item)
        await clock.advance(0)
        for n in (20, 21, 22, 90):
            lane.submit(pend(n).item)
        await clock.advance(0.1)
        assert seen == [[10]]  # nothing else left while the first batch ran
        release.set()
        await first.future.wait()
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert sorted(map(sorted, seen)) == [[10], [20, 21, 22], [90]]
        lane.close()


async def test_a_deep_queue_through_the_lane_answers_every_call_once_high_priority_first() -> None:
    """Hundreds queued behind running batches: each call is answered once with its own result, no
    batch passes the row cap, and the calls sent last at a higher priority go in the next batches."""
    clock = ManualClock()
    release = anyio.Event()
    seen: list[list[tuple[int, int]]] = []

    async def execute(op: str, items) -> list[Outcome]:
        seen.append([(it.priority, it.tokens) for it in items])
        if len(seen) <= 2:
            await release.wait()
        return [Outcome(result=(it.priority, it.tokens)) for it in items]

    gated = GatedFormation(lambda group: (TokenBudget(max_rows=4, max_wait=0.0, max_padding=1.0), 2))
    lane = Lane("local", execute, gated, clock, RateLimiter(clock, concurrency=64))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        first = [lane.submit(pend(10).item) for _ in range(8)]
        await clock.advance(0)
        assert len(seen) == 2  # both slots busy: everything else queues behind them
        low = [lane.submit(pend(5 + i % 40).item) for i in range(300)]
        high = [lane.submit(pend(7 + i % 3, priority=5).item) for i in range(8)]
        release.set()
        for p in [*first, *low, *high]:
            await p.future.wait()
        assert [p.future.outcome().result for p in [*low, *high]] == \
            [(0, 5 + i % 40) for i in range(300)] + [(5, 7 + i % 3) for i in range(8)]
        assert sum(len(b) for b in seen) == 316 and max(len(b) for b in seen) <= 4
        # each batch after the release is anchored on a priority-5 call while one is left (length
        # grouping may seat priority-0 calls of the same length beside it)
        carries = [any(p == 5 for p, _ in b) for b in seen[2:]]
        assert carries[0] and carries == sorted(carries, reverse=True)
        lane.close()


def test_a_prepared_calls_shape_follows_its_tokens() -> None:
    """Before tokenising, the estimate per text; after, the counted ids (the cached shape is
    dropped when the ids arrive, so a call queued before its model loaded is formed by its ids)."""
    p = Prepared("m", ["one", "two", "three"], False, estimate=7)
    assert p.dims == (3, 7, 21)
    p.tokenized([[1, 2], [1, 2, 3, 4, 5], [1]])
    assert p.dims == (3, 5, 8)
    assert (p.rows, p.longest, p.real) == (3, 5, 8)


async def test_a_lane_does_not_decide_for_arrivals_while_its_gated_group_waits_for_a_batch() -> None:
    """Callers arriving while the model runs its one batch: the first makes the lane ask once
    (and hear that only the batch's end can move the group), the rest neither wake it nor make it
    decide again; the batch's end forms the next batch from all of them."""
    decisions: list[int] = []
    gated = GatedFormation(lambda group: (TokenBudget(max_wait=0.0, max_padding=1.0), 1))

    class Counted:
        def decide(self, pending, now):  # type: ignore[no-untyped-def]
            decisions.append(len(pending))
            return gated.decide(pending, now)

    clock, release, batches = ManualClock(), anyio.Event(), []

    async def execute(operation: str, items) -> list[Outcome]:  # type: ignore[no-untyped-def]
        batches.append(len(items))
        if len(batches) == 1:
            await release.wait()
        return [Outcome(result=i.tokens) for i in items]

    lane = Lane("p", execute, Counted(), clock, RateLimiter(clock))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lane.run)
        first = lane.submit(pend(10).item)
        await clock.advance(0)
        assert batches == [1]
        decided = len(decisions)
        later = []
        for i in range(20):  # one by one, each given a turn of the loop, as callers arrive
            later.append(lane.submit(pend(10 + i).item))
            await clock.advance(0)
        assert len(decisions) == decided + 1  # one, not one per arrival
        release.set()
        await first.future.wait()
        assert [(await p.future.wait()).result for p in later] == [10 + i for i in range(20)]
        assert batches == [1, 20]
        lane.close()
