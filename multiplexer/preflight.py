"""Start-up checks: every store and state the config names is reached once before the gateway
runs anything.

Found later, a wrong ``store.url`` surfaces in a task (the /v1 face's retention sweep, a job
manager) after the gateway already listens, as an exception group whose one useful line is
buried or lost to a cancel. Here it is one ``StartupError`` (``<setting> <url>: <problem>;
<fix>``), which the CLI prints as one line. The parent of ``serve --workers N`` runs these
before it starts a worker; each gateway (``server.running``) runs them again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio

from multiplexer.access.keystore import open_store
from multiplexer.core.startup import StartupError
from multiplexer.core.state import StateUnavailable
from multiplexer.gateway.config import Config, StateConfig, StoreConfig
from multiplexer.gateway.replicas import open_state


async def check_services(config: Config) -> None:
    """The job store (also the key store's and spend's database) and the shared state, reachable
    and usable as configured; raises ``StartupError`` naming the setting otherwise."""
    await anyio.to_thread.run_sync(check_store, config.store)
    if config.state.url is not None:
        await check_state(config.state)


def check_store(store: StoreConfig) -> None:
    """``store.url``: one connection (a missing database, a refused connection, an unknown role
    each raise with the fix); else ``store.path``: a file SQLite can write, in a folder it can
    write (its journal lies beside it), made here on first use (the default, in the user's data
    directory, may not exist yet), so each part that opens the file finds its folder."""
    if store.url is not None:
        from multiplexer.jobs.pg_connect import connect  # psycopg only where store.url asks for it

        connect(store.url).close()
        return
    problem = sqlite_problem(Path(store.path))
    if problem is not None:
        raise StartupError("store.path", str(store.path), problem)
    Path(store.path).parent.mkdir(parents=True, exist_ok=True)


def sqlite_problem(path: Path) -> str | None:
    """Why the SQLite file at ``path`` could not be written, or None. Nothing is created: a folder
    still to be made needs its nearest existing one to be writable (the store makes it)."""
    if path.is_dir():
        return "a folder, not a file; choose another store.path"
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder; choose another store.path"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable by this user; choose another store.path"
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return "not writable by this user; choose another store.path"
    return None


async def check_state(config: StateConfig) -> None:
    """One ``PING`` of ``state.url``: not the engine's own start, whose heartbeat counts this
    process as a replica for a lease (the parent of ``serve --workers N`` serves nothing). Only a
    failed ping asks ``start``, for the one line the gateway itself would give."""
    state = open_state(config)
    assert state is not None
    try:
        try:
            await state.ping()
        except StateUnavailable:
            await state.start()  # raises StartupError("state.url", ...) with the reason and the fix
    finally:
        await state.aclose()


def live_keys(config: Config) -> int:
    """Stored keys a caller could present now (neither revoked nor expired): with none, callers
    are served without a key until one is made."""
    store = open_store(config.store.path, config.store.url, config.store.schema_)
    try:
        now = time.time()
        return sum(1 for row in store.keys(live_only=True)
                   if row.expires_at is None or row.expires_at > now)
    finally:
        store.close()
