"""Running one coroutine per item at once, results back in input order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio

T = TypeVar("T")
R = TypeVar("R")


async def gather(fn: Callable[[T], Awaitable[R]], items: Sequence[T]) -> list[R]:
    """``[await fn(x) for x in items]``, concurrently; a single item runs without a task group."""
    if len(items) == 1:
        return [await fn(items[0])]
    out: list[Any] = [None] * len(items)

    async def one(i: int) -> None:
        out[i] = await fn(items[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
    return out
