"""A connection to a table beside the job store's in its SQLite file (spend, budget counters, the
request log, MCP tool pins and audit): one opener, as ``pg_connect.connect`` is for PostgreSQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect(path: str | Path) -> sqlite3.Connection:
    """Autocommit (each writer says BEGIN where it batches), shared by the writer's thread and the
    loop's, waiting up to 30 s for another process's write; WAL, and no fsync per commit: a table
    written a batch at a time may lose its last batch to a power cut, as a crash loses what is still
    in memory (WAL keeps the file consistent either way)."""
    conn = sqlite3.connect(str(path), timeout=30, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn
