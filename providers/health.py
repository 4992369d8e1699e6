"""An HTTP upstream's readiness, learned from its own traffic (no probes of its own).

Connection failures in a row (refused, unreachable, connect timeout) make it ``failing`` with
the last one's text; any response at all (whatever its status: the upstream answered) makes it
``up`` again. An upstream that no call has tried yet is ``up``: nothing says otherwise.
"""

from __future__ import annotations

from typing import Literal

import httpx

CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
FAILING_AFTER = 3  # one refused connection is a blip (a restart, a full backlog); three in a row are not


class ConnectionHealth:
    __slots__ = ("failures", "last_error")

    def __init__(self) -> None:
        self.failures = 0  # connection failures since the last response
        self.last_error: str | None = None

    def failed(self, error: BaseException) -> None:
        """A transport error of one attempt; only a failure to connect counts."""
        if isinstance(error, CONNECT_FAILURES):
            self.failures += 1
            self.last_error = f"{type(error).__name__}: {error}"

    def reached(self) -> None:
        """A response came back."""
        if self.failures:
            self.failures, self.last_error = 0, None

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]:
        if self.failures >= FAILING_AFTER:
            return "failing", f"{self.failures} connection failures in a row; last: {self.last_error}"
        return "up", None
