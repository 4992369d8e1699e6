"""Shared fixtures: the anyio backend for async tests; the test process's heap frozen per module;
the local pool's compile verdicts in a folder of the run's own."""

from collections.abc import Iterator

import pytest

from multiplexer.gateway.heap import freeze


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
