"""Shared fixtures: the anyio backend for async tests; the test process's heap frozen per module."""

from collections.abc import Iterator

import pytest

from multiplexer.gateway.heap import freeze


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
def frozen_heap() -> Iterator[None]:
    """What earlier modules left alive is frozen, as a serving gateway freezes its start-up heap
    (``server.freeze_heap``): by the last modules this process tracks over a million objects
    (torch, transformers, tokenizer tables), and a full collection walking them all stopped the
    event loop for about a second, long enough for a fault soak's 800 ms upstream timeout to fire
    on calls that had no fault."""
    freeze(collect=True)
    yield
