"""``cache.semantic:``: which calls the semantic cache answers, and how close is close enough.

Off by default: a route, model group, key or team is cached only when it is named here. A key's
settings win over its team's, a team's over the route's."""

from __future__ import annotations

from collections.abc import Container
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_THRESHOLD = 0.88
WRONG_STEP = 0.02


class SemanticSettings(BaseModel):
    """One route's, group's, key's or team's semantic cache."""

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(
        default=DEFAULT_THRESHOLD, gt=0, le=1,
        description="least cosine similarity of the last user turns (the local MiniLM: 0.88 answers "
                    "most paraphrases; the guard refuses the near-misses above it)")
    ttl_s: float = Field(default=3600.0, gt=0, description="how long an answer is served")
    embed: str = Field(default="embed_local",
                       description="the embeddings route the prompt is embedded with")
    max_messages: int = Field(
        default=4, ge=1, description="longer conversations are not cached (their answer depends on "
                                     "more than the last turn)")
    scope: Literal["key", "team", "global"] = Field(
        default="key", description="who shares answers: the calling key only, its team, or every "
                                   "caller of the route")
    max_entries: int = Field(default=10_000, ge=1,
                             description="answers kept per scope; the least recently used go first")
    guard: bool = Field(
        default=True, description="refuse a neighbour whose numbers, units, versions, negations, "
                                  "entity roles or content words differ (off: similarity alone)")
    wrong_step: float = Field(
        default=WRONG_STEP, ge=0, le=1,
        description="how much a reported wrong hit raises its scope's threshold")


class SemanticSection(BaseModel):
    """``cache.semantic``: routes (or model groups), keys and teams that are cached, by name."""

    model_config = ConfigDict(extra="forbid")

    routes: dict[str, SemanticSettings] = Field(
        default_factory=dict, description="route or model-group name -> its semantic cache")
    keys: dict[str, SemanticSettings] = Field(
        default_factory=dict, description="key name -> its semantic cache, on every route it calls")
    teams: dict[str, SemanticSettings] = Field(
        default_factory=dict, description="team name -> its semantic cache, for every key of the team")
    audit_size: int = Field(default=1000, ge=0,
                            description="recent hits kept for GET /admin/cache/hits")
    sync_ms: float = Field(
        default=250.0, gt=0, le=1000,
        description="how often a replica reads the answers other replicas stored (Redis with "
                    "state.url, else the store's SQLite file)")

    @property
    def enabled(self) -> bool:
        return bool(self.routes or self.keys or self.teams)

    def problems(self, routes: Container[str], groups: Container[str]) -> list[str]:
        """One line per name that does not exist: a cached route or group, an embeddings route."""
        out = [f"cache.semantic.routes.{name}: no route or model group named {name!r}"
               for name in self.routes if name not in routes and name not in groups]
        for where, found in (("routes", self.routes), ("keys", self.keys), ("teams", self.teams)):
            out += [f"cache.semantic.{where}.{name}.embed: {s.embed!r} is no route (the local pool's "
                    "is embed_local, with the local extra)" for name, s in found.items()
                    if s.embed not in routes]
        return out
