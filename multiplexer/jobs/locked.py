"""The store's methods run one at a time on its one connection, from any worker thread."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def locked(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper
