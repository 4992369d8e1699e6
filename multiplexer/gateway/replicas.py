"""Composing shared state (``state.url``): one engine per gateway, a shared limiter per provider.

Kept out of ``gateway.py`` so the single-gateway path reads as before: without
``state.url`` none of this runs and nothing is imported.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.limiter import RateLimiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.state import LimitSpec, SharedState
from multiplexer.gateway.config import StateConfig

Execute = Callable[[str, Sequence[Item]], Awaitable[list[Outcome]]]


def open_state(config: StateConfig) -> SharedState | None:
    if config.url is None:
        return None
    from multiplexer.gateway.registry import state_class

    cls = state_class(config.url)
    return cls(config.url, prefix=config.prefix, lease_s=config.lease_s,  # type: ignore[no-any-return]
               timeout_s=config.timeout_ms / 1000.0)


def limiter_for(name: str, pconf: ProviderConfig, clock: Clock, state: SharedState | None,
                metrics: Metrics) -> RateLimiter:
    limits = pconf.limits
    if state is None:
        return RateLimiter(clock, limits.rpm, limits.tpm)
    spec = LimitSpec(limits.rpm or 0.0, limits.tpm or 0.0, limits.concurrency)
    degraded = metrics.state_degraded

    def count(part: str) -> None:
        degraded.labels(part).inc()

    return SharedLimiter(clock, name, spec, state, on_degraded=count)


def gated(limiter: RateLimiter, execute: Execute) -> Execute:
    """``execute`` behind the shared limits: reserve before the batch, settle after it."""
    if not isinstance(limiter, SharedLimiter):
        return execute

    async def run(operation: str, items: Sequence[Item]) -> list[Outcome]:
        lease = await limiter.acquire(sum(max(i.tokens, 0) for i in items))
        try:
            return await execute(operation, items)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled batch still frees its slot
                await limiter.release(lease)

    return run
