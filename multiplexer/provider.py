"""The contract between the gateway and an upstream kind.

A provider turns a batch of routed items into one outcome per item, in order;
one item's failure never fails its neighbours. Everything else (queueing,
limits, dedup, deadlines) is the lane's job, so a provider stays small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from .batching import Formation
from .call import Item, Outcome
from .clock import Clock
from .config import ProviderConfig, RouteConfig
from .errors import Code, RpcError
from .limiter import RateLimiter
from .metrics import Metrics


class NoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(slots=True)
class ToolSpec:
    """A callable the provider exposes (an MCP tool, a model, ...), before namespacing."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    annotations: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ProviderContext:
    name: str
    config: ProviderConfig
    settings: Any
    clock: Clock
    limiter: RateLimiter
    metrics: Metrics
    store_path: Path
    notify: Callable[[str, dict[str, Any]], None] = lambda event, data: None


class Provider:
    """Base class with the defaults most kinds want; override what differs."""

    Settings: ClassVar[type[BaseModel]] = NoSettings

    def __init__(self, ctx: ProviderContext) -> None:
        self.ctx = ctx
        self.name = ctx.name

    async def start(self) -> None:
        """Open connections or children; called once before the first call."""

    async def aclose(self) -> None:
        """Release everything ``start`` opened, on every shutdown path."""

    def prepare(self, route: RouteConfig, item: Item) -> None:
        """Validate params and set ``item.group`` / ``item.tokens``; raise RpcError -32602."""
        item.group = (item.operation,)

    def dedup_safe(self, item: Item) -> bool:
        """Whether identical concurrent calls may share one execution when the route is silent."""
        return False

    def formation(self, policy: Any) -> Formation | None:
        """A custom batch formation (local models use token budgets); None for the default."""
        return None

    async def list_tools(self) -> list[ToolSpec]:
        """Tools for wildcard routes (``tools_*``) and the MCP face."""
        return []

    # MCP resources and prompts, in wire form (camelCase dicts): only MCP upstreams have them, but
    # the MCP face asks every provider the same way. Reads and gets bypass lanes: they are not routes.
    async def list_resources(self) -> list[dict[str, Any]]:
        return []

    async def list_resource_templates(self) -> list[dict[str, Any]]:
        return []

    async def read_resource(self, uri: str) -> dict[str, Any]:
        """A ``ReadResourceResult``; -32602 is MCP's "no such resource" (the face then asks elsewhere)."""
        raise RpcError(Code.INVALID_PARAMS, f"Unknown resource: {uri}", {"uri": uri, "provider": self.name})

    async def list_prompts(self) -> list[dict[str, Any]]:
        return []

    async def get_prompt(self, name: str, arguments: dict[str, str] | None) -> dict[str, Any]:
        """A ``GetPromptResult``; ``name`` is the provider's own, without the route's prefix."""
        raise RpcError(Code.INVALID_PARAMS, f"Unknown prompt: {name}",
                       {"prompt": name, "provider": self.name})

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        raise NotImplementedError
