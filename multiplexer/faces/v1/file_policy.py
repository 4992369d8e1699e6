"""What an upload to ``/v1/files`` may be: its purpose, when it expires (OpenAI's ``expires_after``),
and the bytes of files its key and its key's team may keep (``server.files``, a key's or team's
own ``files_max_bytes``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from multiplexer.access.settings import FilesSettings
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.faces.v1.common import HttpError
from multiplexer.faces.v1.file_store import OverQuota

PURPOSES = ("batch", "batch_output", "fine-tune", "assistants", "user_data", "evals", "vision")
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400  # OpenAI's bounds on expires_after[seconds]
ANCHOR, SECONDS = "expires_after[anchor]", "expires_after[seconds]"
_DIGITS = re.compile(r"[0-9]{1,12}")


def purpose_of(fields: dict[str, str]) -> str:
    purpose = fields.get("purpose")
    if purpose not in PURPOSES:
        raise HttpError(400, invalid_params(f"'purpose' must be one of {list(PURPOSES)}"),
                        param="purpose")
    return purpose


def expires_s(fields: dict[str, str], purpose: str, settings: FilesSettings) -> int | None:
    """Seconds from the file's creation to its expiry: ``expires_after`` as the form gives it
    (anchor ``created_at``, seconds within OpenAI's bounds), else the default for its purpose
    (``server.files.batch_expires_s`` for ``batch``); None: it does not expire."""
    if "expires_after" in fields:
        raise HttpError(400, invalid_params(f"expires_after is sent as the fields {ANCHOR} and "
                                            f"{SECONDS}"), param="expires_after")
    anchor, seconds = fields.get(ANCHOR), fields.get(SECONDS)
    if anchor is None and seconds is None:
        return settings.batch_expires_s if purpose == "batch" else None
    if anchor != "created_at":
        raise HttpError(400, invalid_params(f"{ANCHOR} must be 'created_at'"), param=ANCHOR)
    if seconds is None or not _DIGITS.fullmatch(seconds) or not (
            MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S):
        raise HttpError(400, invalid_params(f"{SECONDS} must be a whole number from {MIN_EXPIRY_S} "
                                            f"to {MAX_EXPIRY_S}"), param=SECONDS)
    return int(seconds)


@dataclass(frozen=True, slots=True)
class Quotas:
    """The bytes of files an upload's key and team may keep, and which setting says so."""

    team: str | None
    key_max: int | None
    team_max: int | None
    key_setting: str
    team_setting: str


def quotas_for(keys: Any, identity: str | None, settings: FilesSettings) -> Quotas:
    """A key's own ``files_max_bytes`` over ``server.files.max_bytes_per_key``, its team's over
    ``max_bytes_per_team`` (``keys``: the gateway's key directory)."""
    key = keys.entry(identity) if identity is not None else None
    team_name = key.team if key is not None else None
    team = keys.team(team_name) if team_name is not None else None
    own_key = getattr(key, "files_max_bytes", None)
    own_team = getattr(team, "files_max_bytes", None)
    return Quotas(
        team_name,
        settings.max_bytes_per_key if own_key is None else own_key,
        settings.max_bytes_per_team if own_team is None else own_team,
        "server.files.max_bytes_per_key" if own_key is None else
        f"server.api_keys.{identity}.files_max_bytes",
        "server.files.max_bytes_per_team" if own_team is None else
        f"server.teams.{team_name}.files_max_bytes")


def refusal(e: OverQuota, identity: str | None, quotas: Quotas) -> HttpError:
    """413 naming the quota, what is kept already and the file's size (OpenAI's shape)."""
    by_key = e.over.column == "owner"
    who = (f"key {identity!r}" if identity is not None else "callers without a key") if by_key \
        else f"team {quotas.team!r}"
    setting = quotas.key_setting if by_key else quotas.team_setting
    message = (f"File storage quota exceeded: {who} may keep {e.over.limit} bytes of files "
               f"({setting}); {e.over.usage} bytes are kept and this file is {e.size} bytes")
    data = {"quota": e.over.limit, "usage": e.over.usage, "file_bytes": e.size,
            "scope": "key" if by_key else "team"}
    return HttpError(413, RpcError(Code.TOO_LARGE, message, data), param="file",
                     code="storage_quota_exceeded")
