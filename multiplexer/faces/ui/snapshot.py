"""Snapshots of every panel, and the ticks that share one snapshot among a view's subscribers.

Nothing runs while nobody watches: there is no background task. Each open stream sleeps to the
next tick (a multiple of ``interval_s`` on the event loop's clock) and asks for that tick's snapshot;
the first to ask builds it, the others of the same view get the same bytes. So ten open pages
cost one snapshot per tick, and none costs nothing. Under ``serve --workers N`` a snapshot's
numbers are every worker's, summed over the sibling sockets as ``/metrics`` sums them.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from multiplexer.core.version import VERSION
from multiplexer.faces.spend import key_names
from multiplexer.faces.ui.panels import PANELS, View, finite
from multiplexer.faces.ui.samples import Samples
from multiplexer.gateway.gateway import Gateway

Who = str | None  # None: the admin's view; else a caller key's identity (its own view)
log = logging.getLogger("multiplexer.faces")
_FAILING: dict[str, str] = {}  # panel -> the error it last logged


class _Parsed:
    """An exposition's families, collected as a registry's are."""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(self.text.decode())


async def samples(gateway: Gateway) -> Samples:
    """The numbers a scrape of /metrics shows now: this process's registry (refreshed first), or
    under ``serve --workers N`` every worker's summed, as the worker answering /metrics sums them."""
    siblings = gateway.faces.get("workers")
    if siblings is None:
        await gateway.metrics.refresh()
        return Samples(gateway.metrics.registry)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Parsed(await siblings.metrics()))  # type: ignore[arg-type]
    return Samples(registry)


async def snapshot(gateway: Gateway, admin: bool, identity: str | None = None) -> dict[str, Any]:
    """Every panel the viewer may see, from one reading of the metrics (refreshed first, as a
    scrape of /metrics is)."""
    view = View(gateway, await samples(gateway), admin, identity)
    panels: dict[str, Any] = {}
    for name, (fn, callers) in PANELS.items():
        if admin or callers:
            try:
                panels[name] = await fn(view)
            except Exception as e:  # one panel's source failing (a store gone): that panel says so
                panels[name] = {"configured": True, "error": f"{type(e).__name__}: {e}"}
                if _FAILING.get(name) != panels[name]["error"]:  # logged once per new failure
                    log.exception("dashboard panel %s failed", name)
                _FAILING[name] = panels[name]["error"]
            else:
                _FAILING.pop(name, None)
    key_name = await key_names(gateway).of(identity) if identity is not None else None
    return finite({"version": VERSION, "at": time.time(), "view": "admin" if admin else "key",
                   "identity": identity, "key_name": key_name, "panels": panels})


def encode(snap: dict[str, Any]) -> bytes:
    return json.dumps(snap, separators=(",", ":")).encode()


@dataclass(slots=True)
class _Shared:
    tick: int = -1
    body: bytes = b""
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    subscribers: int = 0


class Ticks:
    """The streams' shared snapshots, one per view per tick."""

    def __init__(self, gateway: Gateway, interval_s: float) -> None:
        self.gateway = gateway
        self.interval_s = interval_s
        self.views: dict[Who, _Shared] = {}
        self.built = 0  # snapshots built for streams (each shared by its view's subscribers)
        self.closed = anyio.Event()

    @property
    def subscribers(self) -> int:
        return sum(v.subscribers for v in self.views.values())

    @staticmethod
    def _now() -> float:
        return anyio.current_time()

    def _tick(self) -> int:
        return math.floor(self._now() / self.interval_s)

    async def _at(self, shared: _Shared, tick: int, who: Who) -> bytes:
        async with shared.lock:
            if shared.tick < tick:
                snap = await snapshot(self.gateway, who is None, who)
                snap["tick"] = tick
                shared.body, shared.tick = encode(snap), tick
                self.built += 1
            return shared.body

    async def stream(self, who: Who) -> AsyncIterator[bytes]:
        """A snapshot now, then one per tick, until the caller stops or the server closes."""
        shared = self.views.get(who)
        if shared is None:
            shared = self.views[who] = _Shared()
        shared.subscribers += 1
        try:
            tick = self._tick()
            while not self.closed.is_set():
                yield await self._at(shared, tick, who)
                tick = max(tick + 1, self._tick())
                with anyio.move_on_after(max(0.0, tick * self.interval_s - self._now())):
                    await self.closed.wait()  # woken early only by close()
        finally:
            shared.subscribers -= 1
            if not shared.subscribers and self.views.get(who) is shared:
                del self.views[who]

    def close(self) -> None:
        """The server is stopping: every open stream ends now (no grace period spent on them)."""
        self.closed.set()
