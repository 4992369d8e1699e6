"""Each key's name by identity, for what people read: spend reports and the dashboard.

Spend is kept by identity (a stored key's ``key_...`` id, a config key's name), which says little
to a reader. The key directory's snapshot keeps no names, so the store is read for them, once per
load of the directory (its ``version``: every ``ttl_s`` and after every write, a rename included),
however many pages and reports ask; revoked keys keep their names, since their spend stays. A
config key's name is its identity.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import anyio

log = logging.getLogger(__name__)


class Directory(Protocol):
    """What this reads of ``directory.KeyDirectory``."""

    @property
    def store(self) -> Any: ...  # keystore.KeyStore, or None without a key store

    @property
    def version(self) -> int: ...

    @property
    def static(self) -> Mapping[str, Any]: ...


class KeyNames:
    def __init__(self, directory: Directory) -> None:
        self.directory = directory
        self.reads = 0  # store reads so far
        self._stored: dict[str, str] = {}
        self._version: int | None = None  # the directory's version the names were read at
        self._lock = anyio.Lock()

    async def of(self, identity: str | None) -> str | None:
        """The key's name: a stored key's, a config key's identity, None for any other caller."""
        if identity is None:
            return None
        if identity in self.directory.static:
            return identity
        return (await self._names()).get(identity)

    async def named(self, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Rows with a ``key`` (spend by key) given ``key_name`` right after it; new dicts, the
        rows left as they are (a cached report's)."""
        out = []
        for row in rows:
            if "key" not in row:
                out.append(dict(row))
                continue
            named: dict[str, Any] = {}
            for k, v in row.items():
                named[k] = v
                if k == "key":
                    named["key_name"] = await self.of(v)
            out.append(named)
        return out

    async def _names(self) -> dict[str, str]:
        version = self.directory.version
        if self._version == version:
            return self._stored
        async with self._lock:  # callers at once: one read
            if self._version != version and self.directory.store is not None:
                store = self.directory.store
                self.reads += 1
                try:
                    rows = await store.run(store.keys)
                except Exception as e:  # the store is down: the last names stay until the next load
                    log.warning("key names could not be read, showing the last ones: %s",
                                str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                else:
                    self._stored = {r.id: r.name for r in rows}
            self._version = version
        return self._stored
