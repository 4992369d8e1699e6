"""Where an upstream's log messages for a call go: each caller that asked, at or above its level.

A face that relays logs (MCP) puts a ``LogSink`` on ``Call.log``; the gateway gives
the item a ``LogFanout`` that identical calls sharing one execution join, as they
join its progress, so the shared execution's messages reach every caller that
asked, each filtered by its own level. The levels are MCP's (RFC 5424).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
_RANK = {level: i for i, level in enumerate(LEVELS)}
Send = Callable[[str, Any, str | None], Awaitable[None]]  # (level, data, logger)


def rank(level: str) -> int:
    """Severity order (debug lowest); an unknown level ranks with the most severe, so it passes."""
    return _RANK.get(level, len(LEVELS) - 1)


@dataclass(frozen=True, slots=True, eq=False)
class LogSink:
    """One caller's wish: messages at ``level`` or above, sent with ``send``."""

    level: str
    send: Send


class LogFanout:
    """The log messages of one execution, sent to every caller that asked for them.

    A sink that fails (its client left) is dropped and the rest go on.
    """

    __slots__ = ("sinks",)

    def __init__(self, sinks: Iterable[LogSink] = ()) -> None:
        self.sinks: list[LogSink] = list(sinks)

    def add(self, sink: LogSink) -> None:
        self.sinks.append(sink)

    def remove(self, sink: LogSink) -> None:
        with contextlib.suppress(ValueError):
            self.sinks.remove(sink)

    @property
    def level(self) -> str | None:
        """The most verbose level any caller asked for; None: nobody wants logs."""
        return min((s.level for s in self.sinks), key=rank, default=None)

    async def __call__(self, level: str, data: Any, logger: str | None = None) -> None:
        severity = rank(level)
        for sink in list(self.sinks):
            if severity < rank(sink.level):
                continue
            try:
                await sink.send(level, data, logger)
            except Exception as e:
                log.debug("log sink dropped: %r", e)
                self.remove(sink)
