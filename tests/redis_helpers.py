"""Real Redis for the replica tests: the machine's server, or one of our own we may stop.

Every key prefix a test takes comes from ``prefix()``, which records it, so the conftest can
delete a test's keys when it ends and check at the end of the session that none are left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

REDIS_URL = os.environ.get("MX_TEST_REDIS", "redis://127.0.0.1:6379/0")
ISSUED: list[str] = []  # every prefix handed out in this process, in order


def _reachable(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _server_up() -> bool:
    hostport = REDIS_URL.split("://", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    return _reachable(host, int(port or 6379))


def redis_url() -> str:
    """The shared test server's URL, or skip (with the reason printed) where there is none."""
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the 'redis' client is not installed (pip install -e '.[dev]')")
    if not _server_up():
        print(f"SKIP: no Redis at {REDIS_URL}")
        pytest.skip(f"no Redis at {REDIS_URL}: replica tests need one")
    return REDIS_URL


def prefix() -> str:
    """A key prefix of its own, so parallel runs never share buckets."""
    pre = "mxtest-" + secrets.token_hex(4)
    ISSUED.append(pre)
    return pre


def _shared() -> Any:
    """A client of the shared server, or None where there is none (nothing of ours is there)."""
    try:
        import redis
    except ImportError:
        return None
    return redis.Redis.from_url(REDIS_URL) if _server_up() else None


def keys_under(prefixes: Iterable[str]) -> list[str] | None:
    """The shared server's keys under these prefixes (SCAN); None where there is no server."""
    client = _shared()
    if client is None:
        return None
    with client:
        return sorted(k.decode() for pre in prefixes for k in client.scan_iter(match=f"{pre}:*", count=500))


def drop_keys(prefixes: Iterable[str]) -> None:
    """Delete the shared server's keys under these prefixes (SCAN + DEL)."""
    client = _shared()
    if client is None:
        return
    with client:
        for pre in prefixes:
            batch = list(client.scan_iter(match=f"{pre}:*", count=500))
            if batch:
                client.delete(*batch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A ``redis-server`` of our own on a free port, which a test may stop and start again."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not on PATH: the Redis-outage tests need it")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="mx-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _reachable("127.0.0.1", self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def own_redis() -> Iterator[OwnRedis]:
    server = OwnRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
