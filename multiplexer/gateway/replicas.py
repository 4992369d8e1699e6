"""Composing shared state (``state.url``): one engine per gateway, a shared limiter per provider.

Kept out of ``gateway.py`` so the single-gateway path reads as before: without
``state.url`` none of this runs and nothing is imported.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import anyio

from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.dedup import canonical
from multiplexer.core.limiter import Limiter, RateLimiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig
from multiplexer.core.quota import Quotas
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.core.shared_quota import SharedQuotas
from multiplexer.core.state import LimitSpec, SharedState, StateUnavailable
from multiplexer.gateway.config import Config, StateConfig

Execute = Callable[[str, Sequence[Item]], Awaitable[list[Outcome]]]


class CachedOutcome(Outcome):
    """An answer from the shared cache: a replica keeps it no longer than it had left there."""

    __slots__ = ("ttl_s",)

    def __init__(self, result: Any, ttl_s: float) -> None:
        super().__init__(result=result)
        self.ttl_s = ttl_s


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
    quotas = config.server.quotas
    if state is None or not quotas:
        return Quotas(clock, quotas)
    return SharedQuotas(clock, quotas, state, fail_open=config.state.on_failure == "open",
                        degraded=metrics.state_degraded_count)


def flown(state: SharedState | None, execute: Execute, metrics: Metrics) -> Execute:
    """``execute`` as a single flight across replicas for items that carry a dedup key.

    Each keyed item is claimed in the shared state: a cached result answers it, a won
    claim runs it here (and publishes the result, or frees the key on error), a held
    claim waits for the replica that runs it. If that replica dies or fails, its claim
    ends without a result and a waiting replica runs the call itself, so every caller
    still gets one answer. Unreachable state: the call runs here (counted).
    """
    if state is None:
        return execute
    degraded = metrics.state_degraded_count

    async def run(operation: str, items: Sequence[Item]) -> list[Outcome]:
        if not any(item.flight for item in items):
            return await execute(operation, items)
        tokens: dict[int, str] = {}  # the claims won here, until each is settled
        try:
            return await fly(operation, items, tokens)
        except BaseException:  # no outcome from here (cancelled, failed): free the keys for the others
            with anyio.CancelScope(shield=True):
                for i, token in tokens.items():
                    with contextlib.suppress(StateUnavailable):
                        await state.abandon(items[i].flight[0], token)  # type: ignore[index]
            raise

    async def fly(operation: str, items: Sequence[Item], tokens: dict[int, str]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(items)
        mine: list[int] = []
        theirs: dict[int, str] = {}
        for i, item in enumerate(items):
            if item.flight is None:
                mine.append(i)
                continue
            token = secrets.token_hex(8)
            try:
                kind, value = await state.claim(item.flight[0], token)
            except StateUnavailable:
                degraded("dedup")
                mine.append(i)
                continue
            if kind == "won":
                mine.append(i)
                tokens[i] = token
                continue
            metrics.dedup_hits.labels(item.route, "replica_cache" if kind == "cached" else "replica").inc()
            if kind == "cached":
                out[i] = CachedOutcome(*value)
            else:
                theirs[i] = value

        async def lead() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_claims, [(items[i].flight[0], t)  # type: ignore[index]
                                            for i, t in tokens.items()])
                done = await execute(operation, [items[i] for i in mine])
                tg.cancel_scope.cancel()
            for i, outcome in zip(mine, done, strict=True):
                out[i] = outcome
                if i in tokens:
                    await settle_claim(items[i], tokens[i], outcome)
                    del tokens[i]

        async def follow(i: int, token: str) -> None:
            key = items[i].flight[0]  # type: ignore[index]
            poll = 0.002
            while True:
                try:
                    ready, value = await state.result(key, token)
                except LookupError:  # its replica died or failed: run it here, once more claimed
                    out[i] = (await run(operation, [items[i]]))[0]
                    return
                except StateUnavailable:
                    degraded("dedup")
                    out[i] = (await execute(operation, [items[i]]))[0]
                    return
                if ready:
                    out[i] = Outcome(result=value)
                    return
                await anyio.sleep(poll)
                poll = min(poll * 2, 0.05)

        async def keep_claims(claims: list[tuple[str, str]]) -> None:
            while claims:
                await anyio.sleep(state.lease_s / 3)
                for key, token in claims:
                    with contextlib.suppress(StateUnavailable):
                        await state.keep(key, token)

        async def settle_claim(item: Item, token: str, outcome: Outcome) -> None:
            key, cache_ttl = item.flight  # type: ignore[misc]
            try:
                if outcome.ok:
                    await state.publish(key, token, outcome.result, cache_ttl)
                else:
                    await state.abandon(key, token)
            except (TypeError, ValueError):  # a result JSON cannot carry: the others run it
                await state.abandon(key, token)
            except StateUnavailable:
                degraded("dedup")

        async with anyio.create_task_group() as tg:
            if mine:
                tg.start_soon(lead)
            for i, token in theirs.items():
                tg.start_soon(follow, i, token)
        return out  # type: ignore[return-value]

    return run


def flight_key(key: Hashable) -> str:
    """The dedup key as replicas share it: a digest of what makes two calls the same."""
    return canonical(repr(key))
