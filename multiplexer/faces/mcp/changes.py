"""List changes (tools, resources, prompts) heard by every replica's listeners once.

Each replica hears its upstreams' list changes on its own upstream sessions, and some changes only
one replica sees (an upstream that tells only the session whose call changed it, a tool approved
or quarantined by that replica's own check). With ``state.url`` each change a replica hears goes on
its MCP mount's channel too (``replica_sessions.py``), and every other replica hands it to its own
listeners (2026-07-28 ``subscriptions/listen`` streams, handshake-era connections). A change is
named by its content (``change_id``: the event and what it says, for tools the digest of their
definitions), so the same change heard by several replicas, itself and from others, reaches each
listener once: a change heard from another replica is dropped when this one already had it
within ``WINDOW_S``, and one this replica hears itself is dropped when another's came first.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

WINDOW_S = 2.0  # one change heard by several replicas arrives within this of itself


def change_id(event: str, data: dict[str, Any]) -> str:
    """The same change names itself alike on every replica that hears it."""
    text = json.dumps([event, data], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ListChanges:
    """Which changes this replica's listeners had lately, here and from other replicas."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._here: dict[str, float] = {}  # change id -> when this replica heard it itself
        self._there: dict[str, float] = {}  # change id -> when another replica's arrived
        self.share: Callable[[str, str], None] | None = None  # (event, change id) to the others
        self.dropped = 0  # changes not passed on: this replica's listeners had them already

    def _prune(self, now: float) -> None:
        for seen in (self._here, self._there):
            for change, at in list(seen.items()):
                if now - at >= WINDOW_S:
                    del seen[change]

    def heard_here(self, event: str, data: dict[str, Any]) -> bool:
        """A change this replica heard: True when its listeners should have it (and it is passed
        on to the other replicas); False when another replica's copy of it came first."""
        now = self._clock()
        self._prune(now)
        change = change_id(event, data)
        if change in self._there:
            self.dropped += 1
            return False
        self._here[change] = now
        if self.share is not None:
            self.share(event, change)
        return True

    def heard_there(self, change: str) -> bool:
        """Another replica's change: True when this replica's listeners have not had it yet."""
        now = self._clock()
        self._prune(now)
        if change in self._here or change in self._there:
            self.dropped += 1
            return False
        self._there[change] = now
        return True
