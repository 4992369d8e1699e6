"""The job manager for ``kind: gemini``: the shared one, plus two things Gemini needs.

- Inline batch results come back by position: the backend asks the job store for the part's
  custom ids in input order (the order they were uploaded in), so a restarted gateway, or
  another replica, matches them as the one that submitted would.
- Only ``generateContent`` goes to the Batch API (its embeddings batches are experimental): a
  part of other calls runs through the synchronous endpoints, kept durable the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gemini_batch import GeminiBatchBackend
from .jobs import JobManager

if TYPE_CHECKING:
    from multiplexer.core.provider import ProviderContext

    from .backend import BatchApiSettings, BatchBackend
    from .sync_fallback import SyncFallback

BATCHED = frozenset({"chat"})


class GeminiJobManager(JobManager):
    def __init__(self, ctx: ProviderContext, settings: BatchApiSettings,
                 backend: BatchBackend | None, sync: SyncFallback) -> None:
        super().__init__(ctx, settings, backend, sync)
        if isinstance(self.backend, GeminiBatchBackend):
            self.backend.order = self.part_order
            self.backend.stopped = self.part_stopped

    async def part_order(self, part_id: str) -> list[str]:
        st = self.store()
        return [row.custom_id for row in await st.run(st.part_items, part_id)]

    async def part_stopped(self, part_id: str) -> bool:
        st = self.store()
        part = await st.run(st.part, part_id)
        return part is None or await self._cancelling(part.job_id)

    async def _drive_part(self, part_id: str) -> None:
        if self.backend is not None and await self._live_part(part_id):
            part = await self.store().run(self.store().part, part_id)
            assert part is not None
            await self._run_sync(part)
            return
        await super()._drive_part(part_id)

    async def _live_part(self, part_id: str) -> bool:
        """Whether a part runs through the live endpoints: one already doing so (``sync``), or
        one not yet submitted that holds calls the Batch API does not take. A part already on
        the Batch API is not read again (its requests may be 50,000 bodies)."""
        st = self.store()
        part = await st.run(st.part, part_id)
        if part is None or part.state == "done":
            return False
        if part.state == "submitted":
            return part.remote_id == "sync"
        rows = await st.run(st.part_items, part_id, True)
        return any(row.operation not in BATCHED for row in rows)
