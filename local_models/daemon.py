"""Blocking work that must not hold the process open: model loads and compiles.

anyio's worker threads are not daemons, so a gateway told to stop while a model
still loads or compiles would wait for it (tens of seconds) past its grace
period. These run on a daemon thread instead; a cancelled caller abandons the
work, and the process may exit under it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

T = TypeVar("T")


async def run_daemon(fn: Callable[[], T], name: str) -> T:
    """``fn()`` on a new daemon thread; its result or exception here."""
    done = anyio.Event()
    token = anyio.lowlevel.current_token()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the awaiting task, which re-raises it
            box["error"] = e
        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody waits any more
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=target, name=name, daemon=True).start()
    await done.wait()
    if "error" in box:
        raise box["error"]
    return box["value"]
