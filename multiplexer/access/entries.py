"""What a key and a team may do, as config and store rows share it.

A key written as a plain string in ``server.api_keys`` is a ``KeyEntry`` with only ``key``; a
team's settings are the defaults its keys narrow, never widen."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field, SecretStr

from multiplexer.core.policy import BudgetUsd, Strict


class Access(Strict):
    models: list[str] | None = Field(default=None, description="glob patterns of models the key may"
                                     " use (unset: all, or the team's)")
    routes: list[str] | None = Field(default=None, description="glob patterns of routes (methods)")
    tools: list[str] | None = Field(default=None, description="glob patterns of MCP tools")
    rpm: float | None = Field(default=None, gt=0, description="calls per minute (a key: the smaller "
                              "of its own and its team's)")
    tpm: float | None = Field(default=None, gt=0, description="tokens per minute: a call's estimate "
                              "charged at admission, settled to its usage (a key: the smaller of "
                              "its own and its team's)")
    concurrency: int | None = Field(default=None, ge=1, description="calls at once")
    budget_usd: BudgetUsd | None = Field(default=None, description="spend caps in US dollars")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form, shown by the admin API")


class KeyEntry(Access):
    key: SecretStr = Field(description="the bearer key, or sha256:<hex> of it")
    team: str | None = Field(default=None, description="its team (in config: one of server.teams)")
    expires_at: datetime | None = Field(default=None, description="refused from then on")
    files_max_bytes: int | None = Field(default=None, ge=0, description="bytes of /v1 files it may "
                                        "keep (unset: server.files.max_bytes_per_key)")


class TeamEntry(Access):
    files_max_bytes: int | None = Field(default=None, ge=0, description="bytes of /v1 files its keys "
                                        "may keep together (unset: server.files.max_bytes_per_team)")


def entry(value: SecretStr | KeyEntry) -> KeyEntry:
    return value if isinstance(value, KeyEntry) else KeyEntry(key=value)
