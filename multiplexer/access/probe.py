"""Two questions the hot path asks the key store itself, on a connection of its own.

A snapshot of the keys may be a moment old (another worker or replica wrote since), and two
answers must not come from one: whether the store has issued any key (a gateway without one
serves callers without a key), and whether a bearer the snapshot does not know is a key made
since. Both are one indexed read, asked synchronously where the answer is needed (about 4 us on
SQLite, one round trip on PostgreSQL). A connection of its own keeps them off the store's lock,
which a reload or an admin write may hold. A read that fails leaves the snapshot's answer for
that request; a lost PostgreSQL connection is opened again by ``mend`` (the reload loop's, off
the event loop), never on the hot path.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
TIMEOUT_MS = 500  # the longest a probe may hold the event loop (SQLite's busy wait, PostgreSQL's statement)
ANY_KEY = "SELECT EXISTS (SELECT 1 FROM access_keys)"
LIVE_DIGEST = "SELECT 1 FROM access_keys WHERE digest = {} AND revoked_at IS NULL"


class ProbeDown(Exception):
    """The store cannot be asked now: keep what the snapshot says."""


class StoreProbe:
    """The store's ``access_keys`` table read directly: SQLite at ``path``, or PostgreSQL at
    ``url`` in ``schema``."""

    def __init__(self, path: str | Path, url: str | None, schema: str) -> None:
        self.path, self.url, self.schema = path, url, schema
        self._any = ANY_KEY
        self._digest = LIVE_DIGEST.format("%s" if url else "?")
        self._conn: Any = None
        self._connect()

    def _connect(self) -> None:
        if self.url is None:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                                   timeout=TIMEOUT_MS / 1000)
        else:
            from psycopg import sql

            from multiplexer.jobs.pg_connect import connect

            conn = connect(self.url)
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            conn.execute(f"SET statement_timeout = {TIMEOUT_MS}")
        self._conn = conn

    @property
    def down(self) -> bool:
        return self._conn is None

    def _one(self, query: str, args: tuple[Any, ...] = ()) -> Any:
        if self._conn is None:
            raise ProbeDown("the key store's probe is reconnecting")
        try:
            return self._conn.execute(query, args).fetchone()
        except Exception as e:  # sqlite3 and psycopg alike: the store cannot answer now
            log.warning("the key store cannot be asked (%s); the loaded keys decide until it can",
                        str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            if getattr(self._conn, "broken", False) or getattr(self._conn, "closed", False):
                self.close()  # a lost PostgreSQL connection: ``mend`` opens another
            raise ProbeDown(str(e)) from None

    def any_key(self) -> bool:
        """Whether the store holds a key (revoked ones too: once issued, every call needs one)."""
        row = self._one(self._any)
        return bool(row and row[0])

    def live(self, digest_hex: str) -> bool:
        """Whether a key with this digest is in the store and not revoked."""
        return self._one(self._digest, (digest_hex,)) is not None

    def mend(self) -> None:
        """Reconnect after a failure (blocking: called in a worker thread)."""
        if self._conn is None:
            self._connect()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing more to do
                conn.close()
