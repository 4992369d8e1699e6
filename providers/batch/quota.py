"""The vendors' batch quotas: a part is submitted only when they have room for it.

Azure and Gemini count *enqueued tokens* per model until a batch ends; Gemini
also caps the batches running at once. A create over the quota fails (Azure:
fast, with 400 ``token_limit_exceeded``), so parts wait their turn instead:
``take_room`` counts this provider's batches not yet ended in the job store
(every replica sees the same) and marks the part submitting as it takes its
room; ``over_quota`` tells the part driver a refused create was the quota, to
wait and try again rather than fail the part.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import anyio

from multiplexer.core.errors import RpcError
from multiplexer.core.jobrows import PartRow

from .backend import quotas_of

if TYPE_CHECKING:
    from multiplexer.core.provider import ProviderContext
    from multiplexer.jobs.store import JobStore

    from .backend import BatchApiSettings, BatchBackend


class Driver(Protocol):
    """What of the part driver (``parts.PartDriver``) waiting for room uses."""

    ctx: ProviderContext
    name: str
    settings: BatchApiSettings
    backend: BatchBackend | None
    _admit: anyio.Lock

    def store(self) -> JobStore: ...

    async def _cancelling(self, job_id: str) -> bool: ...

    async def _sleep(self, seconds: float) -> None: ...

log = logging.getLogger(__name__)

QUOTA_CODES = frozenset({"token_limit_exceeded"})  # Azure: enqueued tokens over the quota


def over_quota(error: RpcError) -> bool:
    """The vendor refused a create because its batch quota is full now: the part waits and
    tries again, it is not rejected."""
    data = error.data or {}
    return data.get("upstream_code") in QUOTA_CODES or any(
        code in str(data.get("detail", "")) for code in QUOTA_CODES)


async def take_room(driver: Driver, part: PartRow) -> bool:
    """Wait until the vendor's quotas have room for the part: batches not yet ended
    (``max_active_batches``) and their enqueued tokens per model (``max_enqueued_tokens``).
    True once the part is marked submitting; False if its job was cancelled meanwhile.

    One part of a process looks and claims at a time (``driver._admit``). Replicas may both take
    the last room at once; a vendor that then refuses the create makes the part wait (see
    ``over_quota``). A part alone over the token quota goes when nothing else is queued
    (planning keeps parts under it)."""
    backend = driver.backend
    assert backend is not None
    max_active, max_tokens = quotas_of(backend)
    if max_active is None and max_tokens is None:
        return True
    st = driver.store()
    waited = False
    while True:
        async with driver._admit:
            active, queued, mine = await st.run(st.enqueued, driver.name, part.id)
            if (max_active is None or active < max_active) and (
                    max_tokens is None or queued == 0 or queued + mine <= max_tokens):
                await st.run(st.mark_submitting, part.id, time.time())  # counted from now
                if waited:
                    log.info("%s: batch part %s has room now", driver.name, part.id)
                return True
        if await driver._cancelling(part.job_id):
            return False
        if not waited:
            waited = True
            driver.ctx.metrics.events.labels(driver.name, "batch_waits_for_quota").inc()
            log.info("%s: batch part %s waits for the vendor's quota (%d batch(es), %d tokens "
                     "queued; this part %d)", driver.name, part.id, active, queued, mine)
        await driver._sleep(driver.settings.batch_poll_interval_s)
