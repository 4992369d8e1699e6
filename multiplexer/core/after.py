"""Bookkeeping that may wait until a request's answer is written: a call span's attributes and its
end, a priced call's spend metrics and record, a budget's settling, what the limiter learns from a
successful reply's headers.

A request served on the direct HTTP path (``faces/server_protocol.py``) holds a list here while it
runs; ``after`` adds to it, and the list runs right after the reply has been handed to the
socket, before the request's task yields. No other task runs in between, so nothing can read
the state before it is updated: the client just gets its answer first (on a lone call this work
was a tenth of the gateway's time). Anywhere else (the ASGI faces, the SDK, a lane's worker) there
is no list and the work runs at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

log = logging.getLogger(__name__)


class Held(list[tuple[Callable[..., Any], tuple[Any, ...]]]):
    """What a request holds; ``open`` until released. A task or callback made while it held (they
    copy the request's context) may run later: once released, what it adds runs at once."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        super().__init__()
        self.open = True


_HELD: ContextVar[Held | None] = ContextVar("multiplexer_after_answer", default=None)


def after(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` once the answer is written, or now where nothing holds it."""
    held = _HELD.get()
    if held is None or not held.open:
        fn(*args)
    else:
        held.append((fn, args))


def hold() -> Held:
    """Start holding for this task (its own context: a request's task)."""
    held = Held()
    _HELD.set(held)
    return held


def release(held: Held) -> None:
    """Stop holding and run what was held, in order; a failure is logged and the rest still run."""
    held.open = False
    _HELD.set(None)
    for fn, args in held:
        try:
            fn(*args)
        except Exception:
            log.exception("bookkeeping after an answer failed")
    held.clear()
