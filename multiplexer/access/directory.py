"""Every key the gateway knows, for the hot path: the YAML's and the store's, by digest.

The stored keys live in memory as a snapshot (digest -> key), reloaded every ``ttl_s`` and at
once when any replica or worker changes a key (``Invalidation`` through ``state.url``, the
sibling sockets of ``serve --workers N``), so checking a key is one SHA-256 of the bearer and
one dict lookup, never a store round trip. Two answers never come from a snapshot that may be
a moment old (``probe.py`` asks the store): whether the store has issued a key yet (until it
has, callers without one are served), and whether a bearer the snapshot does not know is a key
made since (asked at most once per ``MISS_EVERY_S``, so unknown bearers cannot make every
request a store read). A replica that cannot reach the store keeps its last snapshot for
``stale_s``, then refuses stored keys; a key it never loaded is refused throughout. Budgets and
quotas read a key through ``entry`` and ``team``, whichever source it came from (an OAuth
caller, ``oauth:<sub>``, is a key of the team its token names); its rpm, tpm and concurrency
join the per-key quotas.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import SecretStr

from multiplexer.access.entries import Access, KeyEntry, TeamEntry, entry
from multiplexer.access.keystore import KeyRow, KeyStore, TeamRow
from multiplexer.access.probe import ProbeDown, StoreProbe
from multiplexer.access.rules import Rules
from multiplexer.access.settings import KeyStoreSettings, VirtualServer
from multiplexer.core.errors import unauthorized
from multiplexer.core.policy import Quota

log = logging.getLogger(__name__)
MAX_BOUND = 10_000  # OAuth subjects remembered (the least recent forgotten first; its next call binds again)
MISS_EVERY_S = 0.1  # an unknown bearer asks the store whether it is a new key at most this often
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
                 store: KeyStore | None = None, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or KeyStoreSettings()
        self.store = store
        self.probe: StoreProbe | None = None  # the store asked directly (opened with the store)
        self.wall = wall
        self.clock = clock
        self.static: dict[str, KeyEntry] = {name: entry(v) for name, v in api_keys.items()}
        self.static_teams = dict(teams)
        self.quotas = quotas  # the gateway's per-key quotas (core.quota.Quotas): keys' limits join them
        self._configured = set(quotas.quotas)  # server.quotas entries: never overwritten
        self.stored: dict[bytes, Live] = {}
        self.entries: dict[str, KeyEntry] = {}  # stored identity -> its key as a KeyEntry
        self.stored_teams: dict[str, TeamEntry] = {}
        self.servers: dict[str, VirtualServer] = {}  # virtual MCP servers made through the admin API
        self.rules: dict[str, Rules] = {}  # identity -> its rules (absent: may use everything)
        self.bound: OrderedDict[str, str | None] = OrderedDict()  # OAuth identities -> team claim, LRU
        self.principals: dict[str, KeyEntry] = {}  # each bound OAuth identity as a key of its team
        self._as_team: dict[str | None, tuple[KeyEntry, Rules | None, Quota | None]] = {}
        self.admin: Any = None  # the admin API's operations (access.admin_ops.KeyAdmin) while running
        # after a write here, who else must reload: state.url's channel, the sibling workers
        self.announcers: list[Callable[[str], Awaitable[None]]] = []
        # loads so far, and OAuth bindings changed: whoever caches what ``entry`` answers looks
        # again when it moves (spend's budgets); tests wait on it
        self.version = 0
        self._missed_at = -MISS_EVERY_S  # clock time of the last unknown bearer asked about
        self._reads = 0  # store reads begun, numbered
        self._installed = 0  # the number of the read installed last
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
            raise unauthorized("key expired", min(t for t in (live.expires_at, live.until) if t is not None))
        if self.loaded_at is not None and now - self.loaded_at > self.settings.stale_s:
            raise unauthorized("the key store is unreachable")
        return live.identity

    def identify_new(self, digest: bytes) -> str | None:
        """A bearer no key matched: a key made since the snapshot, if the store has it live (the
        store asked at most once per ``MISS_EVERY_S``, then reloaded on a hit)."""
        now = self.clock()
        if self.probe is None or now - self._missed_at < MISS_EVERY_S:
            return None
        self._missed_at = now
        try:
            if not self.probe.live(digest.hex()) or not self._load_now():
                return None
        except ProbeDown:
            self._probe_failed()
            return None
        return self.identify(digest)

    def keys_required(self) -> bool:
        """Whether every call needs a key: once the store issued one, on every worker at once (a
        snapshot without keys is confirmed by the store before a caller without a key is served)."""
        if self.issued or self.probe is None:
            return self.issued
        try:
            if self.probe.any_key():
                self._load_now()
                self.issued = True  # even if the load failed: the store holds a key
        except ProbeDown:  # the store cannot say: the snapshot decides, as it does for keys
            self._probe_failed()
        return self.issued

    def _probe_failed(self) -> None:
        if self.probe is not None and self.probe.down:
            self.changed()  # the reload loop opens the probe's connection again, off the hot path

    def entry(self, identity: str | None) -> KeyEntry | None:
        """A key as config writes it (team, access, limits, budget), stored or from the YAML; an
        OAuth caller's as a key of the team its token named."""
        if identity is None:
            return None
        return self.static.get(identity) or self.entries.get(identity) or self.principals.get(identity)

    def team(self, name: str | None) -> TeamEntry | None:
        if name is None:
            return None
        return self.static_teams.get(name) or self.stored_teams.get(name)

    def rules_of(self, identity: str | None) -> Rules | None:
        return self.rules.get(identity) if identity is not None else None

    def bind(self, identity: str, team: str | None) -> None:
        """An OAuth caller (``oauth:<sub>``) is a key of the team its token names: that team's
        access, quotas and budget; one without a known team may use nothing (a token's claim never
        widens what the config grants). A token that names another team later binds again."""
        bound = self.bound
        if identity in bound and bound[identity] == team:
            bound.move_to_end(identity)  # bound already (each request of a token binds)
            return
        if len(bound) >= MAX_BOUND and identity not in bound:
            self._unbind(bound.popitem(last=False)[0])
        bound[identity] = team
        bound.move_to_end(identity)
        self._principal(identity, team)
        self._moved()

    def _principal(self, identity: str, team: str | None) -> None:
        found = self._as_team.get(team)
        if found is None:  # one entry, rules and quota per team, however many callers it has
            key = KeyEntry(key=SecretStr(""), team=team)
            known = self.team(team)
            found = self._as_team[team] = (key, NOTHING if known is None else Rules.of(known),
                                           None if known is None else self._limits(identity, key))
        key, rules, quota = found
        self.principals[identity] = key
        if rules is None:
            self.rules.pop(identity, None)
        else:
            self.rules[identity] = rules
        if identity not in self._configured:
            self.quotas.set_limits(identity, quota)

    def _unbind(self, identity: str) -> None:
        self.principals.pop(identity, None)
        self.rules.pop(identity, None)
        if identity not in self._configured:
            self.quotas.set_limits(identity, None)

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

    def configure(self, api_keys: Mapping[str, SecretStr | KeyEntry], teams: Mapping[str, TeamEntry],
                  configured: set[str]) -> None:
        """The config's keys and teams read again (a config reload, on the event loop): every key's
        rules and limits from them for new calls; ``configured``: the ``server.quotas`` names now,
        whose quotas the keys' own never overwrite."""
        gone = set(self.static) - set(api_keys)
        self.static = {name: entry(v) for name, v in api_keys.items()}
        self.static_teams = dict(teams)
        self._configured = set(configured)
        for name in gone:
            self.rules.pop(name, None)
            if name not in self._configured:
                self.quotas.set_limits(name, None)
        for name, key in [*self.static.items(), *self.entries.items()]:
            rules = Rules.of(self.team(key.team), key)
            if rules is None:
                self.rules.pop(name, None)
            else:
                self.rules[name] = rules
            if name not in self._configured:
                self.quotas.set_limits(name, self._limits(name, key))
        self._as_team.clear()
        for identity, team in self.bound.items():  # a team's change reaches OAuth callers too
            self._principal(identity, team)
        self._moved()

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
        self._as_team.clear()
        for identity, team in self.bound.items():  # a team's change reaches OAuth callers too
            self._principal(identity, team)
        self._static_limits()  # a YAML key's team may be a stored one
        self.loaded_at = self.wall()
        self._moved()

    def _moved(self) -> None:
        self.version += 1
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            loaded.set()

    def _load_now(self) -> bool:
        """Read the store and install it without leaving the event loop (the hot path's answer
        depends on it: rare, and bounded by its callers); False when the store cannot be read."""
        store = self.store
        if store is None:
            return False
        try:
            self._reads += 1
            read = self._reads
            self._installs(read, store.keys(), store.teams(), store.servers())
        except Exception as e:
            log.warning("key store unreachable: %s", str(e).splitlines()[0][:200] if str(e) else e)
            return False
        return True

    async def load(self) -> None:
        """Read the store once and install what it holds (raises when it is unreachable)."""
        assert self.store is not None
        store = self.store
        self._reads += 1
        read = self._reads
        keys, teams, servers = await store.run(
            lambda: (store.keys(), store.teams(), store.servers()))  # revoked ones too: issued
        self._installs(read, keys, teams, servers)

    def _installs(self, read: int, keys: list[KeyRow], teams: list[TeamRow],
                  servers: Sequence[TeamRow]) -> None:
        """Install read number ``read`` unless one begun after it is in already: loads overlap
        (the reload loop, a sibling's write, this worker's own, a hot-path check), and a read
        begun before a revocation must never replace one that saw it."""
        if read < self._installed:
            return
        self._installed = read
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

    async def reload(self) -> None:
        """A sibling wrote: reload before answering it (a failure leaves the reload loop to it)."""
        try:
            await self.load()
        except Exception as e:
            log.warning("key store unreachable after a change elsewhere: %s", str(e).splitlines()[0][:200])
            self.changed()

    async def announce(self, what: str) -> None:
        """After a write here: every other replica and worker reloads (what changed, no secret)."""
        for tell in list(self.announcers):
            await tell(what)

    async def refresh_forever(self) -> None:
        """Reload on every change and every ``ttl_s``; a failed load keeps the last snapshot."""
        self._changed = anyio.Event()
        while True:
            with anyio.move_on_after(self.settings.ttl_s):
                await self._changed.wait()
            self._changed = anyio.Event()  # a change from here on reloads again
            try:
                if self.probe is not None and self.probe.down:
                    await anyio.to_thread.run_sync(self.probe.mend)
                await self.load()
            except Exception as e:  # the store is down: keep serving what was loaded
                log.warning("key store unreachable, serving the keys loaded %.0f s ago: %s",
                            self.wall() - (self.loaded_at or self.wall()), str(e).splitlines()[0][:200])
