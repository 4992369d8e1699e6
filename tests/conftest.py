"""Shared fixtures: the anyio backend for async tests; the test process's heap frozen per module;
the shared Redis and PostgreSQL left as the suite found them; the local pool's compile verdicts
in a folder of the run's own; the user's data directory (the default store's folder) a temporary
one, each test's its own; and no file left in the checkout by the run."""

import itertools
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from multiplexer.gateway.heap import freeze
from tests import pg_helpers, redis_helpers
from tests.checkout_helpers import left_behind, untracked

NOTES: list[str] = []  # lines for the end of the run (a check that could not run, and why)
FAILURES: list[str] = []  # the run's own checks that failed it (after its tests passed)
CHECKOUT = Path(__file__).resolve().parent.parent
DATA_HOME = "XDG_DATA_HOME"  # platformdirs' user data directory on Linux and the BSDs
RUN_DATA = pytest.StashKey[tuple[Path, str | None]]()
BEFORE = pytest.StashKey[set[str] | None]()
PG_EXTENSIONS = pytest.StashKey[set[str] | None]()  # the shared database's, as the run began
TEST_NUMBER = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module is imported (a config made at import reads the data directory):
    the run's own data directory, so the default store (``gateway/home.py``) of the suite and of
    the gateways it starts as subprocesses is never the user's. And the modules it imports keep
    their bytecode (the checkout's ignored ``__pycache__`` folders) even where the environment sets
    PYTHONDONTWRITEBYTECODE: each xdist worker imports the whole project and every test module,
    and compiled them all again every run (collection 24 s a worker here, 12-14 s so)."""
    sys.dont_write_bytecode = False
    data = Path(tempfile.mkdtemp(prefix="multiplexer-data-"))
    config.stash[RUN_DATA] = (data, os.environ.get(DATA_HOME))
    os.environ[DATA_HOME] = str(data)


def pytest_unconfigure(config: pytest.Config) -> None:
    if RUN_DATA not in config.stash:
        return
    data, was = config.stash[RUN_DATA]
    if was is None:
        os.environ.pop(DATA_HOME, None)
    else:
        os.environ[DATA_HOME] = was
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(autouse=True)
def own_default_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test that leaves ``store.path`` out gets a store of its own: its data directory is a
    folder of the run's, made only if the test's gateway writes there."""
    data, _ = request.config.stash[RUN_DATA]
    monkeypatch.setenv(DATA_HOME, str(data / f"test-{next(TEST_NUMBER)}"))


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker: its session ends while others still run, so the checkout is checked once,
    by the process that started them, before the first and after the last."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not is_worker(session.config):
        session.config.stash[BEFORE] = untracked(CHECKOUT)
        session.config.stash[PG_EXTENSIONS] = pg_helpers.extensions()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fails the run if it left a file in the checkout that was not there before: a store, a
    log or an output a test wrote where it ran (the tools' caches aside)."""
    if is_worker(session.config) or BEFORE not in session.config.stash:
        return
    before_ext = session.config.stash.get(PG_EXTENSIONS, None)
    after_ext = pg_helpers.extensions() if before_ext is not None else None
    if before_ext is not None and after_ext is not None and after_ext - before_ext:
        # the run's gateways added them (pg_trgm for the request log) to the shared database
        for left in pg_helpers.drop_extensions(after_ext - before_ext):
            NOTES.append(f"an extension this run added to the shared database stays: {left}")
    if os.environ.get("MUX_LEFTOVER_CHECK") == "off":  # several people testing in one checkout at once
        NOTES.append("leftover check skipped: MUX_LEFTOVER_CHECK=off")
        return
    before = session.config.stash[BEFORE]
    after = untracked(CHECKOUT) if before is not None else None
    if before is None or after is None:
        NOTES.append(f"leftover check skipped for the checkout: {CHECKOUT} is not a git checkout")
        return
    left = left_behind(before, after)
    if left:
        FAILURES.append("these files appeared in the checkout during the run (a test writes where it runs: "
                        "write under tmp_path; or they were made beside the run):\n  " + "\n  ".join(left))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def held_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Local model loads wait until the returned event is set; released at teardown in any case
    (the readiness and the dashboard's stage tests watch a model while it loads)."""
    from local_models.pool import ModelHandle

    release = threading.Event()
    real = ModelHandle.load_sync

    def held(self: ModelHandle) -> None:
        assert release.wait(60)
        real(self)

    monkeypatch.setattr(ModelHandle, "load_sync", held)
    yield release
    release.set()


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
    for failure in FAILURES:
        terminalreporter.write_line(f"FAILED: {failure}", red=True)
