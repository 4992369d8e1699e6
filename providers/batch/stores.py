"""Which job store a process uses, opened once and shared by its providers and the job face."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .store import JobStore

_shared: dict[Any, tuple[JobStore, int]] = {}


def acquire(path: str | Path, url: str | None = None, lease_s: float = 30.0) -> JobStore:
    """One connection per database and process, shared by its providers and the job face:
    PostgreSQL at ``url`` (several replicas) or the SQLite file at ``path``."""
    key: Any = url or Path(path).resolve()
    store, refs = _shared.get(key, (None, 0))
    if store is None:
        if url is not None:
            from .pg_store import PgJobStore  # psycopg only where store.url asks for it

            store = PgJobStore(url, lease_s)
        else:
            store = JobStore(key)
    _shared[key] = (store, refs + 1)
    return store


def release(store: JobStore) -> None:
    key = getattr(store, "url", None) or store.path.resolve()
    held, refs = _shared.get(key, (None, 0))
    if held is not store:
        return
    if refs <= 1:
        del _shared[key]
        store.close()
    else:
        _shared[key] = (store, refs - 1)
