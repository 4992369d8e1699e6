"""Where the semantic cache's answers outlive a process and reach the other replicas: one
append-only log of operations (an answer stored, answers deleted, a scope's threshold raised),
in Redis (a stream, with ``state.url``), else in the store's PostgreSQL database (with
``store.url``) or its SQLite file. Every replica replays it at start and reads what was appended
since every ``sync_ms``; entries carry their wall-clock expiry, so a replayed answer past its TTL
is never served."""

from __future__ import annotations

import base64
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import numpy as np

from multiplexer.cache.index import Entry
from multiplexer.core.json_codec import dumps, loads

PRUNE_EVERY = 256  # SQLite: expired operations deleted once per this many appends


def entry_op(entry: Entry) -> dict[str, Any]:
    vector = None if entry.vector is None else \
        base64.b64encode(entry.vector.astype(np.float16).tobytes()).decode()
    return {"op": "put", "id": entry.id, "scope": entry.scope, "route": entry.route,
            "neighbourhood": entry.neighbourhood, "exact": entry.exact, "text": entry.text,
            "result": entry.result, "request_id": entry.request_id, "expires": entry.expires,
            "vector": vector}


def entry_of(op: dict[str, Any]) -> Entry:
    raw = op.get("vector")
    vector = None if raw is None else \
        np.frombuffer(base64.b64decode(raw), dtype=np.float16).astype(np.float32)
    return Entry(op["id"], op["scope"], op["route"], op["neighbourhood"], op["exact"], op["text"],
                 op["result"], op.get("request_id"), float(op["expires"]), vector)


class CacheLog(Protocol):
    async def start(self) -> list[dict[str, Any]]: ...  # every operation kept, oldest first
    async def append(self, ops: Sequence[dict[str, Any]]) -> None: ...
    async def since(self) -> list[dict[str, Any]]: ...  # what was appended since the last read
    async def aclose(self) -> None: ...


class RedisLog:
    """The log as a Redis stream (``<prefix>:semantic_cache``), trimmed to the longest TTL: an
    operation older than every answer it could concern is dropped (stream ids are times)."""

    def __init__(self, url: str, prefix: str, block_ms: float, keep_s: float = 7 * 86400) -> None:
        import redis.asyncio as redis

        self.redis = redis.from_url(url)
        self.key = f"{prefix}:semantic_cache"
        self.block_ms = int(block_ms)
        self.keep_s = keep_s
        self.last = "0-0"

    async def start(self) -> list[dict[str, Any]]:
        rows: Any = await self.redis.xrange(self.key, min="-", max="+")
        return await self._read(rows or [])

    async def _read(self, rows: list[Any]) -> list[dict[str, Any]]:
        out = []
        for rid, fields in rows:
            self.last = rid.decode() if isinstance(rid, bytes) else rid
            body = fields.get(b"op") if b"op" in fields else fields.get("op")
            if body is not None:
                out.append(loads(body))
        return out

    async def append(self, ops: Sequence[dict[str, Any]]) -> None:
        oldest = f"{int((time.time() - self.keep_s) * 1000)}-0"
        async with self.redis.pipeline(transaction=False) as pipe:
            for op in ops:
                pipe.xadd(self.key, {"op": dumps(op)}, minid=oldest, approximate=True)
            await pipe.execute()

    async def since(self) -> list[dict[str, Any]]:
        found: Any = await self.redis.xread({self.key: self.last}, block=self.block_ms, count=10_000)
        rows = [row for _, stream_rows in found or [] for row in stream_rows]
        return await self._read(rows)

    async def aclose(self) -> None:
        await self.redis.aclose()


