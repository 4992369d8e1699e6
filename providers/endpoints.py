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

Prompt-cache affinity (``endpoint_affinity``): a chat or messages call with a cache key (its
``prompt_cache_key``, its session, or the hash of its stable prefix once its prompt is long enough
to be cached) goes to its rendezvous pick among the endpoints (``core/cache_affinity.py``, the
same picker as a model group's) while that one is usable and not saturated (more requests in flight
than 1.25 x the endpoints' mean + 1); else to the next in its ranking, counted as a cache move. A
call without a key goes to the least outstanding, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import BaseModel, Field, model_validator

from multiplexer.core.breaker import Breaker
from multiplexer.core.cache_affinity import (
    AFFINITY_KEY,
    CACHE_MOVED,
    CACHED_OPERATIONS,
    SESSION,
    ModeSetting,
    call_key,
    digest64,
    ranking,
    saturated,
)
from multiplexer.core.call import Item
from multiplexer.core.clock import Clock

# The options of the item whose key ``key_of`` gave last in this task: a request sent away from its
# pick marks it (``CACHE_MOVED``), so the spend report books the move. Each request of a batch runs
# in a task of its own (``run_each``), so each sees its own item's.
_KEYED: ContextVar[dict[str, Any] | None] = ContextVar("keyed_item_options", default=None)
_BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

log = logging.getLogger(__name__)


class EndpointSettings(BaseModel):
    base_urls: list[str] | None = Field(
        default=None, min_length=1, description="several endpoints of this provider (spread, with health)")
    endpoint_concurrency: int | None = Field(
        default=None, ge=1, description="requests in flight per endpoint")
    endpoint_failures: int = Field(
        default=2, ge=1, description="connection failures in a row that take it out")
    endpoint_retry_s: float = Field(default=5.0, gt=0, description="then the next request to it is a probe")
    endpoint_affinity: ModeSetting = Field(
        default="prefix", description="with several base_urls, chat and messages calls that share a "
        "prompt-cache key go to one endpoint while it is usable and not saturated: prefix "
        "(prompt_cache_key, else x-session-id, else the system prompt, tools and first user "
        "message), session (prompt_cache_key, x-session-id, metadata.session_id, metadata.user_id "
        "or user), off (least outstanding requests only)")
    endpoint_affinity_min_tokens: int = Field(
        default=1024, ge=0, description="endpoint_affinity: prefix keys a call by its prefix only "
        "when its prompt is at least this many (estimated) tokens: a shorter one no provider "
        "caches, so it spreads by outstanding requests (a prompt_cache_key or session always keys)")

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
        self.mode = settings.endpoint_affinity if len(self.all) > 1 else "off"
        self.min_tokens = settings.endpoint_affinity_min_tokens
        self.members = tuple((ep.base, digest64(ep.base.encode()), 1.0) for ep in self.all)
        self._by_base = {ep.base: ep for ep in self.all}
        self.on_move: Callable[[str], None] | None = None  # a keyed request sent off its pick: why

    def key_of(self, item: Item) -> int | None:
        """The request's cache key, or None: it goes to the least outstanding endpoint."""
        if self.mode == "off" or item.operation not in CACHED_OPERATIONS:
            return None
        options = item.options
        key = options.get(AFFINITY_KEY)
        if key is None:
            params = item.params
            session = options.get(SESSION)
            if self.mode == "prefix" and session is None and type(params) is dict \
                    and not params.get("prompt_cache_key") and self._short(item, params):
                return None
            key = call_key(params, self.mode, session)
        if key is not None:
            _KEYED.set(options)
        return key  # type: ignore[no-any-return]

    def _short(self, item: Item, params: dict[str, Any]) -> bool:
        """Whether the prompt is under the minimum a provider caches (its estimate: the item's
        tokens less the output budget)."""
        budget = 0
        for name in _BUDGETS:
            value = params.get(name)
            if type(value) is int:
                budget = value
                break
        return item.tokens - budget < self.min_tokens

    def _keyed(self, key: int, usable: list[Endpoint]) -> Endpoint:
        """A keyed request's endpoint: its first in rendezvous order that is usable and not
        saturated; else the least outstanding usable one. A pick other than the first is a move."""
        order = ranking(key, self.members)
        full = saturated(order, {ep.base: ep.outstanding for ep in self.all})
        home = self._by_base[order[0]]
        chosen = None
        for base in order:
            ep = self._by_base[base]
            if ep in usable and base not in full:
                chosen = ep
                break
        if chosen is None:
            chosen = min(usable, key=lambda e: e.outstanding)
        if chosen is not home:
            if self.on_move is not None:
                self.on_move("overloaded" if home in usable else "endpoint_down")
            noted = _KEYED.get()
            if noted is not None:
                noted[CACHE_MOVED] = True
        return chosen

    def _usable(self, ep: Endpoint, now: float) -> bool:
        if self.cap is not None and ep.outstanding >= self.cap:
            return False
        if ep.breaker is not None and not ep.breaker.may_pass():
            return False
        if ep.down_until is None:
            return True
        return now >= ep.down_until and not ep.probing  # one probe at a time

    async def take(self, key: int | None = None) -> Endpoint:
        """The endpoint for the next request (waits while every one is at its cap); ``key``: the
        request's cache key (``key_of``), which picks by rendezvous."""
        while True:
            now = self.clock.now()
            usable = [ep for ep in self.all if self._usable(ep, now)]
            if not usable and all(ep.breaker is not None and ep.breaker.state == "open" for ep in self.all):
                raise BreakerOpen(min(ep.breaker.retry_after() for ep in self.all if ep.breaker))
            if not usable and not any(ep.down_until is None for ep in self.all) and self.cap is None:
                usable = [min(self.all, key=lambda ep: ep.down_until or 0.0)]  # all down: try one anyway
            if usable and key is not None:
                ep = self._keyed(key, usable)
            elif usable:  # a due probe first; else fewest in flight, ties in turn
                self._turn += 1
                n = len(self.all)
                ep = min(usable, key=lambda e: (e.down_until is None, e.outstanding,
                                                (self.all.index(e) - self._turn) % n))
            if usable:
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
