"""Every key the gateway knows, for the hot path: the YAML's and the store's, by digest.

The stored keys live in memory as a snapshot (digest -> key), reloaded every ``ttl_s`` and at
once when any replica changes a key (``Invalidation`` through ``state.url``), so checking a
key is one SHA-256 of the bearer and one dict lookup, never a store round trip. A replica that
cannot reach the store keeps its last snapshot for ``stale_s``, then refuses stored keys; a key
it never loaded is refused throughout. Budgets and quotas read a key through ``entry`` and
``team``, whichever source it came from; its rpm, tpm and concurrency join the per-key quotas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import SecretStr

from multiplexer.access.entries import Access, KeyEntry, TeamEntry, entry
from multiplexer.access.keystore import KeyRow, KeyStore, TeamRow
from multiplexer.access.rules import Rules
from multiplexer.access.settings import KeyStoreSettings, VirtualServer
from multiplexer.core.errors import Code, RpcError
from multiplexer.core.policy import Quota

log = logging.getLogger(__name__)
MAX_BOUND = 10_000  # OAuth subjects remembered (the oldest forgotten first; the next call binds again)
NOTHING = Rules(models=((),), routes=((),), tools=((),))
LIMIT_FIELDS = ("models", "routes", "tools", "rpm", "tpm", "concurrency", "budget_usd", "metadata")


@dataclass(slots=True, frozen=True)
class Live:
    """A stored key as the hot path checks it."""

    identity: str
    expires_at: float | None  # wall time; None: never
    until: float | None = None  # a rotated-out digest's end of grace


def access_of(data: Mapping[str, Any]) -> Access:
    return Access.model_validate({k: v for k, v in data.items() if k in LIMIT_FIELDS})


def narrowed(key: int | float | None, team: int | float | None) -> Any:
    """A key's limit under its team's: the smaller of those set."""
    if key is None or team is None:
        return key if team is None else team
    return min(key, team)


class KeyDirectory:
    def __init__(self, api_keys: Mapping[str, SecretStr | KeyEntry], teams: Mapping[str, TeamEntry],
                 quotas: Any, settings: KeyStoreSettings | None = None,
                 store: KeyStore | None = None, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings or KeyStoreSettings()
        self.store = store
        self.wall = wall
        self.static: dict[str, KeyEntry] = {name: entry(v) for name, v in api_keys.items()}
        self.static_teams = dict(teams)
        self.quotas = quotas  # the gateway's per-key quotas (core.quota.Quotas): keys' limits join them
        self._configured = set(quotas.quotas)  # server.quotas entries: never overwritten
        self.stored: dict[bytes, Live] = {}
        self.entries: dict[str, KeyEntry] = {}  # stored identity -> its key as a KeyEntry
        self.stored_teams: dict[str, TeamEntry] = {}
        self.servers: dict[str, VirtualServer] = {}  # virtual MCP servers made through the admin API
        self.rules: dict[str, Rules] = {}  # identity -> its rules (absent: may use everything)
        self.bound: dict[str, str | None] = {}  # OAuth identities seen -> their team claim
        self.admin: Any = None  # the admin API's operations (access.admin_ops.KeyAdmin) while running
        self.version = 0  # loads so far (tests wait on it)
        # a key was ever created in the store (revoked ones count): from then on every call needs
        # a key; before, callers without one are served as they were without api_keys
        self.issued = False
        self.loaded_at: float | None = None  # wall time of the last good load
        self._changed: anyio.Event | None = None  # made inside the event loop, when first needed
        self._loaded: anyio.Event | None = None
        self._static_limits()

    @property
    def enabled(self) -> bool:
        return self.store is not None

    # -- lookups -------------------------------------------------------------------------
    def identify(self, digest: bytes) -> str | None:
        """The stored key with this digest, if live now; raises -32005 for an expired one."""
        live = self.stored.get(digest)
        if live is None:
            return None
        now = self.wall()
        if (live.expires_at is not None and now >= live.expires_at) or (
                live.until is not None and now >= live.until):
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized", {"detail": "key expired"})
        if self.loaded_at is not None and now - self.loaded_at > self.settings.stale_s:
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized",
                           {"detail": "the key store is unreachable"})
        return live.identity

    def entry(self, identity: str | None) -> KeyEntry | None:
        """A key as config writes it (team, access, limits, budget), stored or from the YAML."""
        if identity is None:
            return None
        return self.static.get(identity) or self.entries.get(identity)

    def team(self, name: str | None) -> TeamEntry | None:
        if name is None:
            return None
        return self.static_teams.get(name) or self.stored_teams.get(name)

    def rules_of(self, identity: str | None) -> Rules | None:
        return self.rules.get(identity) if identity is not None else None

    def bind(self, identity: str, team: str | None, force: bool = False) -> None:
        """An OAuth caller (``oauth:<sub>``) gets its team's access; one without a known team may
        use nothing (a token's claim never widens what the config grants)."""
        if identity in self.bound and self.bound[identity] == team and not force:
            return  # bound already (each request of a token binds: nothing is rebuilt)
        if len(self.bound) >= MAX_BOUND and identity not in self.bound:
            self.bound.pop(next(iter(self.bound)))
        self.bound[identity] = team
        known = self.team(team)
        rules = NOTHING if known is None else Rules.of(known)
        if rules is None:
            self.rules.pop(identity, None)
        else:
            self.rules[identity] = rules

    # -- building ------------------------------------------------------------------------
    def _limits(self, identity: str, key: KeyEntry) -> Quota | None:
        team = self.team(key.team)
        rpm = narrowed(key.rpm, team.rpm if team else None)
        tpm = narrowed(key.tpm, team.tpm if team else None)
        concurrency = narrowed(key.concurrency, team.concurrency if team else None)
        if rpm is None and tpm is None and concurrency is None:
            return None
        return Quota(rpm=rpm, tpm=tpm, concurrency=concurrency)

    def _static_limits(self) -> None:
        for name, key in self.static.items():
            rules = Rules.of(self.team(key.team), key)
            if rules is not None:
                self.rules[name] = rules
            quota = self._limits(name, key)
            if quota is not None and name not in self._configured:
                self.quotas.set_limits(name, quota)

    def install(self, keys: list[KeyRow], teams: list[TeamRow], servers: Sequence[TeamRow] = ()) -> None:
        """Swap in a new snapshot of the store (called on the event loop: no await inside)."""
        self.stored_teams = {t.id: TeamEntry.model_validate(t.access) for t in teams}
        self.servers = {s.id: VirtualServer.model_validate(s.access) for s in servers}
        stored: dict[bytes, Live] = {}
        entries: dict[str, KeyEntry] = {}
        self.issued = self.issued or bool(keys)
        for row in keys:
            if row.revoked_at is not None:
                continue
            stored[bytes.fromhex(row.digest)] = Live(row.id, row.expires_at)
            if row.old_digest and row.old_valid_until:
                stored[bytes.fromhex(row.old_digest)] = Live(row.id, row.expires_at, row.old_valid_until)
            entries[row.id] = KeyEntry.model_validate(
                {**{k: v for k, v in row.access.items() if k in LIMIT_FIELDS},
                 "key": f"sha256:{row.digest}", "team": row.team,
                 "expires_at": row.expires_at})
        for identity in set(self.entries) - set(entries):
            self.rules.pop(identity, None)
            if identity not in self._configured:
                self.quotas.set_limits(identity, None)
        for identity, key in entries.items():
            rules = Rules.of(self.team(key.team), key)
            if rules is None:
                self.rules.pop(identity, None)
            else:
                self.rules[identity] = rules
            if identity not in self._configured:
                self.quotas.set_limits(identity, self._limits(identity, key))
        self.stored, self.entries = stored, entries
        for identity, team in list(self.bound.items()):  # a team's change reaches OAuth callers too
            self.bind(identity, team, force=True)
        self._static_limits()  # a YAML key's team may be a stored one
        self.loaded_at = self.wall()
        self.version += 1
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            loaded.set()

    async def load(self) -> None:
        """Read the store once and install what it holds (raises when it is unreachable)."""
        assert self.store is not None
        store = self.store
        keys, teams, servers = await store.run(
            lambda: (store.keys(), store.teams(), store.servers()))  # revoked ones too: issued
        self.install(keys, teams, servers)

    async def wait_version(self, version: int) -> None:
        """Until at least ``version`` loads happened (tests, and a write's own replica)."""
        while self.version < version:
            if self._loaded is None:
                self._loaded = anyio.Event()
            await self._loaded.wait()

    def changed(self) -> None:
        """Something changed in the store: reload now (an invalidation or this replica's write)."""
        if self._changed is not None:
            self._changed.set()

    async def refresh_forever(self) -> None:
        """Reload on every change and every ``ttl_s``; a failed load keeps the last snapshot."""
        self._changed = anyio.Event()
        while True:
            with anyio.move_on_after(self.settings.ttl_s):
                await self._changed.wait()
            self._changed = anyio.Event()  # a change from here on reloads again
            try:
                await self.load()
            except Exception as e:  # the store is down: keep serving what was loaded
                log.warning("key store unreachable, serving the keys loaded %.0f s ago: %s",
                            self.wall() - (self.loaded_at or self.wall()), str(e).splitlines()[0][:200])