class _PolledLog:
    """A log table read past the last sequence number every ``poll_s``: its reads and appends
    run on a worker thread, one at a time (one connection per log)."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.last = 0
        self.appended = 0
        self.lock = anyio.Lock()

    def _rows(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _append(self, ops: Sequence[dict[str, Any]]) -> None:
        raise NotImplementedError

    async def start(self) -> list[dict[str, Any]]:
        async with self.lock:
            return await anyio.to_thread.run_sync(self._rows)

    async def append(self, ops: Sequence[dict[str, Any]]) -> None:
        async with self.lock:
            await anyio.to_thread.run_sync(self._append, ops)

    async def since(self) -> list[dict[str, Any]]:
        await anyio.sleep(self.poll_s)
        async with self.lock:
            return await anyio.to_thread.run_sync(self._rows)


class SqliteLog(_PolledLog):
    """The log as a table of the store's SQLite file (``semantic_cache_log``), read by the
    workers of one machine and kept across restarts."""

    def __init__(self, path: Path, poll_s: float) -> None:
        super().__init__(poll_s)
        self.path = path
        self.db: sqlite3.Connection | None = None

    def _open(self) -> sqlite3.Connection:
        if self.db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS semantic_cache_log (seq INTEGER PRIMARY KEY "
                       "AUTOINCREMENT, body BLOB NOT NULL, expires REAL NOT NULL)")
            db.execute("DELETE FROM semantic_cache_log WHERE expires <= ?", (time.time(),))
            self.db = db
        return self.db

    def _rows(self) -> list[dict[str, Any]]:
        rows = self._open().execute("SELECT seq, body FROM semantic_cache_log WHERE seq > ? "
                                    "ORDER BY seq", (self.last,)).fetchall()
        if rows:
            self.last = rows[-1][0]
        return [loads(body) for _, body in rows]

    def _append(self, ops: Sequence[dict[str, Any]]) -> None:
        db = self._open()
        keep = time.time() + 7 * 86400  # deletions and raised thresholds: a week
        with db:
            db.executemany("INSERT INTO semantic_cache_log (body, expires) VALUES (?, ?)",
                           [(dumps(op), float(op.get("expires", keep))) for op in ops])
        self.appended += 1
        if self.appended % PRUNE_EVERY == 0:
            db.execute("DELETE FROM semantic_cache_log WHERE expires <= ?", (time.time(),))

    async def aclose(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


class PgLog(_PolledLog):
    """The log as a table of the store's PostgreSQL database (``semantic_cache_log`` in
    ``store.schema``), for replicas that share a database and no Redis. Each replica reads the
    rows past the last id it read, every ``sync_ms``. Appends take one transaction-scoped
    advisory lock, so ids become visible in the order they were given: a reader that has seen
    id n never later finds a row below n committed behind it."""

    LOCK = 7332  # the advisory lock of the log's appends (the job store's tables use 7331)

    def __init__(self, url: str, schema: str, poll_s: float) -> None:
        super().__init__(poll_s)
        self.url = url
        self.schema = schema
        self.conn: Any = None
        self.table = ""

    def _open(self) -> Any:
        if self.conn is None:
            import psycopg
            from psycopg import sql

            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
            schema = sql.Identifier(self.schema)
            table = sql.Identifier(self.schema, "semantic_cache_log")
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.LOCK,))  # one creates it
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
                conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (seq BIGSERIAL PRIMARY KEY, "
                                     "body BYTEA NOT NULL, expires DOUBLE PRECISION NOT NULL)")
                             .format(table))
            self.table = table.as_string(conn)
            conn.execute(f"DELETE FROM {self.table} WHERE expires <= %s", (time.time(),))
            self.conn = conn
        return self.conn

    def _rows(self) -> list[dict[str, Any]]:
        rows = self._open().execute(f"SELECT seq, body FROM {self.table} WHERE seq > %s "
                                    "ORDER BY seq", (self.last,)).fetchall()
        if rows:
            self.last = rows[-1][0]
        return [loads(bytes(body)) for _, body in rows]

    def _append(self, ops: Sequence[dict[str, Any]]) -> None:
        conn = self._open()
        keep = time.time() + 7 * 86400  # deletions and raised thresholds: a week
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.LOCK,))
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO {self.table} (body, expires) VALUES (%s, %s)",
                                [(dumps(op), float(op.get("expires", keep))) for op in ops])
        self.appended += 1
        if self.appended % PRUNE_EVERY == 0:
            conn.execute(f"DELETE FROM {self.table} WHERE expires <= %s", (time.time(),))

    async def aclose(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await anyio.to_thread.run_sync(conn.close)
