"""Composing keys as data for a gateway: the directory from config, the store, its probe and
invalidation opened while it runs. Kept here so the gateway's own file only names them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from multiplexer.access.admin import AdminKey
from multiplexer.access.admin_ops import KeyAdmin
from multiplexer.access.directory import KeyDirectory
from multiplexer.access.entries import entry
from multiplexer.access.invalidation import Invalidation
from multiplexer.access.keystore import open_store
from multiplexer.access.probe import StoreProbe
from multiplexer.core.quota import Quotas


def key_store_on(config: Any) -> bool:
    """Stored keys are consulted when ``server.key_store.enabled`` says so, else when an admin key
    is set (the admin API is the only way to make them)."""
    enabled = config.server.key_store.enabled
    return AdminKey(config.server.admin_key).enabled if enabled is None else bool(enabled)


def keyed_quotas(config: Any) -> bool:
    """Whether per-key quotas may exist beyond ``server.quotas`` (keys with their own limits)."""
    return key_store_on(config) or any(
        e.rpm is not None or e.tpm is not None or e.concurrency is not None
        for e in map(entry, config.server.api_keys.values())) or any(
        t.rpm is not None or t.tpm is not None or t.concurrency is not None
        for t in config.server.teams.values())


def directory_for(config: Any, quotas: Quotas) -> KeyDirectory:
    return KeyDirectory(config.server.api_keys, config.server.teams, quotas, config.server.key_store)


def shared_store(config: Any) -> bool:
    """Whether other processes may write keys to this gateway's store: the workers of
    ``serve --workers N`` (one SQLite file), or replicas on PostgreSQL (``store.url``). Only then
    may a snapshot be older than the store, so only then is the store asked on the hot path
    (``probe.py``); a lone process reloads after each of its own writes before it answers."""
    return config.server.worker_count() > 1 or config.store.url is not None


@asynccontextmanager
async def keys_running(directory: KeyDirectory, config: Any) -> AsyncIterator[None]:
    """The store opened and loaded, reloads and invalidations running, while the gateway runs."""
    if not key_store_on(config):
        yield
        return
    store_cfg = config.store
    store = await anyio.to_thread.run_sync(open_store, store_cfg.path, store_cfg.url, store_cfg.schema_)
    directory.store = store
    invalidation = None
    try:
        if shared_store(config):  # alone on its store, this process's own writes reload it first
            directory.probe = await anyio.to_thread.run_sync(
                StoreProbe, store_cfg.path, store_cfg.url, store_cfg.schema_)
        await directory.load()
        async with anyio.create_task_group() as tg:
            if config.state.url is not None:
                invalidation = Invalidation(config.state.url, config.state.prefix, directory.changed)
                directory.announcers.append(invalidation.publish)
                tg.start_soon(invalidation.listen_forever)
            tg.start_soon(directory.refresh_forever)
            directory.admin = KeyAdmin(store, directory, config.server.key_store.grace_s,
                                       directory.announce)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
    finally:
        directory.admin = None
        if invalidation is not None:
            directory.announcers.remove(invalidation.publish)
            with anyio.CancelScope(shield=True):
                await invalidation.aclose()
        if directory.probe is not None:
            directory.probe.close()
            directory.probe = None
        await anyio.to_thread.run_sync(store.close)
