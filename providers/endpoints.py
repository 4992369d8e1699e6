"""One provider over several endpoints (``base_urls``): least outstanding requests, with health.

How a gateway fronts several replicas of vLLM, Ray Serve LLM, KServe or other
gateways. A request goes to the healthy endpoint with the fewest requests in
flight (optionally at most ``endpoint_concurrency`` each). After
``endpoint_failures`` connection failures in a row an endpoint is taken out; after
``endpoint_retry_s`` the next request to it is the probe, and one that succeeds
puts it back. A request that could not connect is retried elsewhere (it never
reached the server). The limits stay the provider's: one account, many endpoints.
With a ``breaker`` on the provider each endpoint also has a circuit breaker (``core/breaker.py``,
``<provider>@<base_url>``): an open one takes no requests, a half-open one takes one probe, and
when every endpoint's breaker is open the request fails at once as ``breaker_open`` (the
route's fallback takes it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from pydantic import BaseModel, Field, model_validator

from multiplexer.core.breaker import Breaker
from multiplexer.core.clock import Clock

log = logging.getLogger(__name__)


class EndpointSettings(BaseModel):
    base_urls: list[str] | None = Field(
        default=None, min_length=1, description="several endpoints of this provider (spread, with health)")
    endpoint_concurrency: int | None = Field(
        default=None, ge=1, description="requests in flight per endpoint")
    endpoint_failures: int = Field(
        default=2, ge=1, description="connection failures in a row that take it out")
    endpoint_retry_s: float = Field(default=5.0, gt=0, description="then the next request to it is a probe")

    @model_validator(mode="after")
    def _http_urls(self) -> EndpointSettings:
        for url in self.base_urls or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"base_urls: {url!r} is not an http(s) URL")
        return self


class BreakerOpen(Exception):
    """Every endpoint's breaker is open: nothing to send to for ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"every endpoint's circuit breaker is open for {retry_after:.1f} s")
        self.retry_after = retry_after


@dataclass(slots=True, eq=False)
class Endpoint:
    base: str
    outstanding: int = 0
    failures: int = 0
    down_until: float | None = None  # None: healthy
    probing: bool = False
    breaker: Breaker | None = None


class Endpoints:
    def __init__(self, bases: list[str], clock: Clock, settings: EndpointSettings,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.all = [Endpoint(b.rstrip("/")) for b in bases]
        self.clock = clock
        self.cap = settings.endpoint_concurrency
        self.max_failures = settings.endpoint_failures
        self.retry_s = settings.endpoint_retry_s
        self.on_event = on_event
        self._freed = anyio.Event()
        self._turn = 0

    def _usable(self, ep: Endpoint, now: float) -> bool:
        if self.cap is not None and ep.outstanding >= self.cap:
            return False
        if ep.breaker is not None and not ep.breaker.may_pass():
            return False
        if ep.down_until is None:
            return True
        return now >= ep.down_until and not ep.probing  # one probe at a time

    async def take(self) -> Endpoint:
        """The endpoint for the next request (waits while every one is at its cap)."""
        while True:
            now = self.clock.now()
            usable = [ep for ep in self.all if self._usable(ep, now)]
            if not usable and all(ep.breaker is not None and ep.breaker.state == "open" for ep in self.all):
                raise BreakerOpen(min(ep.breaker.retry_after() for ep in self.all if ep.breaker))
            if not usable and not any(ep.down_until is None for ep in self.all) and self.cap is None:
                usable = [min(self.all, key=lambda ep: ep.down_until or 0.0)]  # all down: try one anyway
            if usable:  # a due probe first; else fewest in flight, ties in turn
                self._turn += 1
                n = len(self.all)
                ep = min(usable, key=lambda e: (e.down_until is None, e.outstanding,
                                                (self.all.index(e) - self._turn) % n))
                if ep.down_until is not None:
                    ep.probing = True
                if ep.breaker is not None:
                    ep.breaker.allow()  # half-open: this request is the probe
                ep.outstanding += 1
                return ep
            if self._freed.is_set():  # one event for all waiters, renewed once it fired
                self._freed = anyio.Event()
            soonest = min((ep.down_until for ep in self.all if ep.down_until is not None), default=None)
            await self.clock.wait_event(self._freed, soonest)

    def done(self, ep: Endpoint, connected: bool) -> None:
        """The request ended: ``connected`` False if it never reached the endpoint."""
        ep.outstanding -= 1
        ep.probing = False
        if connected:
            ep.failures = 0
            if ep.down_until is not None:
                ep.down_until = None
                log.info("endpoint %s is back", ep.base)
                self._event("endpoint_up")
        else:
            ep.failures += 1
            if ep.failures >= self.max_failures or ep.down_until is not None:
                if ep.down_until is None:
                    log.warning("endpoint %s taken out after %d connection failures", ep.base, ep.failures)
                    self._event("endpoint_down")
                ep.down_until = self.clock.now() + self.retry_s
        self._freed.set()

    def _event(self, name: str) -> None:
        if self.on_event is not None:
            self.on_event(name)
