"""Composing shared state (``state.url``): one engine per gateway, a shared limiter per provider.

Kept out of ``gateway.py`` so the single-gateway path reads as before: without
``state.url`` none of this runs and nothing is imported.
"""

from __future__ import annotations

from multiplexer.core.clock import Clock
from multiplexer.core.limiter import Limiter, RateLimiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig
from multiplexer.core.quota import Quotas
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.shared_quota import SharedQuotas
from multiplexer.core.state import LimitSpec, SharedState
from multiplexer.gateway.config import Config, StateConfig
from multiplexer.gateway.flights import Flights, SharedFlights, Spawn


def open_state(config: StateConfig) -> SharedState | None:
    if config.url is None:
        return None
    from multiplexer.gateway.registry import state_class

    cls = state_class(config.url)
    return cls(config.url, prefix=config.prefix, lease_s=config.lease_s,
               timeout_s=config.timeout_ms / 1000.0)


def limiter_for(name: str, pconf: ProviderConfig, clock: Clock, state: SharedState | None,
                metrics: Metrics) -> Limiter:
    """The provider's one limiter (rpm, tpm, concurrency), in this process or shared."""
    limits = pconf.limits
    if state is None:
        return RateLimiter(clock, limits.rpm, limits.tpm, limits.concurrency)
    spec = LimitSpec(limits.rpm or 0.0, limits.tpm or 0.0, limits.concurrency)
    return SharedLimiter(clock, name, spec, state, on_degraded=metrics.state_degraded_count)


def quotas_for(config: Config, clock: Clock, state: SharedState | None, metrics: Metrics) -> Quotas:
    from multiplexer.access.compose import keyed_quotas

    quotas = dict(config.server.quotas)  # stored keys' limits join these while the gateway runs
    if state is None or not (quotas or keyed_quotas(config)):
        return Quotas(clock, quotas)
    return SharedQuotas(clock, quotas, state, fail_open=config.state.on_failure == "open",
                        degraded=metrics.state_degraded_count)


def flights_for(state: SharedState | None, clock: Clock, metrics: Metrics, spawn: Spawn) -> Flights:
    """Single flight in this process, or across the replicas that share ``state``."""
    if state is None:
        return Flights()
    return SharedFlights(state, clock, metrics, spawn)
