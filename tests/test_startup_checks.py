"""``state.url``, ``store.url`` and ``store.path`` are checked before anything runs: one line
naming the setting and the fix, exit 2, no traceback (``serve --workers N``'s parent too).

Against the machine's real Redis and PostgreSQL (and a port nothing listens on), not mocks.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from multiplexer.access.admin import ENV
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


# -- `multiplexer serve`: checked before anything runs, one line, exit 2 -----------------------

def echo_only(**sections: Any) -> dict[str, Any]:
    """Nothing in it opens the store at start: only the start-up checks can find it wrong (else
    the /v1 face's retention sweep found it first, from a task, once the gateway served)."""
    return {**sections, "server": {"port": 0}, "providers": {"e": {"kind": "echo"}},
            "routes": {"echo": {"provider": "e"}}}


def serve(tmp_path: Path, config: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI; a gateway that starts anyway is stopped at the timeout and fails the test."""
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != ENV}
    try:
        return subprocess.run([sys.executable, "-m", "multiplexer", "serve", "--config", str(path),
                               "--port", "0", *args], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the gateway started; its stderr: {e.stderr!r}") from None


def refused(done: subprocess.CompletedProcess[str], line: str) -> None:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [f"multiplexer serve: {line}"]
    assert done.returncode == 2


WORKERS = pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one", "workers"])


@WORKERS
def test_serve_names_a_missing_database_and_how_to_create_it(tmp_path: Path, workers: tuple[str, ...],
                                                             ) -> None:
    with admin():
        pass
    name = "mxtest_missing_" + secrets.token_hex(4)
    url = f"{SERVER}/{name}"
    refused(serve(tmp_path, echo_only(store={"url": url}), *workers),
            f'store.url {url}: database "{name}" does not exist; '
            f"create it with `createdb -h 127.0.0.1 -U postgres {name}`")


@WORKERS
def test_serve_names_a_postgres_role_that_does_not_exist(tmp_path: Path, workers: tuple[str, ...]) -> None:
    with admin():
        pass
    url = SERVER.replace("postgres@", "mx_nobody@", 1) + "/test"
    refused(serve(tmp_path, echo_only(store={"url": url}), *workers),
            f'store.url {url}: role "mx_nobody" does not exist')


@WORKERS
@pytest.mark.parametrize("key", ["state", "store"])
def test_serve_names_a_closed_port(tmp_path: Path, key: str, workers: tuple[str, ...]) -> None:
    port = free_port()  # nothing listens there
    if key == "state":
        url = f"redis://127.0.0.1:{port}/0"
        config = echo_only(state={"url": url})
    else:
        url = f"postgresql://postgres@127.0.0.1:{port}/mx"
        config = echo_only(store={"url": url})
    refused(serve(tmp_path, config, *workers), f"{key}.url {url}: cannot connect (Connection refused)")


def test_serve_names_a_store_path_whose_folder_cannot_be_made(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("a file, not a folder")
    path = tmp_path / "plain" / "jobs.db"
    refused(serve(tmp_path, echo_only(store={"path": str(path)})),
            f"store.path {path}: {tmp_path / 'plain'} is not a folder; choose another store.path")


def test_a_store_path_in_a_folder_not_yet_made_is_fine() -> None:
    from multiplexer.preflight import sqlite_problem

    assert sqlite_problem(ROOT / "no-such-folder" / "deeper" / "jobs.db") is None
