"""Which job store a process uses, opened once and shared by its providers and the job face."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .store import JobStore

_shared: dict[Any, tuple[JobStore, int]] = {}
WORKER_ENV = "MULTIPLEXER_WORKER"  # set by `serve --workers N`'s supervisor in each worker


def sqlite_shared() -> bool:
    """Whether this process is one of several workers on one SQLite file (each part driven by
    the one worker that claims it: ``sqlite_shared.py``)."""
    return bool(os.environ.get(WORKER_ENV))


def acquire(path: str | Path, url: str | None = None, lease_s: float = 30.0,
            schema: str = "multiplexer") -> JobStore:
    """One connection per database and process, shared by its providers and the job face:
    PostgreSQL at ``url`` (several replicas; its tables in ``schema``) or the SQLite file at
    ``path``. A ``url`` that cannot be used raises ``StartupError``."""
    key: Any = (url, schema) if url else Path(path).resolve()
    store, refs = _shared.get(key, (None, 0))
    if store is None:
        if url is not None:
            from .pg_store import PgJobStore  # psycopg only where store.url asks for it

            store = PgJobStore(url, lease_s, schema=schema)
        elif sqlite_shared():
            from .sqlite_shared import SharedSqliteStore

            store = SharedSqliteStore(key, lease_s)
        else:
            store = JobStore(key)
    _shared[key] = (store, refs + 1)
    return store


def release(store: JobStore) -> None:
    url = getattr(store, "url", None)
    key = (url, getattr(store, "schema", None)) if url else store.path.resolve()
    held, refs = _shared.get(key, (None, 0))
    if held is not store:
        return
    if refs <= 1:
        del _shared[key]
        store.close()
    else:
        _shared[key] = (store, refs - 1)
