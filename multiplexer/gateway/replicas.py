"""Composing shared state (``state.url``): one engine per gateway, a shared limiter per provider.

Kept out of ``gateway.py`` so the single-gateway path reads as before: without
``state.url`` none of this runs and nothing is imported.
"""

from __future__ import annotations

from multiplexer.core.clock import Clock
from multiplexer.core.limiter import Limiter, RateLimiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import Limits, ProviderConfig, Quota
from multiplexer.core.quota import Quotas
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.shared_quota import SharedQuotas
from multiplexer.core.state import LimitSpec, SharedState
from multiplexer.core.worker_quota import DayCounts, WorkerQuotas
from multiplexer.gateway.config import Config, StateConfig
from multiplexer.gateway.flights import Flights, SharedFlights, Spawn


def open_state(config: StateConfig) -> SharedState | None:
    if config.url is None:
        return None
    from multiplexer.gateway.registry import state_class

    cls = state_class(config.url)
    return cls(config.url, prefix=config.prefix, lease_s=config.lease_s,
               timeout_s=config.timeout_ms / 1000.0)


def _part(amount: int, share: int) -> int:
    """A whole-number limit split over ``share`` processes: never more than the limit in all,
    except that each keeps at least 1 (a limit below the worker count: docs/workers.md)."""
    return max(1, amount // share)


def share_of_limits(limits: Limits, share: int) -> Limits:
    """One worker's part of a provider's limits when ``share`` workers enforce them apart."""
    if share <= 1:
        return limits
    return limits.model_copy(update={
        "rpm": None if limits.rpm is None else limits.rpm / share,
        "tpm": None if limits.tpm is None else limits.tpm / share,
        "concurrency": _part(limits.concurrency, share)})


def share_of_quota(quota: Quota, share: int) -> Quota:
    """One worker's part of a key's quota when ``share`` workers enforce it apart; its daily batch
    allowance stays whole, decided for all of them in the store (``core/worker_quota.py``)."""
    if share <= 1:
        return quota
    return quota.model_copy(update={
        "rpm": None if quota.rpm is None else quota.rpm / share,
        "tpm": None if quota.tpm is None else quota.tpm / share,
        "concurrency": None if quota.concurrency is None else _part(quota.concurrency, share)})


def limiter_for(name: str, pconf: ProviderConfig, clock: Clock, state: SharedState | None,
                metrics: Metrics, share: int = 1) -> Limiter:
    """The provider's one limiter (rpm, tpm, concurrency), in this process or shared. ``share``:
    the worker processes of this gateway (``server.workers``); without shared state each
    enforces its part of the limits, never the whole."""
    limits = pconf.limits
    if state is None:
        limits = share_of_limits(limits, share)
        local = RateLimiter(clock, limits.rpm, limits.tpm, limits.concurrency)
        local.share = share  # its named limits (MCP tool_limits) are split the same way
        return local
    spec = LimitSpec(limits.rpm or 0.0, limits.tpm or 0.0, limits.concurrency)
    return SharedLimiter(clock, name, spec, state, on_degraded=metrics.state_degraded_count)


def quotas_for(config: Config, clock: Clock, state: SharedState | None, metrics: Metrics,
               share: int = 1) -> Quotas:
    """The keys' quotas, in this process (each worker's part of them: the config's and those the
    keys bring, stored ones too, with the daily batch allowance whole in the job store's SQLite
    file that the workers share) or shared."""
    from multiplexer.access.compose import keyed_quotas

    quotas = dict(config.server.quotas)  # stored keys' limits join these while the gateway runs
    if state is None or not (quotas or keyed_quotas(config)):
        if share <= 1:
            return Quotas(clock, quotas)
        return WorkerQuotas(clock, quotas, lambda q: share_of_quota(q, share),
                            DayCounts(config.store.path))
    return SharedQuotas(clock, quotas, state, fail_open=config.state.on_failure == "open",
                        degraded=metrics.state_degraded_count)


def flights_for(state: SharedState | None, clock: Clock, metrics: Metrics, spawn: Spawn) -> Flights:
    """Single flight in this process, or across the replicas that share ``state``."""
    if state is None:
        return Flights(clock)
    return SharedFlights(state, clock, metrics, spawn)
