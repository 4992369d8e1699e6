"""Learned limits follow the upstream both ways (a tiny reset must not unlimit a bucket)."""

from __future__ import annotations

import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.limiter import RateLimiter

pytestmark = pytest.mark.anyio


async def test_tiny_reset_speeds_the_bucket_for_that_instant_only():
    clock = ManualClock()
    limiter = RateLimiter(clock, rpm=60)  # 1 request per second
    limiter.consume(60, 0)
    limiter.observe("requests", 60, 0, 0.01)  # the upstream's window rolls in 10 ms
    await clock.advance(0.02)  # full again, as the upstream said
    assert limiter.delay(60, 0)[0] == 0.0
    limiter.consume(60, 0)
    wait, which = limiter.delay(1, 0)
    assert which == "rpm" and wait == pytest.approx(1.0)  # back to the plan: 1 per second


async def test_long_reset_slows_the_bucket_until_then():
    clock = ManualClock()
    limiter = RateLimiter(clock, rpm=60)
    limiter.consume(60, 0)
    limiter.observe("requests", 60, 0, 120.0)  # full only in two minutes: 0.5 per second
    assert limiter.delay(1, 0)[0] == pytest.approx(2.0)
    await clock.advance(120.0)
    assert limiter.delay(60, 0)[0] == 0.0
    limiter.consume(60, 0)
    assert limiter.delay(1, 0)[0] == pytest.approx(1.0)


def test_learned_limit_follows_the_header_down_and_up():
    clock = ManualClock()
    limiter = RateLimiter(clock)
    limiter.observe("requests", 100, 100, 0)
    assert limiter.requests.capacity == 100
    limiter.observe("requests", 40, 40, 0)
    assert limiter.requests.capacity == 40 and limiter.requests.rate == pytest.approx(40 / 60)
    limiter.observe("requests", 100, 40, 0)
    assert limiter.requests.capacity == 100


def test_configured_limit_is_a_ceiling_for_what_is_learned():
    clock = ManualClock()
    limiter = RateLimiter(clock, rpm=50)
    limiter.observe("requests", 1000, 900, 0)
    assert limiter.requests.capacity == 50
    limiter.observe("requests", 20, 20, 0)
    assert limiter.requests.capacity == 20
