"""Retries with tenacity that honour Retry-After and never run past a deadline."""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError

T = TypeVar("T")


class Retryable(Exception):
    """A transient upstream failure; ``final`` is what the caller sees if retries run out."""

    def __init__(self, final: RpcError, retry_after: float | None = None) -> None:
        super().__init__(final.message)
        self.final = final
        self.retry_after = retry_after


async def with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    clock: Clock,
    deadline: float | None,
    attempts: int = 3,
    base_wait: float = 0.05,
    max_wait: float = 5.0,
    on_retry: Callable[[Retryable], None] | None = None,
) -> T:
    """Run ``fn``; on ``Retryable`` wait (Retry-After wins over backoff) and try again.

    Gives up with the last error when attempts run out or the next wait would pass
    ``deadline``.
    """
    try:  # the common case: one attempt, without tenacity's per-attempt bookkeeping
        return await fn()
    except Retryable as e:
        first: Retryable = e
    end = math.inf if deadline is None else deadline
    backoff = wait_exponential_jitter(initial=base_wait, max=max_wait, jitter=base_wait)

    def wait_for(exc: BaseException | None, state: RetryCallState | None) -> float:
        if isinstance(exc, Retryable) and exc.retry_after is not None:
            return min(exc.retry_after, 60.0)
        return backoff(state) if state is not None else base_wait + random.uniform(0, base_wait)

    def wait(state: RetryCallState) -> float:
        return wait_for(state.outcome.exception() if state.outcome else None, state)

    def stop(state: RetryCallState) -> bool:
        # attempt 1 already ran before tenacity took over
        return state.attempt_number + 1 >= attempts or clock.now() + wait(state) >= end

    async def sleep(seconds: float) -> None:
        await clock.sleep_until(clock.now() + seconds)

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if on_retry and isinstance(exc, Retryable):
            on_retry(exc)

    first_wait = wait_for(first, None)
    if attempts <= 1 or clock.now() + first_wait >= end:
        raise first.final from None
    if on_retry:
        on_retry(first)
    await sleep(first_wait)
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(Retryable),
        wait=wait,
        stop=stop,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        async for attempt in retrying:
            with attempt:
                return await fn()
    except Retryable as e:
        raise e.final from None
    raise AssertionError("unreachable")
