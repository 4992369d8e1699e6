"""The contract of state shared by several gateway replicas (limits, quotas, dedup, cache).

In-process state is the default and needs none of this. With ``state.url`` set, the
composition root builds a ``SharedState`` (Redis, in ``multiplexer/backends/``) and gives each
provider a ``SharedLimiter`` (``core/shared_limiter.py``), the ``Limiter`` with its buckets here.
Every method may raise ``StateUnavailable``; callers then fall back to a degraded
local decision and count it, and try the shared state again on the next call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class StateUnavailable(Exception):
    """The shared state could not be reached or answered in time."""


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """A provider's configured limits; 0 means none. Learned limits live in the shared state."""

    rpm: float = 0.0
    tpm: float = 0.0
    concurrency: int = 0


@dataclass(frozen=True, slots=True)
class Learned:
    """One rate-limit header reading, as ``RateLimiter.observe`` takes it."""

    kind: str  # "requests" or "tokens"
    limit: float | None
    remaining: float
    reset_in: float


@dataclass(frozen=True, slots=True)
class Granted:
    """One round trip's answer for several waiters of a replica, asked in their order."""

    granted: int  # the first ``granted`` were taken, each all or none
    wait: float  # seconds until the next could be (the first not granted; else a lower bound)
    limit: str  # the limit that holds it: rpm, tpm or concurrency; "" when none does


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    """A key's admission in the shared state, and its rpm bucket as the decision left it."""

    wait: float  # 0: admitted; else seconds until it would be
    limit: str  # the limit that holds it (rpm, tpm or concurrency); "" when admitted
    level: float | None  # requests left in the rpm bucket after the decision; None without rpm
    at: float  # when it was taken, on the shared state's clock (orders concurrent decisions)
    tokens_level: float | None = None  # tokens left in the tpm bucket; None without tpm


class SharedState(Protocol):
    """Atomic decisions on the shared state's own clock; one round trip each."""

    replica_id: str
    lease_s: float
    timeout_s: float  # a round trip answers, or raises ``StateUnavailable``, within this

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def ping(self) -> None:
        """One round trip, for readiness; raises ``StateUnavailable``."""
        ...

    async def heartbeat_forever(self) -> None:
        """Say this replica is alive every ``lease_s / 3``, and learn how many are."""
        ...

    def live_replicas(self) -> int:
        """Replicas seen alive at the last heartbeat (at least 1): a degraded replica's share."""
        ...

    async def acquire(self, provider: str, lease_id: str, tokens: int,
                      spec: LimitSpec) -> tuple[float, str]:
        """Take one request, ``tokens`` and a concurrency slot, all or none: (0, "") when taken,
        else (seconds to wait, the limit that holds it: rpm, tpm or concurrency)."""
        ...

    async def acquire_many(self, provider: str, asks: Sequence[tuple[str, int]],
                           spec: LimitSpec) -> Granted:
        """``acquire`` for several waiters in one round trip, in order: each ask is (lease id,
        "" for none: no slot; tokens). Grants from the first on and stops at the first that
        must wait, whose wait it says (when all were granted: the least a next would wait)."""
        ...

    async def settle(self, provider: str, lease_id: str, token_delta: float,
                     learned: Sequence[Learned], spec: LimitSpec, requests: int = 0) -> None:
        """Free the slot, charge (or refund) ``token_delta``, give back ``requests`` granted and
        never sent, apply learned limits."""
        ...

    async def renew(self, provider: str, lease_ids: Sequence[str]) -> None:
        """Keep the slots of calls still running (a dead replica's expire after ``lease_s``)."""
        ...

    async def quota(self, identity: str, rpm: float, concurrency: int, lease_id: str, *,
                    tpm: float = 0.0, tokens: int = 0) -> QuotaDecision:
        """Admit one call for a key under its rpm, concurrency and (charging ``tokens``) tpm, all
        or none, in one round trip."""
        ...

    async def quota_release(self, identity: str, lease_id: str, token_delta: int = 0,
                            tpm: float = 0.0) -> None:
        """Free the call's slot (``lease_id``, "" none) and charge ``token_delta`` more (or give
        it back) to the key's tpm bucket."""
        ...

    async def quota_renew(self, identity: str, lease_ids: Sequence[str]) -> None: ...

    async def batch_charge(self, identity: str, day: int, calls: int, allowed: int) -> int:
        """Charge ``calls`` to the key's batch allowance for UTC ``day``, all or none; -1 when
        charged, else what is left."""
        ...

    async def claim(self, key: str, token: str) -> tuple[str, Any]:
        """Single flight across replicas: ("cached", (result, seconds it has left)), ("won",
        token): run it and ``publish``, or ("held", the running replica's token): wait for its
        ``result``."""
        ...

    async def publish(self, key: str, token: str, result: Any, cache_ttl_s: float) -> None: ...

    async def abandon(self, key: str, token: str) -> None:
        """The run failed: free the key (a waiting replica then runs it) and store nothing."""
        ...

    async def keep(self, key: str, token: str) -> bool:
        """Extend the flight's lease while it runs; False if it was lost."""
        ...

    async def result(self, key: str, token: str) -> tuple[bool, Any]:
        """(True, result) once published; (False, None) while the flight is held; raises
        ``LookupError`` when the flight ended without a result (its replica died or failed)."""
        ...

    async def wait(self, key: str, token: str, timeout_s: float) -> tuple[bool, Any]:
        """``result``, once the flight has ended (notified, not polled) or after ``timeout_s``:
        (False, None) then means it is still held (its replica keeps it alive)."""
        ...
