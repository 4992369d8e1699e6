"""Expired files deleted (``expires_after``, ``server.files.batch_expires_s``), in small steps.

An expired file is not served from the moment it expires (the store's reads leave it out); the
sweep only reclaims its space: every ``server.files.sweep_s``, ``sweep_step`` files at a time,
each in its own transaction, so a sweep of many files never holds the store for long. It also
removes uploads that never finished (their gateway went away mid-upload): their rows and chunks,
and their temporary files beside the store. A batch still running on an expired input file keeps
that file's request bodies first, as it does when its owner deletes the file.
"""

from __future__ import annotations

import logging
import time

import anyio

from multiplexer.access.settings import FilesSettings
from multiplexer.faces.v1.batch_run import Batches
from multiplexer.faces.v1.file_store import STALE_S, expired_too
from multiplexer.faces.v1.store import V1Store
from multiplexer.faces.v1.upload_form import clear_stale

log = logging.getLogger(__name__)


async def sweep_files(store: V1Store, batches: Batches, step: int) -> int:
    """Delete every file due now, ``step`` at a time; how many were deleted."""
    deleted = 0
    while due := await store.files_due(step):
        for file_id, owner in due:
            with expired_too():
                await batches.keep_bodies(file_id, owner)
            await store.delete_file(file_id)
        deleted += len(due)
        await anyio.sleep(0)  # between steps, the store's other callers go first
    return deleted


async def sweep_forever(store: V1Store, batches: Batches, settings: FilesSettings) -> None:
    while True:
        if store.exists():
            try:
                if gone := await sweep_files(store, batches, settings.sweep_step):
                    log.info("deleted %d expired or unfinished files", gone)
            except Exception:  # the database is away for now: asked again on the next sweep
                log.exception("sweeping expired files failed")
        await anyio.to_thread.run_sync(clear_stale, store.uploads, time.time() - STALE_S)
        await anyio.sleep(settings.sweep_s)
