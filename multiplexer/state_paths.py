"""Where a gateway's state lives, in an operator's words: ``serve``'s first line and ``multiplexer paths``.

Keys, teams, the audit log, spend, budget counters, batch jobs and ``/v1`` files share one
database: SQLite at ``store.path`` (by default in the user's data directory), or PostgreSQL at
``store.url``. Uploads in progress wait on disk beside ``store.path`` either way; local models keep
their compile verdicts in the user's cache. A URL is shown with its password hidden.
"""

from __future__ import annotations

import logging
from pathlib import Path

from multiplexer.core.paths import verdict_file
from multiplexer.core.startup import shown_url
from multiplexer.faces.v1.file_store import uploads_beside
from multiplexer.gateway.config import Config, StoreConfig

log = logging.getLogger(__name__)


def store_shown(store: StoreConfig) -> str:
    """The store's SQLite file, or its PostgreSQL URL (password hidden) and schema."""
    if store.url is not None:
        return f"{shown_url(store.url)} (schema {store.schema_})"
    return store.path


def log_where_state_lives(config: Config) -> None:
    """One line, before the gateway starts anything: an operator who started ``serve`` in some
    folder learns at once which keys, spend and jobs it serves."""
    log.info("keys, spend and jobs in %s", store_shown(config.store))


def state_paths(config: Config, config_file: str | Path) -> list[tuple[str, str]]:
    """(what, where) for each place the gateway reads or writes with ``config``: the file itself,
    the store, the uploads folder and, where the config has a local model, the compile verdicts."""
    rows = [("config", str(Path(config_file).resolve())), ("store", store_shown(config.store)),
            ("uploads", str(uploads_beside(config.store.path)))]
    if any(provider.kind == "local" for provider in config.providers.values()):
        rows.append(("verdicts", str(verdict_file())))
    return rows
