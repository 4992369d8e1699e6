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
    with pytest.raises(RpcError) as spent:
        charge(quotas, "k", 1)
    assert spent.value.data["remaining"] == 0 and spent.value.data["retry_after"] == 400.0
    await clock.advance(401)  # past midnight UTC: the allowance is whole again, and only that
    charge(quotas, "k", 2)
    with pytest.raises(RpcError):
        charge(quotas, "k", 1)


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


@pytest.mark.anyio
async def test_tpm_charges_the_estimate_and_refills_over_the_minute() -> None:
    """tpm 100, calls estimated at 40 tokens: two go, the third waits for the 20 it lacks (12 s at
    100 a minute); once the window has refilled it goes again."""
    clock = ManualClock()
    quotas = Quotas(clock, {"k": Quota(tpm=100)})
    first, second = quotas.decide_here(Claim("k", tokens=40)), quotas.decide_here(Claim("k", tokens=40))
    assert (first.refusal, second.refusal, first.tokens) == (None, None, 40)
    third = quotas.decide_here(Claim("k", tokens=40))
    assert third.refusal is not None and third.refusal.code == Code.RATE_LIMITED
    assert third.refusal.data == {"limit": "tpm", "retry_after": 12.0, "identity": "k"}
    await clock.advance(11.9)
    assert quotas.decide_here(Claim("k", tokens=40)).refusal is not None
    await clock.advance(0.1)
    assert quotas.decide_here(Claim("k", tokens=40)).refusal is None
    assert quotas.decide_here(Claim("k")).refusal is None  # no estimate: nothing asked of tpm


def test_tpm_settles_to_the_usage_once_and_a_refund_gives_it_all_back() -> None:
    clock = ManualClock()
    quotas = Quotas(clock, {"k": Quota(tpm=100)})
    a, b = quotas.decide_here(Claim("k", tokens=40)), quotas.decide_here(Claim("k", tokens=40))
    assert quotas.decide_here(Claim("k", tokens=40)).refusal is not None  # 20 left
    quotas.release(a, 10)  # it used 10 of its 40: 30 back
    quotas.release(a, 0)  # settled once: nothing more moves
    c = quotas.decide_here(Claim("k", tokens=40))  # 50 left
    assert c.refusal is None
    quotas.refund(c)  # refused after its decision (a budget): all 40 back
    quotas.release(c, 40)
    quotas.release(b)  # usage unknown: its estimate stands
    assert quotas.decide_here(Claim("k", tokens=50)).refusal is None  # 50 left: 100 - 10 - 40
    assert quotas.decide_here(Claim("k", tokens=1)).refusal is not None
    over = Quotas(clock, {"k": Quota(tpm=100)})
    big = over.decide_here(Claim("k", tokens=30))
    over.release(big, 500)  # it used far more than asked: the key owes the difference
    refused = over.decide_here(Claim("k", tokens=1))  # it lacks 401: 240.6 s at 100 a minute
    assert refused.refusal is not None and refused.refusal.data["retry_after"] == pytest.approx(240.6)


def test_a_call_refused_by_tpm_takes_no_rpm_token_or_slot() -> None:
    quotas = Quotas(ManualClock(), {"k": Quota(rpm=2, tpm=50, concurrency=2)})
    held = quotas.decide_here(Claim("k", tokens=50))
    refused = quotas.decide_here(Claim("k", tokens=50))
    assert refused.refusal is not None and refused.refusal.data["limit"] == "tpm"
    quotas.release(held, 0)  # it used nothing: all 50 back, its slot free
    assert quotas.decide_here(Claim("k", tokens=50)).refusal is None  # the second rpm token
    third = quotas.decide_here(Claim("k")).refusal
    assert third is not None and third.data == {"limit": "rpm", "retry_after": 30.0, "identity": "k"}


def test_a_workers_part_of_a_keys_tpm() -> None:
    from multiplexer.gateway.replicas import share_of_quota

    quotas = Quotas(ManualClock(), {}, lambda q: share_of_quota(q, 4))
    quotas.set_limits("k", Quota(rpm=40, tpm=1000))  # a key's own limits (YAML or stored)
    assert (quotas.quotas["k"].rpm, quotas.quotas["k"].tpm) == (10, 250)


class Refused(Exception):
    """A face's shape of a refusal."""

    def __init__(self, error: RpcError) -> None:
        self.error = error


@pytest.mark.anyio
async def test_held_keeps_one_request_for_its_body_and_shapes_only_the_refusal() -> None:
    quotas = Quotas(ManualClock(), {"k": Quota(concurrency=1)})
    async with quotas.held("k", Refused) as grant:
        assert grant.slot == LOCAL
        with pytest.raises(Refused) as refused:  # the key's one slot is held by the body
            async with quotas.held("k", Refused):
                pass
        assert refused.value.error.data["limit"] == "concurrency"
    with pytest.raises(RpcError, match="bad"):  # the body's own error passes through as it is
        async with quotas.held("k", Refused):
            raise RpcError(Code.INVALID_PARAMS, "bad")
    async with quotas.held("k", Refused) as grant:  # ... and its slot was released
        assert grant.slot == LOCAL
    assert grant.slot is None
