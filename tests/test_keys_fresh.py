"""Answers a stale snapshot must not give: two directories on one SQLite store, as two workers
are, one writing through the admin operations and the other never reloading. The store's first
key ends keyless service on the other at once; a bearer it does not know is asked of the store
(at most once per ``MISS_EVERY_S``, on an injected clock) and, if the store has it, served after
a reload; a revoked key there stays refused after that reload; and of two overlapping loads the
one begun later is the one installed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.access.admin_ops import KeyAdmin
from multiplexer.access.api import KeyIn
from multiplexer.access.directory import MISS_EVERY_S, KeyDirectory
from multiplexer.access.keystore import KeyStore
from multiplexer.access.probe import ProbeDown, StoreProbe
from multiplexer.access.secrets import given_digest
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import RpcError
from multiplexer.core.quota import Quotas
from multiplexer.faces.auth import Authenticator

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Worker:
    """One worker's directory and authenticator over the shared store file."""

    def __init__(self, path: Path, clock: Clock) -> None:
        self.store = KeyStore(path)
        self.keys = KeyDirectory({}, {}, Quotas(ManualClock(), {}), store=self.store, clock=clock)
        self.keys.probe = StoreProbe(path, None, "")
        self.auth = Authenticator({}, self.keys)
        self.admin = KeyAdmin(self.store, self.keys, 60.0)

    def who(self, key: str | None) -> str | None:
        return self.auth.identify(None if key is None else f"Bearer {key}")

    def close(self) -> None:
        assert self.keys.probe is not None
        self.keys.probe.close()
        self.store.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Worker, Worker, Clock]]:
    clock = Clock()
    a, b = Worker(tmp_path / "jobs.db", clock), Worker(tmp_path / "jobs.db", clock)
    yield a, b, clock
    a.close()
    b.close()


def detail(key: str | None, worker: Worker) -> str:
    with pytest.raises(RpcError) as e:
        worker.who(key)
    assert e.value.code == -32005
    return str(e.value.data["detail"])  # type: ignore[index]


async def test_the_first_key_made_elsewhere_ends_keyless_service_before_any_reload(pair: Any) -> None:
    a, b, _ = pair
    await a.keys.load()
    await b.keys.load()
    assert b.who(None) is None  # no key in the store: served without one
    made = await a.admin.create_key(KeyIn(name="first"), "admin:test")
    assert not b.keys.issued  # b's snapshot has not moved...
    assert detail(None, b) == "missing bearer key"  # ...yet it needs a key now
    assert b.keys.issued and b.keys.entry(made.id) is not None  # and loaded the store to say so
    assert b.who(made.key) == made.id


async def test_an_unknown_bearer_asks_the_store_at_most_once_per_interval(pair: Any,
                                                                         monkeypatch: Any) -> None:
    a, b, clock = pair
    await a.admin.create_key(KeyIn(name="first"), "admin:test")
    await b.keys.load()
    asked: list[str] = []
    live = b.keys.probe.live
    monkeypatch.setattr(b.keys.probe, "live", lambda d: asked.append(d) or live(d))
    for i in range(50):
        assert detail(f"mx-random-{i}", b) == "unknown key"
    assert len(asked) == 1  # fifty misses, one store read
    made = await a.admin.create_key(KeyIn(name="second"), "admin:test")
    assert detail(made.key, b) == "unknown key"  # the interval's one read was spent
    clock.now += MISS_EVERY_S
    version = b.keys.version
    assert b.who(made.key) == made.id  # asked, found live, reloaded, served
    assert b.keys.version == version + 1 and len(asked) == 2
    assert b.who(made.key) == made.id and len(asked) == 2  # known now: no store read


async def test_a_revoked_key_is_not_found_new(pair: Any) -> None:
    a, b, clock = pair
    made = await a.admin.create_key(KeyIn(name="first"), "admin:test")
    await a.admin.revoke_key(made.id, "admin:test")
    await b.keys.load()
    clock.now += MISS_EVERY_S
    assert detail(made.key, b) == "unknown key"


async def test_a_store_that_cannot_answer_leaves_the_snapshots_answer(pair: Any, monkeypatch: Any) -> None:
    a, b, clock = pair
    await b.keys.load()

    def down(*args: Any) -> bool:
        raise ProbeDown("unreachable")

    monkeypatch.setattr(b.keys.probe, "any_key", down)
    monkeypatch.setattr(b.keys.probe, "live", down)
    assert b.who(None) is None  # no key loaded, none confirmed: as before the store was asked
    made = await a.admin.create_key(KeyIn(name="first"), "admin:test")
    await b.keys.load()
    clock.now += MISS_EVERY_S
    assert b.who(made.key) == made.id and detail("mx-random", b) == "unknown key"


def test_the_probe_reads_the_stores_table(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "jobs.db")
    probe = StoreProbe(tmp_path / "jobs.db", None, "")
    try:
        assert probe.any_key() is False and probe.live("00" * 32) is False
    finally:
        probe.close()
        store.close()
    assert probe.down
    with pytest.raises(ProbeDown):
        probe.any_key()


async def test_a_read_begun_before_a_revocation_never_replaces_one_that_saw_it(
        pair: Any, monkeypatch: Any) -> None:
    a, _, _ = pair
    made = await a.admin.create_key(KeyIn(name="first"), "admin:test")
    reads: list[int] = []
    release = anyio.Event()

    async def run(fn: Any, *args: Any) -> Any:
        out = fn(*args)  # read (or written) now...
        reads.append(1)
        if len(reads) == 1:
            await release.wait()  # ...and the first one handed back only when the test says
        return out

    monkeypatch.setattr(a.store, "run", run)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.keys.load)  # reads the key live, then is held
        await anyio.wait_all_tasks_blocked()
        await a.admin.revoke_key(made.id, "admin:test")  # written, then loaded: refused here
        assert detail(made.key, a) == "unknown key"
        release.set()
    assert a.keys.identify(given_digest(made.key)) is None  # the older read was not installed
