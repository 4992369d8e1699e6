"""The semantic cache: a call's last user turn answered from a stored answer to the same
question, asked in other words, in the same neighbourhood (route, model, system prompt, tools,
parameters, scope).

A lookup reads the exact request first (no embedding), then embeds the turn once, asks its
scope's index for the nearest neighbours and keeps the first that is close enough and that the
guard (``guard.py``) agrees asks the same thing. Hits are sampled for audit; a hit reported
wrong removes its entry and raises its scope's threshold by ``wrong_step``.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from multiplexer.cache.guard import disagreement, facts
from multiplexer.cache.index import Entry, ScopeIndex
from multiplexer.cache.key import Ask, ask_of
from multiplexer.cache.settings import SemanticSection, SemanticSettings
from multiplexer.cache.store import CacheLog, entry_of, entry_op

log = logging.getLogger(__name__)

# a batch of texts -> one unit vector each (None: the embeddings route failed; nothing cached)
Embed = Callable[[str, list[str]], Awaitable[list[np.ndarray] | None]]
GUARD_REASONS = ("numbers", "versions", "units", "negation", "roles", "particles", "entity_order",
                 "content")
SKIPS = ("off", "shape", "long", "tools", "n", "not_text", "error")


@dataclass(slots=True)
class Lookup:
    """One call's question to the cache, and its answer: ``hit`` (with ``similarity``), or what
    a miss stores once the call is answered."""

    route: str
    scope: str
    settings: SemanticSettings
    ask: Ask
    request_id: str | None = None
    hit: Entry | None = None
    similarity: float = 0.0
    hit_id: str | None = None
    vector: np.ndarray | None = None
    exact: bool = False


@dataclass(slots=True)
class Audit:
    id: str
    at: float
    route: str
    scope: str
    entry_id: str
    similarity: float
    asked: str
    matched: str
    request_id: str | None
    original_request_id: str | None
    exact: bool
    step: float  # what a wrong report raises the scope's threshold by (its settings' wrong_step)
    wrong: bool = False

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at, "route": self.route, "scope": self.scope,
                "entry_id": self.entry_id, "similarity": round(self.similarity, 4),
                "asked": self.asked, "matched": self.matched, "request_id": self.request_id,
                "original_request_id": self.original_request_id, "exact": self.exact,
                "wrong": self.wrong}


@dataclass(slots=True)
class RouteCounts:
    lookups: int = 0
    hits: int = 0
    exact: int = 0
    wrong: int = 0


@dataclass
class _Queue:
    ops: list[dict[str, Any]] = field(default_factory=list)
    event: anyio.Event = field(default_factory=anyio.Event)
    dropped: int = 0


class SemanticCache:
    def __init__(self, section: SemanticSection, embed: Embed, registry: CollectorRegistry,
                 log_: CacheLog | None = None, wall: Callable[[], float] = time.time) -> None:
        self.section = section
        self.embed = embed
        self.log = log_
        self.wall = wall
        self.replica = f"{os.getpid():x}{secrets.token_hex(4)}"  # its own ops in the log: skipped
        self._seq = itertools.count(1)
        self.scopes: dict[str, ScopeIndex] = {}
        self.scope_route: dict[str, str] = {}
        self.raised: dict[str, float] = {}  # scope -> threshold raise from reported wrong hits
        self.audit: deque[Audit] = deque(maxlen=section.audit_size)
        self.counts: dict[str, RouteCounts] = {}
        self.queue = _Queue()
        self.lookups = Counter("multiplexer_semantic_cache_lookups", "Semantic cache lookups by "
                               "result (hit, exact, miss, skip)", ["route", "result"], registry=registry)
        self.refusals = Counter("multiplexer_semantic_cache_guard_refusals", "Neighbours above the "
                                "threshold that the guard refused, by what differed",
                                ["route", "reason"], registry=registry)
        self.wrong_hits = Counter("multiplexer_semantic_cache_wrong_hits", "Hits reported wrong "
                                  "through the admin API", ["route"], registry=registry)
        self.skips = Counter("multiplexer_semantic_cache_skips", "Calls on cached routes not "
                             "looked up, by why", ["route", "reason"], registry=registry)
        registry.register(_Sizes(self))

    # -- which calls ------------------------------------------------------------------
    def settings_for(self, route: str, group: str | None, identity: str | None,
                     team: str | None) -> SemanticSettings | None:
        """A key's settings over its team's over its route's (or model group's); None: not
        cached."""
        s = self.section
        if identity is not None and identity in s.keys:
            return s.keys[identity]
        if team is not None and team in s.teams:
            return s.teams[team]
        if group is not None and group in s.routes:
            return s.routes[group]
        return s.routes.get(route)

    def skipped(self, route: str, reason: str) -> None:
        self.skips.labels(route, reason).inc()

    def ask(self, route: str, settings: SemanticSettings, params: Any, identity: str | None,
            team: str | None) -> Lookup | None:
        owner = {"key": f"key:{identity or '-'}", "team": f"team:{team or '-'}",
                 "global": "global"}[settings.scope]
        scope = f"{route}|{owner}|{settings.embed}"  # vectors of one embeddings route only
        ask = ask_of(params, route=route, scope=scope, max_messages=settings.max_messages)
        if isinstance(ask, str):
            self.skipped(route, ask)
            return None
        return Lookup(route, scope, settings, ask)

    # -- lookups -------------------------------------------------------------------------
    def exact(self, lookup: Lookup) -> bool:
        """The whole request answered before: a hit with no embedding."""
        index = self.scopes.get(lookup.scope)
        entry = None if index is None else index.exact.get(lookup.ask.exact)
        if entry is None or entry.expires <= self.wall():
            return False
        assert index is not None
        index.touch(entry)
        lookup.hit, lookup.exact = entry, True
        lookup.similarity = index.alias_similarity.get(lookup.ask.exact, 1.0)
        self._hit(lookup)
        return True

    async def lookup(self, lookups: Sequence[Lookup]) -> None:
        """Each lookup answered: exact first, then one embedding per prompt (one call to each
        embeddings route) and the nearest neighbours that pass the guard."""
        todo = [lk for lk in lookups if not self.exact(lk)]
        by_route: dict[str, list[Lookup]] = {}
        for lk in todo:
            by_route.setdefault(lk.settings.embed, []).append(lk)
        for embed_route, group in by_route.items():
            vectors = await self.embed(embed_route, [lk.ask.text for lk in group])
            if vectors is None:
                for lk in group:
                    self.skipped(lk.route, "error")
                continue
            for lk, vector in zip(group, vectors, strict=True):
                lk.vector = vector
                self._nearest(lk)

    def _nearest(self, lk: Lookup) -> None:
        index = self.scopes.get(lk.scope)
        counts = self._counts(lk.route)
        counts.lookups += 1
        if index is None or lk.vector is None:
            self.lookups.labels(lk.route, "miss").inc()
            return
        threshold = min(1.0, lk.settings.threshold + self.raised.get(lk.scope, 0.0))
        for entry, similarity in index.nearest(lk.vector, lk.ask.neighbourhood, self.wall()):
            if similarity < threshold:
                break
            if lk.settings.guard:
                reason = disagreement(lk.ask.text, entry.text)
                if reason is not None:
                    self.refusals.labels(lk.route, reason).inc()
                    continue
            index.touch(entry)
            index.alias(lk.ask.exact, entry, similarity)
            lk.hit, lk.similarity = entry, similarity
            self._hit(lk, counted=True)
            return
        self.lookups.labels(lk.route, "miss").inc()

    def _counts(self, route: str) -> RouteCounts:
        found = self.counts.get(route)
        if found is None:
            found = self.counts[route] = RouteCounts()
        return found

    def _hit(self, lk: Lookup, counted: bool = False) -> None:
        counts = self._counts(lk.route)
        if not counted:
            counts.lookups += 1
        counts.hits += 1
        if lk.exact:
            counts.exact += 1
        self.lookups.labels(lk.route, "exact" if lk.exact else "hit").inc()
        assert lk.hit is not None
        lk.hit_id = f"h{self.replica}-{next(self._seq)}"
        if self.audit.maxlen:
            self.audit.append(Audit(lk.hit_id, self.wall(), lk.route, lk.scope, lk.hit.id,
                                    lk.similarity, lk.ask.text, lk.hit.text, lk.request_id,
                                    lk.hit.request_id, lk.exact, lk.settings.wrong_step))

    # -- stores ----------------------------------------------------------------------------
    def store(self, lk: Lookup, result: Any) -> None:
        """A miss's answer kept for the calls that ask it again."""
        if lk.hit is not None:
            return
        entry = Entry(f"{self.replica}-{next(self._seq)}", lk.scope, lk.route, lk.ask.neighbourhood,
                      lk.ask.exact, lk.ask.text, result, lk.request_id,
                      self.wall() + lk.settings.ttl_s, lk.vector)
        if lk.settings.guard:
            facts(entry.text)  # read now, on the miss, not on the hit that compares with it first
        op = {**entry_op(entry), "max_entries": lk.settings.max_entries} if self.log is not None else None
        self._add(entry, lk.settings.max_entries)
        if op is not None:
            self._send(op)

    def _add(self, entry: Entry, max_entries: int) -> None:
        index = self.scopes.get(entry.scope)
        if index is None:
            index = self.scopes[entry.scope] = ScopeIndex(max_entries)
            self.scope_route[entry.scope] = entry.route
        index.max_entries = max_entries  # a reload's new bound, from the next answer on
        index.add(entry)

    def _send(self, op: dict[str, Any]) -> None:
        if self.log is None:
            return
        q = self.queue
        if len(q.ops) >= 100_000:
            q.dropped += 1
            return
        op["by"] = self.replica  # read back from the log, it is not applied a second time
        q.ops.append(op)
        q.event.set()

    def apply(self, op: dict[str, Any]) -> None:
        """An operation from the log (this replica's own are already applied: a clear read back
        after this replica stored new answers would remove them)."""
        if op.get("by") == self.replica:
            return
        kind = op.get("op")
        if kind == "put":
            scope = self.scopes.get(op["scope"])
            if (scope is not None and op["id"] in scope.by_id) or float(op["expires"]) <= self.wall():
                return
            self._add(entry_of(op), int(op.get("max_entries") or self._max_entries(op["route"])))
        elif kind == "del":
            for scope in self.scopes.values():
                for entry_id in op.get("ids", []):
                    found = scope.by_id.get(entry_id)
                    if found is not None:
                        scope.remove(found)
        elif kind == "clear":
            self._clear(op.get("route"), op.get("key"))
        elif kind == "raise":
            self.raised[op["scope"]] = max(self.raised.get(op["scope"], 0.0), float(op["to"]))

    def _max_entries(self, route: str) -> int:
        s = self.section.routes.get(route)
        return s.max_entries if s is not None else 10_000

    # -- a reload ---------------------------------------------------------------------------
    def configure(self, section: SemanticSection, groups: Mapping[str, Sequence[str]]) -> list[str]:
        """A reloaded ``cache.semantic``, for the calls that come after it (new routes, keys,
        teams, thresholds, TTLs and bounds); ``groups``: each model group's routes. A scope's
        answers are kept where some new settings still make the same scope (its route, its kind
        of owner and its embeddings route), the rest dropped here (not through the log: each
        replica reloads its own file); the scopes dropped."""
        self.section = section
        if self.audit.maxlen != section.audit_size:
            self.audit = deque(self.audit, maxlen=section.audit_size)
        for name, value in (("poll_s", section.sync_ms / 1000.0), ("block_ms", int(section.sync_ms))):
            if hasattr(self.log, name):
                setattr(self.log, name, value)
        every = [*section.keys.values(), *section.teams.values()]
        dropped = []
        for name in list(self.scopes):
            route, _, rest = name.partition("|")
            owner, _, embed = rest.partition("|")
            kind = owner.partition(":")[0]
            found = [section.routes.get(route),
                     *(section.routes.get(g) for g, members in groups.items() if route in members)]
            if not any(s is not None and s.scope == kind and s.embed == embed for s in [*found, *every]):
                del self.scopes[name]
                self.scope_route.pop(name, None)
                self.raised.pop(name, None)
                dropped.append(name)
        return dropped

    # -- admin ------------------------------------------------------------------------------
    def hits(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest hits kept for audit, newest first."""
        return [a.view() for a in list(self.audit)[::-1][:limit]]

    def wrong(self, hit_id: str) -> dict[str, Any] | None:
        """A hit reported wrong: its entry removed everywhere and its scope's threshold raised by
        the scope's ``wrong_step``. None: no such hit kept."""
        found = next((a for a in self.audit if a.id == hit_id), None)
        if found is None:
            return None
        if not found.wrong:
            found.wrong = True
            scope = self.scopes.get(found.scope)
            entry = None if scope is None else scope.by_id.get(found.entry_id)
            if entry is not None and scope is not None:
                scope.remove(entry)
            self.raised[found.scope] = self.raised.get(found.scope, 0.0) + found.step
            self.wrong_hits.labels(found.route).inc()
            self._counts(found.route).wrong += 1
            self._send({"op": "del", "ids": [found.entry_id]})
            self._send({"op": "raise", "scope": found.scope, "to": self.raised[found.scope]})
        return {**found.view(), "threshold_raised_by": round(self.raised.get(found.scope, 0.0), 4)}

    def clear(self, route: str | None = None, key: str | None = None) -> int:
        """Entries removed by route, by key (its own scope), or all; how many."""
        n = self._clear(route, key)
        self._send({"op": "clear", "route": route, "key": key})
        return n

    def _clear(self, route: str | None, key: str | None) -> int:
        n = 0
        for name in list(self.scopes):
            scope_route, _, rest = name.partition("|")
            owner = rest.partition("|")[0]
            if route is not None and scope_route != route:
                continue
            if key is not None and owner != f"key:{key}":
                continue
            n += len(self.scopes.pop(name))
        return n

    def sizes(self) -> dict[str, int]:
        """Entries kept per route."""
        out: dict[str, int] = {}
        for name, index in self.scopes.items():
            route = self.scope_route.get(name, name.partition("|")[0])
            out[route] = out.get(route, 0) + len(index)
        return out

    # -- the background ---------------------------------------------------------------------
    async def run(self) -> None:
        """For the gateway's lifetime: replay the log, then write this replica's operations and
        read the others', and drop expired entries every second."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sweep)
            if self.log is not None:
                try:
                    for op in await self.log.start():
                        self.apply(op)
                except Exception as e:
                    log.warning("semantic cache: the log could not be replayed: %r", e)
                tg.start_soon(self._write)
                tg.start_soon(self._read)

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(1.0)
            now = self.wall()
            for index in list(self.scopes.values()):
                index.expire(now)

    async def _write(self) -> None:
        assert self.log is not None
        q = self.queue
        while True:
            await q.event.wait()
            q.event = anyio.Event()
            ops, q.ops = q.ops, []
            try:
                await self.log.append(ops)
            except Exception as e:
                log.warning("semantic cache: %d operations not written: %r", len(ops), e)
                await anyio.sleep(1.0)

    async def _read(self) -> None:
        assert self.log is not None
        while True:
            try:
                for op in await self.log.since():
                    self.apply(op)
            except Exception as e:
                log.warning("semantic cache: the log could not be read: %r", e)
                await anyio.sleep(1.0)

    async def aclose(self) -> None:
        if self.log is not None:
            ops, self.queue.ops = self.queue.ops, []
            if ops:
                with anyio.move_on_after(2.0):
                    await self.log.append(ops)
            await self.log.aclose()


class _Sizes(Collector):
    def __init__(self, cache: SemanticCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily("multiplexer_semantic_cache_entries", "Answers the semantic "
                                 "cache keeps, by route", labels=["route"])
        for route, n in sorted(self.cache.sizes().items()):
            size.add_metric([route], n)
        return iter([size])
