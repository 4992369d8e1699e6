"""A throwaway PostgreSQL database per test, on the machine's server (skipped where there is none)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

PG_ADMIN = os.environ.get("MX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def admin() -> Iterator[Any]:
    """An autocommit connection to the test server's database (skip where there is none)."""
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
