"""The config of keys as data, virtual MCP servers, OAuth and the files keys keep: what
``gateway/config.py`` mounts."""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator

from multiplexer.core.policy import Strict


class KeyStoreSettings(Strict):
    """Keys and teams kept in the job store's database and managed through ``/admin/keys``."""

    enabled: bool | None = Field(
        default=None, description="consult stored keys (unset: on when an admin key is set, the only"
        " way to create them); once the store has issued a key, every call needs one")
    ttl_s: float = Field(default=30.0, gt=0, description="each replica reloads the stored keys this "
                         "often even without an invalidation through state.url")
    stale_s: float = Field(default=300.0, gt=0, description="a replica that cannot reach the store "
                           "keeps serving the keys it last loaded this long, then refuses stored keys")
    grace_s: float = Field(default=86400.0, ge=0, description="default time a rotated key stays "
                           "valid (POST /admin/keys/{id}/rotate may say otherwise)")


class VirtualServer(Strict):
    """An MCP server of its own at ``/mcp/NAME``: just these tools, for just these callers."""

    tools: list[str] = Field(description="glob patterns of the gateway's tool names it exposes")
    keys: list[str] = Field(default_factory=list, description="key names (or stored key ids) that may "
                            "connect; with teams unset too: every key")
    teams: list[str] = Field(default_factory=list, description="teams whose keys may connect")


class OAuthSettings(Strict):
    """The gateway as an OAuth 2.1 resource server on ``/mcp`` (the MCP authorization spec)."""

    issuer: str = Field(description="the authorization server (its `iss`), listed in the metadata")
    audience: str = Field(description="what a token's `aud` must hold: this gateway's /mcp URL")
    jwks_url: str | None = Field(default=None, description="the issuer's JSON Web Key Set")
    introspection_url: str | None = Field(
        default=None, description="RFC 7662 endpoint, for opaque tokens (used when no jwks_url)")
    team_claim: str = Field(default="team", description="the claim naming the caller's team")
    scopes: list[str] = Field(default_factory=list, description="scopes every token must carry "
                              "(listed in the metadata as scopes_supported)")
    resource: str | None = Field(default=None, description="the resource URL in the metadata "
                                 "(unset: the audience)")
    jwks_ttl_s: float = Field(default=600.0, gt=0, description="how long the key set is cached; "
                              "an unknown kid refetches it at once (at most every 10 s)")
    introspection_client_id: str | None = Field(
        default=None, description="the gateway's client id at the introspection endpoint (HTTP "
        "Basic, RFC 7662 section 2.1); required with introspection_url")
    introspection_client_secret: SecretStr | None = Field(
        default=None, description="its client secret (never logged); required with introspection_url")
    introspection_cache_s: float = Field(
        default=60.0, ge=0, description="how long an active introspected token is trusted before the "
        "endpoint is asked again (at most until its exp): a revoked token stops working within it")

    @model_validator(mode="after")
    def _introspection_authenticates(self) -> OAuthSettings:
        if self.jwks_url is None and self.introspection_url is None:
            raise ValueError("set jwks_url (JWTs) or introspection_url (opaque tokens)")
        if self.jwks_url is None and (self.introspection_client_id is None
                                      or self.introspection_client_secret is None):
            raise ValueError("introspection_url needs introspection_client_id and "
                             "introspection_client_secret: RFC 7662 requires the caller to authenticate")
        return self


class FilesSettings(Strict):
    """``/v1/files``: how many bytes of files each key and team may keep, and how long files live.
    A file counts until it is deleted or expires; an upload in progress counts already."""

    max_bytes_per_key: int | None = Field(
        default=None, ge=0, description="bytes of files one key may keep (keyless callers: all of them"
        " together); a key's own files_max_bytes overrides it; null: no limit")
    max_bytes_per_team: int | None = Field(
        default=None, ge=0, description="bytes of files all the keys of one team may keep; a team's "
        "own files_max_bytes overrides it; null: no limit")
    batch_expires_s: int | None = Field(
        default=30 * 86400, ge=1, description="a purpose=batch upload sent without expires_after "
        "expires this long after it was made (OpenAI's default, 30 days); null: kept until deleted")
    sweep_s: float = Field(default=60.0, gt=0, description="how often expired files are deleted")
    sweep_step: int = Field(default=20, ge=1, description="files the sweep deletes before it lets "
                            "other work use the store")
