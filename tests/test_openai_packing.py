"""Packing and scattering embeddings, as pure functions; rate-limit header parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multiplexer.core.limiter import RateLimiter
from providers.http_util import parse_duration, parse_retry_after
from providers.packing import Scatter, ordered_data, pack, split_usage
from providers.ratelimit_headers import Observation, anthropic_limits, apply, openai_limits, wait_hint
from tests.remote_helpers import InstantClock

texts = st.text(alphabet="abc xyz", min_size=1, max_size=40)


@given(st.lists(st.lists(texts, min_size=1, max_size=6), min_size=1, max_size=30),
       st.integers(1, 7), st.one_of(st.none(), st.integers(1, 40)))
def test_every_caller_gets_exactly_its_own_inputs_back(per_item, max_inputs, max_tokens):
    chunks = pack(per_item, max_inputs, max_tokens)
    scatter = Scatter(per_item)
    for chunk in chunks:
        assert 1 <= len(chunk.inputs) <= max_inputs
        if max_tokens is not None and len(chunk.inputs) > 1:
            assert chunk.tokens <= max_tokens
        data = [{"index": i, "embedding": [0.0], "text": t} for i, t in enumerate(chunk.inputs)]
        body = {"data": data[::-1], "model": "m", "usage": {"prompt_tokens": 10 * len(data)}}
        ordered = ordered_data(body, len(chunk.inputs))
        assert ordered is not None
        scatter.add(chunk, body, ordered)
    results = [scatter.result(i) for i in range(len(per_item))]
    for inputs, result in zip(per_item, results, strict=True):
        assert [d["text"] for d in result["data"]] == inputs
        assert [d["index"] for d in result["data"]] == list(range(len(inputs)))
    assert sum(r["usage"]["prompt_tokens"] for r in results) == 10 * sum(map(len, per_item))


@given(st.integers(0, 10_000), st.lists(st.integers(0, 500), min_size=1, max_size=50))
def test_usage_shares_add_up_exactly(total, weights):
    shares = split_usage(total, weights)
    assert sum(shares) == total and all(s >= 0 for s in shares)


def test_pack_keeps_order_and_splits_a_long_caller():
    chunks = pack([["a", "b", "c"], ["d"]], max_inputs=2, max_tokens=None)
    assert [c.inputs for c in chunks] == [["a", "b"], ["c", "d"]]
    assert [(s.item, s.start, s.count) for s in chunks[1].spans] == [(0, 2, 1), (1, 0, 1)]


def test_ordered_data_rejects_gaps_and_wrong_counts():
    assert ordered_data({"data": [{"index": 1}, {"index": 0}]}, 2) == [{"index": 0}, {"index": 1}]
    assert ordered_data({"data": [{"index": 0}, {"index": 2}]}, 2) is None
    assert ordered_data({"data": [{"index": 0}]}, 2) is None
    assert ordered_data({"nope": 1}, 1) is None


def WALL() -> float:
    return 1_700_000_000.0


def test_retry_after_dates_are_read_against_the_injected_wall_clock():
    date = "Tue, 14 Nov 2023 22:14:00 GMT"  # 1_700_000_040
    assert parse_retry_after(date, WALL) == 40.0
    assert parse_retry_after(date, lambda: 1_700_000_100.0) == 0.0  # already past
    assert parse_retry_after("2.5", WALL) == 2.5
    assert parse_retry_after("soon", WALL) is None


def test_openai_headers():
    obs = openai_limits({
        "x-ratelimit-limit-requests": "500", "x-ratelimit-remaining-requests": "499",
        "x-ratelimit-reset-requests": "120ms", "x-ratelimit-limit-tokens": "90000",
        "x-ratelimit-remaining-tokens": "89000", "x-ratelimit-reset-tokens": "1m30s",
    }, WALL)
    assert obs == [Observation("requests", 500, 499, 0.12), Observation("tokens", 90000, 89000, 90.0)]
    assert openai_limits({"x-ratelimit-remaining-requests": "-1"}, WALL) == []
    assert openai_limits({"x-ratelimit-remaining-requests": "soon"}, WALL) == []


@pytest.mark.parametrize(("value", "seconds"), [
    ("12ms", 0.012), ("6s", 6.0), ("59.987s", 59.987), (" 7s ", 7.0), ("1m30s", 90.0),
    ("2h0m5.5s", 7205.5), ("1m30ms", 60.03),
    ("1e5s", None), ("nans", None), ("-5s", None), (".5s", None), ("5.s", None), ("ms", None),
    ("1.2.3s", None), ("\u00b2s", None), ("soon", None), ("", None)])
def test_reset_durations_in_every_form_openai_sends_and_nothing_else(value, seconds):
    assert parse_duration(value) == seconds


def test_anthropic_headers_use_rfc3339_resets():
    now = 1_700_000_000.0
    obs = anthropic_limits({
        "anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "10",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:50Z",
        "anthropic-ratelimit-input-tokens-limit": "1000",
        "anthropic-ratelimit-input-tokens-remaining": "300",
        "anthropic-ratelimit-input-tokens-reset": "2023-11-14T22:13:40Z",
        "anthropic-ratelimit-output-tokens-limit": "1000",
        "anthropic-ratelimit-output-tokens-remaining": "900",
        "anthropic-ratelimit-output-tokens-reset": "2023-11-14T22:13:30Z",
    }, lambda: now)
    assert obs == [Observation("requests", 50, 10, 30.0), Observation("tokens", 1000, 300, 20.0)]


def test_wait_hint_prefers_retry_after_then_an_exhausted_reset():
    exhausted = [Observation("requests", 10, 0, 12.0), Observation("tokens", 10, 5, 50.0)]
    assert wait_hint({"retry-after": "3"}, exhausted, WALL) == 3.0
    assert wait_hint({"retry-after-ms": "250"}, exhausted, WALL) == 0.25
    assert wait_hint({}, exhausted, WALL) == 12.0
    assert wait_hint({}, [Observation("requests", 10, 4, 12.0)], WALL) is None


def test_observations_create_and_clamp_limiter_buckets():
    limiter = RateLimiter(InstantClock())
    apply(limiter, [Observation("requests", 60, 0, 30.0)])
    wait, which = limiter.delay(1, 0)
    assert which == "rpm" and wait > 0
