"""Forward passes handed to their thread at once, before the event loop runs anything else.

``anyio.to_thread.run_sync`` yields to the event loop before it hands its work
over. When a batch ended, the callers it answered were queued on the loop
ahead of the next batch, so the next forward waited behind all of their
replies (2 to 10 ms per batch, a core idle). Here the forward is on its thread
when the first of those replies is written.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")


class ForwardThreads:
    """The threads that run a pool's forward passes, one per batch that may run at once."""

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="forward")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a forward thread, started before this call yields.

        A forward cannot be stopped halfway, so a cancelled caller waits for it
        to end, as with anyio's threads: its batch's slot is free only once the
        thread is.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()  # raises if cancelled, never yields
        call = contextvars.copy_context().run
        future = asyncio.get_running_loop().run_in_executor(self._executor, call, fn, *args)
        with anyio.CancelScope(shield=True):
            result = await future
        return result

    def close(self) -> None:
        """No new work; the threads end once what they run ends."""
        self._executor.shutdown(wait=False)
