"""Per-key quotas as pure decisions on a manual clock: one grant per claim, given back by grant."""

from __future__ import annotations

import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.policy import Quota
from multiplexer.core.quota import FREE, LOCAL, Claim, Quotas


def charge(quotas: Quotas, identity: str | None, calls: int) -> None:
    grant = quotas.decide_here(Claim(identity, call=False, batch_calls=calls))
    if grant.refusal is not None:
        raise grant.refusal


def test_batch_calls_per_day_is_all_or_none_and_resets_at_utc_midnight() -> None:
    clock = ManualClock(start=0.0, wall=86_400 * 20_000 + 86_000)  # 400 s before a UTC midnight
    quotas = Quotas(clock, {"k": Quota(batch_calls_per_day=10)})
    charge(quotas, "k", 7)
    with pytest.raises(RpcError) as e:
        charge(quotas, "k", 4)
    assert e.value.code == Code.RATE_LIMITED
    assert e.value.data == {"limit": "batch_calls_per_day", "retry_after": 400.0, "identity": "k",
                            "allowed": 10, "remaining": 3}
    charge(quotas, "k", 3)  # the refused 4 were not counted
    with pytest.raises(RpcError):
        charge(quotas, "k", 1)
    charge(quotas, None, 10_000)  # keyless and unlisted keys are unlimited
    charge(quotas, "other", 10_000)


@pytest.mark.anyio
async def test_a_new_day_gives_the_allowance_back() -> None:
    clock = ManualClock(start=0.0, wall=86_400 * 20_000 + 86_000)
    quotas = Quotas(clock, {"k": Quota(batch_calls_per_day=2)})
    charge(quotas, "k", 2)
    await clock.advance(401)
    charge(quotas, "k", 2)


def test_a_refused_call_takes_nothing_and_a_grant_gives_back_once() -> None:
    """All or nothing: a call refused for its batch allowance takes no rpm token and no slot;
    a grant's slot and charge go back once, however often release and refund are asked."""
    clock = ManualClock(start=0.0, wall=86_400 * 20_000)
    quotas = Quotas(clock, {"k": Quota(rpm=2, concurrency=1, batch_calls_per_day=1)})
    held = quotas.decide_here(Claim("k", batch_calls=1))
    assert held.refusal is None and held.slot == LOCAL and held.batch is not None
    busy = quotas.decide_here(Claim("k"))
    assert busy.refusal is not None and busy.refusal.data["limit"] == "concurrency"
    quotas.release(held)
    quotas.release(held)  # a second release frees nothing more
    over = quotas.decide_here(Claim("k", batch_calls=1))
    assert over.refusal is not None and over.refusal.data["limit"] == "batch_calls_per_day"
    quotas.refund(held)
    quotas.refund(held)
    again = quotas.decide_here(Claim("k", batch_calls=1))  # the refused one took no rpm token
    assert again.refusal is None
    quotas.release(again)
    third = quotas.decide_here(Claim("k"))  # two of two rpm tokens used
    assert third.refusal is not None and third.refusal.data["limit"] == "rpm"
    assert quotas.decide_here(Claim(None)) is FREE and quotas.decide_here(Claim("other")) is FREE


@pytest.mark.anyio
async def test_an_array_gets_one_grant_per_claim_in_order() -> None:
    quotas = Quotas(ManualClock(), {"k": Quota(concurrency=2)})
    grants = await quotas.decide([Claim("k"), None, Claim("k"), Claim("k")])
    assert [g.refusal is None for g in grants] == [True, True, True, False]
    assert grants[1] is FREE
    assert grants[3].refusal is not None and grants[3].refusal.data["limit"] == "concurrency"
