"""What the admin API does to keys and teams: each change written with its audit row in one
transaction, then announced so every replica reloads (this one before it answers).

A change names only the fields it sets, and the store writes just those in one conditional
statement (``access.keystore``): two requests that race never undo each other, and a revoked
key stays revoked whatever PATCH or rotation raced its ``DELETE`` (they answer 409)."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio

from multiplexer.access.api import (
    AuditOut,
    KeyCreated,
    KeyIn,
    KeyOut,
    KeyPatch,
    McpServerIn,
    McpServerOut,
    McpServerPatch,
    Rotated,
    RotateIn,
    TeamIn,
    TeamOut,
    TeamPatch,
)
from multiplexer.access.directory import LIMIT_FIELDS, KeyDirectory
from multiplexer.access.keystore import AuditRow, Change, KeyRow, KeyStore, TeamRow
from multiplexer.access.secrets import digest
from multiplexer.core.errors import Code, RpcError, invalid_params

KEY_PREFIX = "mx-"
PREFIX_SHOWN = 10  # "mx-" and 7 characters of the key
TEAM_FIELDS = tuple(TeamPatch.model_fields)


class Conflict(Exception):
    """A name already taken, or a change to a revoked key (409)."""


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _at(wall: float | None) -> datetime | None:
    return None if wall is None else datetime.fromtimestamp(wall, UTC)


def _when(wall: float) -> datetime:
    return datetime.fromtimestamp(wall, UTC)


def _wall(at: datetime | None) -> float | None:
    if at is None:
        return None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def not_found(what: str, name: str) -> RpcError:
    return RpcError(Code.NOT_FOUND, "Not Found", {"detail": f"no {what} {name!r}"})


def key_out(row: KeyRow, cls: type[KeyOut] = KeyOut, **extra: Any) -> Any:
    return cls(id=row.id, name=row.name, prefix=row.prefix, team=row.team,
               expires_at=_at(row.expires_at), created_at=_when(row.created), updated_at=_when(row.updated),
               revoked_at=_at(row.revoked_at), old_key_valid_until=_at(row.old_valid_until),
               **row.access, **extra)


def team_out(row: TeamRow) -> TeamOut:
    return TeamOut(id=row.id, name=row.id, created_at=_when(row.created), updated_at=_when(row.updated),
                   **row.access)


def settings_change(given: dict[str, Any], fields: tuple[str, ...],
                    columns: dict[str, Any] | None = None) -> Change:
    """What a PATCH writes: the settings ``fields`` it names (a value sets one, null clears it)
    and whole ``columns``."""
    named = {f: v for f, v in given.items() if f in fields}
    return Change(columns=columns or {}, settings={f: v for f, v in named.items() if v is not None},
                  cleared=tuple(f for f, v in named.items() if v is None))


def server_out(row: TeamRow) -> McpServerOut:
    return McpServerOut(id=row.id, name=row.id, created_at=_when(row.created),
                        updated_at=_when(row.updated), **row.access)


class KeyAdmin:
    def __init__(self, store: KeyStore, directory: KeyDirectory, grace_s: float,
                 announce: Callable[[str], Awaitable[None]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.directory = directory
        self.grace_s = grace_s
        self.announce = announce
        self.wall = wall
        self._reload = anyio.Lock()
        self._asked = 0  # changes written here so far
        self._covered = 0  # ... of which a finished reload read every one

    def _audit(self, actor: str, action: str, target: str | None, detail: dict[str, Any]) -> AuditRow:
        return AuditRow(uuid.uuid4().hex, self.wall(), actor, action, target, detail)

    async def _changed(self, what: str) -> None:
        """Reload here before answering (a key made here works here at once), then tell the rest.

        Reloads run one at a time, each reading the store after every change already written:
        a snapshot read before a revocation is never installed after one read since, and changes
        arriving together share one reload instead of one each."""
        self._asked += 1
        mine = self._asked
        async with self._reload:
            if self._covered < mine:
                reads = self._asked
                await self.directory.load()
                self._covered = reads
        if self.announce is not None:
            await self.announce(what)

    def _known_team(self, team: str | None) -> None:
        if team is not None and self.directory.team(team) is None:
            raise invalid_params(f"no team {team!r} (create it with POST /admin/teams)", param="team")

    # -- keys --------------------------------------------------------------------------------
    async def create_key(self, body: KeyIn, actor: str) -> KeyCreated:
        self._known_team(body.team)
        key, now = new_key(), self.wall()
        access = body.model_dump(mode="json", include=set(LIMIT_FIELDS), exclude_none=True)
        row = KeyRow("key_" + uuid.uuid4().hex[:16], body.name, key[:PREFIX_SHOWN], digest(key).hex(),
                     body.team, access, _wall(body.expires_at), now, now)
        detail = body.model_dump(mode="json", exclude_none=True)
        await self.store.run(self.store.add_key, row, self._audit(actor, "keys.create", row.id, detail))
        await self._changed(f"key {row.id}")
        return key_out(row, KeyCreated, key=key)  # type: ignore[no-any-return]

    async def key(self, key_id: str) -> KeyRow:
        row = await self.store.run(self.store.key, key_id)
        if row is None:
            raise not_found("key", key_id)
        return row

    async def list_keys(self, team: str | None = None) -> list[KeyOut]:
        rows = await self.store.run(self.store.keys, team)
        return [key_out(r) for r in rows]

    async def _not_live(self, key_id: str) -> Conflict:
        """Why a change found no live key: 404 when there is none, else it is revoked (for good)."""
        await self.key(key_id)
        return Conflict(f"key {key_id} is revoked")

    async def update_key(self, key_id: str, patch: KeyPatch, actor: str) -> KeyOut:
        given = patch.model_dump(mode="json", exclude_unset=True)
        if "team" in given:
            self._known_team(patch.team)
        if "name" in given and patch.name is None:
            raise invalid_params("name may not be null", param="name")
        columns: dict[str, Any] = {f: getattr(patch, f) for f in ("name", "team") if f in given}
        if "expires_at" in given:
            columns["expires_at"] = _wall(patch.expires_at)
        change = settings_change(given, LIMIT_FIELDS, columns)
        audit = self._audit(actor, "keys.update", key_id, given)
        row = await self.store.run(self.store.change_key, key_id, change, self.wall(), audit)
        if row is None:
            raise await self._not_live(key_id)
        await self._changed(f"key {key_id}")
        return key_out(row)  # type: ignore[no-any-return]

    async def rotate_key(self, key_id: str, body: RotateIn, actor: str) -> Rotated:
        grace = self.grace_s if body.grace_s is None else body.grace_s
        key, now = new_key(), self.wall()
        audit = self._audit(actor, "keys.rotate", key_id, {"grace_s": grace})
        row = await self.store.run(self.store.rotate_key, key_id, digest(key).hex(), key[:PREFIX_SHOWN],
                                   now + grace if grace > 0 else None, now, audit)
        if row is None:
            raise await self._not_live(key_id)
        await self._changed(f"key {key_id}")
        return Rotated(id=key_id, key=key, prefix=row.prefix, old_key_valid_until=_at(row.old_valid_until))

    async def revoke_key(self, key_id: str, actor: str) -> KeyOut:
        """Revoked from now on; a key revoked before is answered as it is (nothing written)."""
        audit = self._audit(actor, "keys.revoke", key_id, {})
        row = await self.store.run(self.store.revoke_key, key_id, self.wall(), audit)
        if row is None:
            return key_out(await self.key(key_id))  # type: ignore[no-any-return]
        await self._changed(f"key {key_id}")
        return key_out(row)  # type: ignore[no-any-return]

    # -- teams -------------------------------------------------------------------------------
    async def create_team(self, body: TeamIn, actor: str) -> TeamOut:
        if body.name in self.directory.static_teams:
            raise Conflict(f"team {body.name!r} is defined in the config (server.teams)")
        now = self.wall()
        access = body.model_dump(mode="json", exclude={"name"}, exclude_none=True)
        row = TeamRow(body.name, access, now, now)
        detail = body.model_dump(mode="json", exclude_none=True)
        if not await self.store.run(self.store.add_team, row,
                                    self._audit(actor, "teams.create", body.name, detail)):
            raise Conflict(f"team {body.name!r} exists")
        await self._changed(f"team {body.name}")
        return team_out(row)

    async def list_teams(self) -> list[TeamOut]:
        return [team_out(r) for r in await self.store.run(self.store.teams)]

    async def update_team(self, team_id: str, patch: TeamPatch, actor: str) -> TeamOut:
        given = patch.model_dump(mode="json", exclude_unset=True)
        audit = self._audit(actor, "teams.update", team_id, given)
        row = await self.store.run(self.store.change_team, team_id, settings_change(given, TEAM_FIELDS),
                                   self.wall(), audit)
        if row is None:
            raise not_found("team", team_id)
        await self._changed(f"team {team_id}")
        return team_out(row)

    # -- virtual MCP servers -------------------------------------------------------------------
    async def create_server(self, body: McpServerIn, actor: str, configured: set[str]) -> McpServerOut:
        if body.name in configured:
            raise Conflict(f"MCP server {body.name!r} is defined in the config (mcp_servers)")
        now = self.wall()
        row = TeamRow(body.name, body.model_dump(mode="json", exclude={"name"}), now, now)
        audit = self._audit(actor, "mcp_servers.create", body.name, body.model_dump(mode="json"))
        if not await self.store.run(self.store.add_server, row, audit):
            raise Conflict(f"MCP server {body.name!r} exists")
        await self._changed(f"mcp server {body.name}")
        return server_out(row)

    async def list_servers(self) -> list[McpServerOut]:
        return [server_out(r) for r in await self.store.run(self.store.servers)]

    async def update_server(self, name: str, patch: McpServerPatch, actor: str) -> McpServerOut:
        given = patch.model_dump(mode="json", exclude_unset=True)
        if given.get("tools", []) is None:
            raise invalid_params("tools may not be null", param="tools")
        change = Change(settings={k: v if v is not None else [] for k, v in given.items()})
        audit = self._audit(actor, "mcp_servers.update", name, given)
        row = await self.store.run(self.store.change_server, name, change, self.wall(), audit)
        if row is None:
            raise not_found("MCP server", name)
        await self._changed(f"mcp server {name}")
        return server_out(row)

    async def delete_server(self, name: str, actor: str) -> None:
        audit = self._audit(actor, "mcp_servers.delete", name, {})
        if not await self.store.run(self.store.delete_server, name, audit):
            raise not_found("MCP server", name)
        await self._changed(f"mcp server {name}")

    async def audit(self, limit: int, target: str | None) -> list[AuditOut]:
        rows = await self.store.run(self.store.audit, limit, target)
        return [AuditOut(id=r.id, at=_when(r.at), actor=r.actor, action=r.action,
                         target=r.target, detail=r.detail) for r in rows]
