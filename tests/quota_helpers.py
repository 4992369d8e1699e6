"""What a request asked of its key's quota: the claims that reached the one quota decision."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from multiplexer.core.clock import ManualClock
from multiplexer.core.quota import Claim, Quotas

T = TypeVar("T")


def request_claim(identity: str) -> Claim:
    """A request's one charge: a call of the key (rpm, concurrency), no batch calls."""
    return Claim(identity)


def batch_claim(identity: str, calls: int) -> Claim:
    """A job's charge for its calls against the key's ``batch_calls_per_day``."""
    return Claim(identity, call=False, batch_calls=calls)


class Claims:
    """Every claim ``quotas.decide`` is asked that asks something (a job sealed with no new calls
    asks for none), in order, from the moment it is made."""

    def __init__(self, quotas: Quotas) -> None:
        self.seen: list[Claim] = []
        decide = quotas.decide

        async def spy(claims: Any) -> Any:
            self.seen += [c for c in claims if c is not None and (c.call or c.batch_calls)]
            return await decide(claims)

        quotas.decide = spy  # type: ignore[method-assign]

    async def of(self, request: Awaitable[T]) -> tuple[T, list[Claim]]:
        """The request's answer and the claims made while it ran (nothing else may claim meanwhile)."""
        before = len(self.seen)
        answer = await request
        return answer, self.seen[before:]


def frozen(quotas: Quotas) -> ManualClock:
    """The quotas' time stands still: an rpm of N allows exactly N requests, whatever the test's pace."""
    clock = quotas.clock = ManualClock()
    return clock
