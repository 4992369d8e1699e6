"""Configuration: YAML validated by pydantic, with ``${VAR}`` / ``${VAR:-default}`` secrets.

Provider-specific keys are validated by the provider kind's own settings model, and a
route's own keys by its provider kind's route settings, so a mistake is reported with its
full key path (``providers.calc.url: ...``), a typo with the key it resembles. Paths in a
file are relative to the file's folder (``core/paths.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator

from multiplexer.access.entries import KeyEntry, TeamEntry, entry
from multiplexer.access.settings import FilesSettings, KeyStoreSettings, OAuthSettings, VirtualServer
from multiplexer.cache.settings import SemanticSection
from multiplexer.core.paths import ConfigPath, context_for
from multiplexer.core.policy import (
    GroupConfig,
    ProviderConfig,
    Quota,
    RouteConfig,
    Strict,
)
from multiplexer.gateway import chains
from multiplexer.gateway.config_errors import hint, problems
from multiplexer.gateway.home import default_store_path
from multiplexer.gateway.kind_keys import kind_problems
from multiplexer.money.settings import BudgetsConfig, SpendConfig
from multiplexer.records.settings import RequestLogConfig
from multiplexer.records.tool_audit_settings import AuditConfig

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """Invalid configuration; the message names every bad key path."""


class McpSamplingConfig(Strict):
    """An upstream's ``sampling/createMessage`` answered by one of this gateway's chat routes."""

    route: str = Field(description="the chat route (or model group) that answers, where the request's "
                       "model preferences name none the calling key may use")
    when: Literal["always", "client_lacks"] = Field(
        default="client_lacks", description="`always`: every sampling request; `client_lacks`: only "
        "for a client that did not declare the sampling capability (the others are asked)")


class McpServerConfig(Strict):
    path: str = "/mcp"
    max_sessions: int = Field(default=10_000, ge=1, description="open handshake-era HTTP sessions, all keys")
    max_sessions_per_key: int | None = Field(
        default=1000, ge=1, description="open HTTP sessions per API key (or for all keyless callers)")
    session_idle_s: float = Field(default=1800.0, gt=0, description="an idle session is closed after this")
    list_ttl_ms: int = Field(
        default=60_000, ge=0, description="ttlMs on tool, resource and prompt lists for 2026-07-28 clients "
        "where no upstream asked for less (the gateway also announces list changes)")
    ask_timeout_s: float = Field(
        default=300.0, gt=0, description="the longest a tools/call waits, in all, for its client's "
        "answers to an upstream's questions (elicitation, sampling, roots); the call's deadline "
        "pauses while it waits")
    sampling: McpSamplingConfig | None = Field(
        default=None, description="answer upstreams' sampling requests with a chat route of this "
        "gateway, under the calling key's access, quotas and budget; unset: the client is asked")
    allowed_origins: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1", "http://localhost", "https://127.0.0.1",
                                 "https://localhost"]
    )


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_batch_items: int = Field(default=1000, ge=1)
    max_json_depth: int = Field(default=64, ge=2)
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024,
                                description="an upload to /v1/files (batch input files)")
    files: FilesSettings = Field(default_factory=FilesSettings, description="/v1/files: storage "
                                 "quotas per key and team, default expiry, the expiry sweep")
    default_timeout_ms: float = Field(default=60_000, gt=0)
    grace_period_s: float = Field(default=10.0, ge=0)
    gc_young_threshold: int | None = Field(
        default=10_000, ge=100,
        description="`multiplexer serve`: allocations between the garbage collector's youngest passes"
                    " (Python's own is 700); null: Python's",
    )
    freeze_heap: bool = Field(
        default=True,
        description="exempt what is alive once the gateway serves (and once each local model has"
                    " loaded) from later garbage collections: a full one then walks only newer objects",
    )
    api_keys: dict[str, SecretStr | KeyEntry] = Field(
        default_factory=dict, description="name -> the bearer key (or sha256:<hex> of it), or "
        "{key, team, models, routes, tools, rpm, tpm, concurrency, budget_usd, expires_at, metadata}")
    teams: dict[str, TeamEntry] = Field(default_factory=dict, description="defaults its keys narrow")
    admin_key: SecretStr | None = Field(
        default=None, description="the master key of `/admin/` and the dashboard (or sha256:<hex> of"
        " it; MULTIPLEXER_MASTER_KEY wins); unset: nothing admin is served")
    ui: bool = Field(default=True, description="serve the dashboard: `/ui` (the page, its files),"
                     " `/ui/api/state` and `/ui/api/stream` (admin key or a caller's own view), `/`"
                     " redirecting to `/ui`; docs/dashboard.md")
    key_store: KeyStoreSettings = Field(default_factory=KeyStoreSettings,
                                        description="keys and teams as data (/admin/keys, docs/keys.md)")
    oauth: OAuthSettings | None = Field(default=None, description="OAuth 2.1 bearer tokens on /mcp "
                                        "(the gateway as a resource server); unset: API keys only")
    quotas: dict[str, Quota] = Field(default_factory=dict)
    allow_public_without_keys: bool = False
    metrics_public: bool = Field(
        default=False, description="/metrics without a key; unset: once callers need a key, or on a "
        "non-loopback address, a scrape needs a caller's key or the admin key")
    mcp: McpServerConfig = Field(default_factory=McpServerConfig)
    # -- operations: access log and keep-alive --
    access_log: bool = Field(default=True, description="one INFO line per HTTP request (logger "
                             "multiplexer.access): method, path, route, key name, status, ms, request id")
    log_format: Literal["plain", "json"] = Field(default="plain", description="access lines as "
                                                 "text or JSON objects (`serve`: every log line)")
    keepalive_s: float = Field(
        default=75.0, gt=0, description="an idle client connection is closed after this, and "
        "within a second more (uvicorn's timeout_keep_alive). Above the 60 s idle timeout of common "
        "clients and load balancers, so they close first: a server closing as a client reuses the "
        "connection loses that request")
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default=1, description="`multiplexer serve`: gateway processes sharing the one port (auto: one "
        "per core this process may run on). Above 1, without state.url, each enforces its share of "
        "every limit and quota (docs/workers.md); 1: one process, no supervisor")

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"expected a whole number of processes >= 1, or auto; got {value!r}")

    def worker_count(self) -> int:
        """``workers`` as a number: ``auto`` is the cores this process may run on."""
        if self.workers != "auto":
            return self.workers
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # no affinity on this platform
            return max(1, os.cpu_count() or 1)

    @model_validator(mode="after")
    def _known_teams(self) -> ServerConfig:
        for name, value in self.api_keys.items():
            team = entry(value).team
            if team is not None and team not in self.teams:
                raise ValueError(f"api_keys.{name}.team: no team {team!r} in server.teams; "
                                 + hint(team, self.teams))
        return self


class StoreConfig(Strict):
    path: ConfigPath = Field(
        default_factory=default_store_path,
        description="SQLite file of keys, spend, batch jobs and /v1 files (relative: to the config's"
                    " folder; unset: multiplexer.db in the user's data directory, ~/.local/share/multiplexer"
                    " on Linux; multiplexer paths prints it)")
    url: str | None = Field(
        default=None,
        description="postgresql://...: batch jobs shared by every replica (unset: SQLite at path)")
    schema_: str = Field(
        default="multiplexer", alias="schema",
        description="with url: the PostgreSQL schema of the job tables, created if missing (not public:"
                    " the tables stay apart from what else the database holds)")
    lease_s: float = Field(
        default=30.0, gt=0, description="with url: a dead replica's batches are taken over after this")
    open_job_idle_s: float | None = Field(
        default=3600.0, gt=0,
        description="a job left open (more: true) this long without calls is closed and run; null: never",
    )
    retention_s: float | None = Field(
        default=7 * 86400.0, gt=0,
        description="ended jobs, their items and results are deleted this long after they ended; "
                    "null: kept until jobs.delete",
    )

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"expected postgresql://..., got {url!r}")
        return url

    @field_validator("schema_")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
            raise ValueError(f"{name!r} is not a plain PostgreSQL name (letters, digits and _, not "
                             "starting with a digit, at most 63)")
        return name


class StateConfig(Strict):
    """Where replicas share limits, quotas and the cache; unset: in-process (one gateway)."""

    url: str | None = Field(default=None, description="redis://host:port/db (rediss:// for TLS)")
    prefix: str = Field(default="mx", min_length=1, description="key prefix: one per deployment")
    lease_s: float = Field(default=30.0, gt=0, description="a dead replica's slots free after this")
    timeout_ms: float = Field(default=500.0, gt=0, description="a slower answer counts as unreachable")
    on_failure: Literal["closed", "open"] = Field(
        default="closed", description="per-key quotas while the state is unreachable: refuse, or local")

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        if url is not None and url.partition("://")[0] not in ("redis", "rediss", "unix"):
            raise ValueError(f"expected redis://, rediss:// or unix://, got {url!r}")
        return url


class CacheConfig(Strict):
    max_entries: int = Field(default=10_000, ge=0)
    semantic: SemanticSection = Field(
        default_factory=SemanticSection,
        description="the semantic cache: paraphrased questions answered from stored answers "
                    "(docs/semantic-cache.md); off unless a route, group, key or team is named")


class TelemetryConfig(Strict):
    """OpenTelemetry traces (the ``otel`` extra); off unless an endpoint is named here or in
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``."""

    otlp_endpoint: str | None = Field(
        default=None, description="OTLP over HTTP, e.g. http://127.0.0.1:4318 (/v1/traces is added)")
    service_name: str | None = Field(default=None, description="default: $OTEL_SERVICE_NAME, "
                                                               "else multiplexer")
    enabled: bool | None = Field(default=None, description="false: off even when OTEL_* name "
                                                           "an endpoint")


class Config(Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    providers: dict[str, ProviderConfig] = Field(default_factory=dict)
    routes: dict[str, RouteConfig] = Field(default_factory=dict)
    store: StoreConfig = Field(default_factory=StoreConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    groups: dict[str, GroupConfig] = Field(
        default_factory=dict, description="model groups: one public name served by several routes "
        "(docs/fallbacks.md)")
    mcp_servers: dict[str, VirtualServer] = Field(
        default_factory=dict, description="virtual MCP servers: /mcp/NAME exposes just their tools")
    spend: SpendConfig = Field(default_factory=SpendConfig, description="what calls cost, saved and spent")
    budgets: BudgetsConfig = Field(default_factory=BudgetsConfig, description="how budget_usd caps count")
    log: RequestLogConfig = Field(default_factory=RequestLogConfig, description="the request log: "
                                  "every call recorded, searchable at GET /admin/requests")
    audit: AuditConfig = Field(default_factory=AuditConfig, description="the MCP tool-call audit: a "
                               "record per tools/call, at GET /admin/audit/tools")

    # The config file's folder: relative paths in the file start there (None: the working folder).
    _base_dir: Path | None = PrivateAttr(default=None)
    # The file it was read from (``load_config``; None: built in code): what a reload reads again.
    _source: Path | None = PrivateAttr(default=None)

    @property
    def base_dir(self) -> Path | None:
        return self._base_dir

    @property
    def source(self) -> Path | None:
        return self._source

    def paths_context(self) -> dict[str, Any] | None:
        """The validation context for the kinds' settings: their relative paths are the file's."""
        return context_for(self._base_dir)

    @field_validator("mcp_servers")
    @classmethod
    def _path_names(cls, servers: dict[str, VirtualServer]) -> dict[str, VirtualServer]:
        for name in servers:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"mcp_servers.{name}: a name is one path segment (letters, digits, _.-)")
        return servers

    @model_validator(mode="after")
    def _routes_name_providers(self) -> Config:
        for name, route in self.routes.items():
            if route.provider not in self.providers:
                raise ValueError(f"routes.{name}.provider: unknown provider {route.provider!r} "
                                 f"({hint(route.provider, self.providers)})")
            if "*" in name and not name.endswith("*"):
                raise ValueError(f"routes.{name}: a wildcard may only end a route name")
        kinds = {name: p.kind for name, p in self.providers.items()}
        lines = chains.problems(self.routes, self.groups, kinds)  # fallbacks and groups
        sampling = self.server.mcp.sampling
        if sampling is not None and sampling.route not in self.routes and sampling.route not in self.groups:
            lines.append(f"server.mcp.sampling.route: {sampling.route!r} is no route or model group")
        lines += self.cache.semantic.problems(self.routes, self.groups)
        if lines:
            raise ValueError("\n  ".join(lines))
        return self


def expand_env(node: Any, path: str = "", env: Mapping[str, str] | None = None) -> Any:
    """Replace ``${VAR}`` and ``${VAR:-default}`` in every string of the tree."""
    values = os.environ if env is None else env
    if isinstance(node, dict):
        return {k: expand_env(v, f"{path}.{k}" if path else str(k), values) for k, v in node.items()}
    if isinstance(node, list):
        return [expand_env(v, f"{path}[{i}]", values) for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in values and values[name] != "":
            return values[name]
        if default is not None:
            return default
        raise ConfigError(f"{path}: environment variable {name} is not set and has no default")

    return _ENV.sub(sub, node)


def parse_config(data: Any, env: dict[str, str] | None = None,
                 base_dir: str | Path | None = None) -> Config:
    """Validate a config mapping; every problem is one line of the ``ConfigError``.

    ``base_dir``: where relative paths in it start (``load_config``: the file's folder);
    None: the working folder.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("invalid config: the top level must be a mapping")
    data = expand_env(data, env=env)
    context = context_for(base_dir)
    lines: list[str] = []
    try:
        config = Config.model_validate(data, context=context)
    except ValidationError as e:
        lines += problems(e, Config, data)
    lines += kind_problems(data, context)
    if lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(dict.fromkeys(lines)))
    config._base_dir = None if base_dir is None else Path(base_dir).resolve()
    return config


def load_config(path: str | Path, env: dict[str, str] | None = None) -> Config:
    """A config file; its relative paths are relative to its folder."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    config = parse_config(data, env, base_dir=p.resolve().parent)
    config._source = p.resolve()
    return config
