"""``state.url`` and ``store.url`` are checked at start: one line naming the key, exit non-zero.

Against the machine's real Redis and PostgreSQL (and a port nothing listens on), not mocks.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from multiplexer.core.startup import StartupError, shown_url
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.jobs.pg_connect import why
from tests.pg_helpers import PG_ADMIN, admin
from tests.redis_helpers import free_port, redis_url

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
SERVER = PG_ADMIN.rsplit("/", 1)[0]  # postgresql://postgres@127.0.0.1:5432


def with_state(url: str) -> dict:
    return {"state": {"url": url}, "providers": {"e": {"kind": "echo"}},
            "routes": {"echo": {"provider": "e"}}}


def with_store(url: str) -> dict:
    """A provider with batch jobs opens the store at start (its base URL is never called)."""
    oai = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-test"}
    return {"store": {"url": url}, "providers": {"oai": oai},
            "routes": {"chat": {"provider": "oai", "operation": "chat"}}}


async def start_error(data: dict) -> str:
    with pytest.raises(StartupError) as err:
        async with Gateway(parse_config(data)):
            pass
    return str(err.value)


async def test_redis_nothing_listening() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert await start_error(with_state(url)) == f"state.url {url}: cannot connect (Connection refused)"


async def test_redis_refuses_the_password_and_the_line_hides_it() -> None:
    base = redis_url()
    url = base.replace("redis://", "redis://mx-nobody:s3cret@", 1)
    assert await start_error(with_state(url)) == (
        f"state.url {base.replace('redis://', 'redis://mx-nobody:***@', 1)}: authentication failed "
        "(invalid username-password pair or user is disabled.)")


async def test_postgres_nothing_listening() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/mx"
    assert await start_error(with_store(url)) == f"store.url {url}: cannot connect (Connection refused)"


async def test_postgres_database_missing_says_how_to_create_it() -> None:
    with admin():  # skips where there is no server
        pass
    name = "mxtest_missing_" + secrets.token_hex(4)
    url = f"{SERVER}/{name}"
    assert await start_error(with_store(url)) == (
        f'store.url {url}: database "{name}" does not exist; '
        f"create it with `createdb -h 127.0.0.1 -U postgres {name}`")


async def test_postgres_unknown_role() -> None:
    with admin():
        pass
    url = SERVER.replace("postgres@", "mx_nobody@", 1) + "/test"
    assert await start_error(with_store(url)) == f'store.url {url}: role "mx_nobody" does not exist'


def test_postgres_password_refused_names_the_fix() -> None:
    """What libpq says when the server asks for a password it does not accept (this machine's
    server trusts local connections, so the words are given)."""
    message = ('connection failed: connection to server at "db.internal" (10.0.0.5), port 5433 failed: '
               'FATAL:  password authentication failed for user "mx"\n')
    assert why(message, {"host": "db.internal", "port": "5433", "user": "mx", "dbname": "jobs"}) == (
        'password authentication failed for user "mx"; check the user and password in store.url')
    assert why('connection failed: connection to server at "h", port 5433 failed: FATAL:  database '
               '"jobs" does not exist', {"host": "h", "port": "5433", "user": "mx", "dbname": "jobs"}) == (
        'database "jobs" does not exist; create it with `createdb -h h -p 5433 -U mx jobs`')


def test_a_password_never_reaches_the_line() -> None:
    assert shown_url("postgresql://mx:pw@db:5432/jobs") == "postgresql://mx:***@db:5432/jobs"
    assert shown_url("redis://:pw@cache:6379/0") == "redis://:***@cache:6379/0"
    assert shown_url("redis://cache:6379/0") == "redis://cache:6379/0"


@pytest.mark.parametrize("key", ["state", "store"])
def test_serve_prints_one_line_and_exits_non_zero(tmp_path: Path, key: str) -> None:
    port = free_port()
    if key == "state":
        url = f"redis://127.0.0.1:{port}/0"
        config = with_state(url)
    else:
        url = f"postgresql://postgres@127.0.0.1:{port}/mx"
        config = with_store(url)
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "multiplexer", "serve", "--config", str(path),
                           "--port", "0"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"multiplexer serve: {key}.url {url}: cannot connect (Connection refused)"]
