"""Prompt-cache affinity for model groups: calls that share a cacheable prefix go to one member.

A provider caches a prompt's prefix where it served it, so a conversation whose turns land on
different routes pays for its prefix on each. Rendezvous (highest random weight) hashing ranks a
group's routes by a score of (key, route): every replica ranks alike with no shared state, and a
route that leaves the group moves only its own keys. The key and the ranking are
``core/cache_affinity.py``'s (a provider's ``base_urls`` use the same): the caller's
``prompt_cache_key``, else its ``x-session-id``, else (``affinity: session``) the session its body
names, or (``affinity: prefix``) a hash of the prompt's stable head. Bounded load sends a key past
a member with far more calls in flight than the group's mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multiplexer.core.cache_affinity import (
    CACHED_OPERATIONS,
    LOAD_FACTOR,
    Mode,
    call_key,
    digest64,
    moves_tally,
    ranking,
    saturated,
)
from multiplexer.core.policy import GroupConfig, RouteConfig

# the key and the picker live in core (``core/cache_affinity.py``), shared with ``base_urls``
__all__ = ["CACHED_OPERATIONS", "LOAD_FACTOR", "Affinity", "Mode", "affinities", "call_key",
           "mode_of", "moves_tally", "ranking", "saturated"]


@dataclass(frozen=True, slots=True)
class Affinity:
    """A group's affinity: its mode and its members' seeds and rendezvous weights."""

    group: str
    mode: Mode
    members: tuple[tuple[str, int, float], ...]  # (route, seed, weight)

    def key(self, params: Any, session: str | None = None) -> int | None:
        return call_key(params, self.mode, session)

    def ranking(self, key: int) -> list[str]:
        """The routes best first for ``key``: weighted rendezvous, score = -w / ln(u), u the
        (key, route) hash in (0, 1); a route of weight 0 comes last."""
        return ranking(key, self.members)


def mode_of(group: GroupConfig, routes: Mapping[str, RouteConfig]) -> Mode:
    """The group's ``affinity``; left out, ``prefix`` when every route is chat or messages."""
    if group.affinity is not None:
        return group.affinity
    cached = all(routes[n].operation in CACHED_OPERATIONS for n in group.routes if n in routes)
    return "prefix" if cached else "off"


def affinities(groups: Mapping[str, GroupConfig], routes: Mapping[str, RouteConfig]) -> dict[str, Affinity]:
    """The groups whose calls keep to one member, by name."""
    out = {}
    for name, group in groups.items():
        mode = mode_of(group, routes)
        if mode == "off":
            continue
        weights = group.weights if group.strategy == "weighted" else {}
        members = tuple((r, digest64(r.encode()), max(weights.get(r, 1.0), 0.0)) for r in group.routes)
        out[name] = Affinity(name, mode, members)
    return out
