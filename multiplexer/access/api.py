"""The admin API's bodies, in and out, as pydantic models: validation and the OpenAPI schema."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from multiplexer.access.entries import Access
from multiplexer.access.settings import VirtualServer
from multiplexer.core.policy import BudgetUsd, Strict


def _in_range(at: datetime | None) -> datetime | None:
    """A moment the store can keep: its UTC time and timestamp both exist (years 1970 to 9998)."""
    if at is None:
        return at
    try:
        utc = at.astimezone(UTC) if at.tzinfo is not None else at.replace(tzinfo=UTC)
        stamp = utc.timestamp()
    except (OverflowError, ValueError, OSError):
        raise ValueError("the moment is out of range") from None
    if not 0 <= stamp < 253_370_764_800:  # 9999-01-01T00:00:00Z
        raise ValueError("the moment must be between 1970 and 9998")
    return at


Moment = Annotated[datetime | None, AfterValidator(_in_range)]
TEN_YEARS_S = 315_360_000.0


class KeyIn(Access):
    """``POST /admin/keys``."""

    name: str = Field(min_length=1, max_length=200, description="what the key is for (not unique)")
    team: str | None = Field(default=None, description="a team whose defaults the key narrows")
    expires_at: Moment = Field(default=None, description="refused from then on")


class TeamPatch(Strict):
    """``PATCH /admin/teams/{id}``: only the fields given change (null clears one)."""

    models: list[str] | None = None
    routes: list[str] | None = None
    tools: list[str] | None = None
    rpm: float | None = Field(default=None, gt=0)
    tpm: float | None = Field(default=None, gt=0)
    concurrency: int | None = Field(default=None, ge=1)
    budget_usd: BudgetUsd | None = None
    metadata: dict[str, Any] | None = None


class KeyPatch(TeamPatch):
    """``PATCH /admin/keys/{id}``: a team's fields, and the key's own name, team and expiry."""

    name: str | None = Field(default=None, min_length=1, max_length=200)
    team: str | None = None
    expires_at: Moment = None


class KeyOut(BaseModel):
    id: str
    name: str
    prefix: str = Field(description="the key's first characters, for telling keys apart")
    team: str | None = None
    models: list[str] | None = None
    routes: list[str] | None = None
    tools: list[str] | None = None
    rpm: float | None = None
    tpm: float | None = None
    concurrency: int | None = None
    budget_usd: BudgetUsd | None = None
    expires_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime
    updated_at: datetime
    revoked_at: datetime | None = None
    old_key_valid_until: datetime | None = None


class KeyCreated(KeyOut):
    key: str = Field(description="the key itself: shown this once, kept only as its hash")


class RotateIn(Strict):
    grace_s: float | None = Field(default=None, ge=0, le=TEN_YEARS_S,
                                  description="how long the old key stays valid (unset: "
                                  "server.key_store.grace_s; 0: not at all; at most ten years)")


class Rotated(BaseModel):
    id: str
    key: str = Field(description="the new key: shown this once")
    prefix: str
    old_key_valid_until: datetime | None


class TeamIn(Access):
    """``POST /admin/teams``: a team's defaults, which its keys narrow."""

    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:-]+$")


class TeamOut(Access):
    id: str
    name: str
    created_at: datetime
    updated_at: datetime


class McpServerIn(VirtualServer):
    """``POST /admin/mcp-servers``: ``/mcp/{name}`` serves just these tools to these keys."""

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")


class McpServerPatch(Strict):
    tools: list[str] | None = None
    keys: list[str] | None = None
    teams: list[str] | None = None


class McpServerOut(VirtualServer):
    id: str
    name: str
    created_at: datetime
    updated_at: datetime


class AuditOut(BaseModel):
    id: str
    at: datetime
    actor: str = Field(description="who: the admin key's holder, as the X-Admin-Actor header names them")
    action: str = Field(description="what: keys.create, keys.update, keys.rotate, keys.revoke, "
                        "teams.create, teams.update, mcp_servers.create, mcp_servers.update, "
                        "mcp_servers.delete")
    target: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict, description="the fields given (never a key)")


class Listing(BaseModel):
    object: str = "list"
    data: list[Any]
