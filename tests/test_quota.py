"""Per-key quotas as pure decisions on a manual clock."""

from __future__ import annotations

import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.policy import Quota
from multiplexer.core.quota import Quotas


def test_batch_calls_per_day_is_all_or_none_and_resets_at_utc_midnight() -> None:
    clock = ManualClock(start=0.0, wall=86_400 * 20_000 + 86_000)  # 400 s before a UTC midnight
    quotas = Quotas(clock, {"k": Quota(batch_calls_per_day=10)})
    quotas.charge_batch("k", 7)
    with pytest.raises(RpcError) as e:
        quotas.charge_batch("k", 4)
    assert e.value.code == Code.RATE_LIMITED
    assert e.value.data == {"limit": "batch_calls_per_day", "retry_after": 400.0, "identity": "k",
                            "allowed": 10, "remaining": 3}
    quotas.charge_batch("k", 3)  # the refused 4 were not counted
    with pytest.raises(RpcError):
        quotas.charge_batch("k", 1)
    quotas.charge_batch(None, 10_000)  # keyless and unlisted keys are unlimited
    quotas.charge_batch("other", 10_000)


@pytest.mark.anyio
async def test_a_new_day_gives_the_allowance_back() -> None:
    clock = ManualClock(start=0.0, wall=86_400 * 20_000 + 86_000)
    quotas = Quotas(clock, {"k": Quota(batch_calls_per_day=2)})
    quotas.charge_batch("k", 2)
    await clock.advance(401)
    quotas.charge_batch("k", 2)
