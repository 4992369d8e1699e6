"""Shared fixtures: the anyio backend for async tests; the test process's heap frozen per module;
the shared Redis and PostgreSQL left as the suite found them; the local pool's compile verdicts
in a folder of the run's own."""

from collections.abc import Iterator

import pytest

from multiplexer.gateway.heap import freeze
from tests import pg_helpers, redis_helpers

NOTES: list[str] = []  # lines for the end of the run (a check that could not run, and why)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def compile_verdicts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite neither reads the user's measured compile verdicts (one saying "faster" would
    compile at each load) nor writes its fake timings there (``local_models/verdicts.py``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTIPLEXER_CACHE_DIR", str(tmp_path_factory.mktemp("multiplexer-cache")))
        yield


@pytest.fixture(scope="module", autouse=True)
def frozen_heap() -> Iterator[None]:
    """What earlier modules left alive is frozen, as a serving gateway freezes its start-up heap
    (``server.freeze_heap``): by the last modules this process tracks over a million objects
    (torch, transformers, tokenizer tables), and a full collection walking them all stopped the
    event loop for about a second, long enough for a fault soak's 800 ms upstream timeout to fire
    on calls that had no fault."""
    freeze(collect=True)
    yield


@pytest.fixture(autouse=True)
def redis_keys_dropped() -> Iterator[None]:
    """A test's Redis keys (under the prefixes it took from ``redis_helpers.prefix``) are deleted
    when it ends: the server is shared by every run on the machine. Runs after the test's own
    fixtures are torn down, so its gateways have stopped writing."""
    before = len(redis_helpers.ISSUED)
    yield
    if len(redis_helpers.ISSUED) > before:
        redis_helpers.drop_keys(redis_helpers.ISSUED[before:])


@pytest.fixture(scope="session", autouse=True)
def shared_servers_left_clean() -> Iterator[None]:
    """Fails the run if any key or database a test made is still on the shared servers at the
    end: a key written after its test's cleanup, or a database whose drop did not happen. Only
    this run's own prefixes and names are checked, so other runs on the same servers never fail it."""
    yield
    left: list[str] = []
    if redis_helpers.ISSUED:
        keys = redis_helpers.keys_under(redis_helpers.ISSUED)
        if keys is None:
            NOTES.append(f"leftover check skipped for Redis: no server at {redis_helpers.REDIS_URL}")
        left += [f"Redis key {k}" for k in keys or []]
    if pg_helpers.ISSUED:
        dbs = pg_helpers.databases_left(pg_helpers.ISSUED)
        if dbs is None:
            NOTES.append(f"leftover check skipped for PostgreSQL: no server at {pg_helpers.PG_ADMIN}")
        left += [f"PostgreSQL database {d}" for d in dbs or []]
    if left:
        pytest.fail("the tests left these on the shared servers:\n  " + "\n  ".join(left), pytrace=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for note in NOTES:
        terminalreporter.write_line(f"SKIP: {note}")
