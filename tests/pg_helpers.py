"""A throwaway PostgreSQL database per test, on the machine's server (skipped where there is none).

Each test's tables and schemas live in its own database, dropped when it ends; every name
handed out is recorded so the conftest can check at the end of the session that none is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

PG_ADMIN = os.environ.get("MX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
ISSUED: list[str] = []  # every database name handed out in this process


@contextlib.contextmanager
def admin() -> Iterator[Any]:
    """An autocommit connection to the test database; the test is skipped where there is none."""
    try:
        import psycopg
    except ImportError:
        pytest.skip("psycopg is not installed (pip install -e '.[dev]')")
    try:
        conn = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        print(f"SKIP: no PostgreSQL at {PG_ADMIN}: {e}")
        pytest.skip(f"no PostgreSQL at {PG_ADMIN}")
    try:
        yield conn
    finally:
        conn.close()


@contextlib.contextmanager
def throwaway_db() -> Iterator[str]:
    """The URL of a new, empty database, dropped afterwards."""
    with admin() as conn:
        name = "mxtest_" + secrets.token_hex(6)
        ISSUED.append(name)
        conn.execute(f"CREATE DATABASE {name}")
        try:
            yield PG_ADMIN.rsplit("/", 1)[0] + "/" + name
        finally:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def throwaway_schema() -> Iterator[tuple[str, str, Any]]:
    """(the test database's URL, a schema name of our own, an admin connection); the schema and
    everything in it are dropped afterwards."""
    with admin() as conn:
        name = "mxtest_" + secrets.token_hex(6)
        try:
            yield PG_ADMIN, name, conn
        finally:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def _asked(sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]] | None:
    """The rows of one query to the shared test database; None where there is no server to ask."""
    try:
        import psycopg
    except ImportError:
        return None
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3) as conn:
            return conn.execute(sql, args).fetchall()
    except psycopg.OperationalError:
        return None


def extensions() -> set[str] | None:
    """The extensions of the shared test database (None where there is no server to ask): a
    gateway on it adds pg_trgm for its request log's index (``records/request_store.py``)."""
    rows = _asked("SELECT extname FROM pg_extension")
    return None if rows is None else {row[0] for row in rows}


def drop_extensions(names: set[str]) -> list[str]:
    """Drop these extensions from the shared test database, each only where nothing uses it
    any longer (no CASCADE: another run's tables keep theirs); the ones left, with why."""
    import psycopg

    left: list[str] = []
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3) as conn:
        for name in sorted(names):
            try:
                conn.execute(f"DROP EXTENSION IF EXISTS {name}")
            except psycopg.Error as e:
                left.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0]})")
    return left


def databases_left(names: list[str]) -> list[str] | None:
    """Which of these databases still exist; None where there is no server to ask."""
    rows = _asked("SELECT datname FROM pg_database WHERE datname = ANY(%s)", (names,))
    return None if rows is None else sorted(row[0] for row in rows)
