"""An upstream's listings: tools (kept fresh for routing), resources and prompts (on demand).

Every listing follows cursors up to ``max_pages``. The tool list is cached: the
router and ``tools/list`` read it on every call, so it is refetched only when the
upstream says it changed or its ``ttlMs`` runs out (on the gateway's clock).
Resources and prompts are listed on demand, not cached: nothing in the gateway
routes by them, so a stale copy would buy nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import mcp_types as types
from mcp import Client, MCPError

from multiplexer.core.clock import Clock
from multiplexer.core.errors import RpcError

from .mcp_request import Requester

log = logging.getLogger(__name__)

Page = TypeVar("Page", bound=types.PaginatedResult)


def ttl_hint(page: types.PaginatedResult) -> int | None:
    """The page's ``ttlMs`` where the upstream sent one. The SDK reads a missing one (every
    handshake-era reply) as 0, "stale at once", which is no hint of the upstream's."""
    if isinstance(page, types.CacheableResult) and "ttl_ms" in page.model_fields_set:
        return page.ttl_ms
    return None


async def pages(name: str, method: str, max_pages: int, fetch: Callable[[str | None], Awaitable[Page]]
                ) -> tuple[list[Page], int | None]:
    """Every page of a listing, up to the cap, with the smallest ``ttlMs`` seen.

    Cursors are opaque: a repeated one means a broken upstream, not more data.
    """
    got: list[Page] = []
    ttl_ms: int | None = None
    cursor: str | None = None
    seen: set[str] = set()
    for _ in range(max_pages):
        try:
            page = await fetch(cursor)
        except (MCPError, RpcError) as e:
            if e.code == types.METHOD_NOT_FOUND and cursor is None:
                return [], None  # an upstream without this kind of item is not a broken one
            raise
        got.append(page)
        if (hint := ttl_hint(page)) is not None:
            ttl_ms = hint if ttl_ms is None else min(ttl_ms, hint)
        cursor = page.next_cursor
        if cursor is None:
            return got, ttl_ms
        if cursor in seen:
            log.warning("mcp upstream %s: %s cursor cycle; stopping", name, method)
            return got, ttl_ms
        seen.add(cursor)
    log.warning("mcp upstream %s: %s stopped at the page cap (%d pages)", name, method, max_pages)
    return got, ttl_ms


class ToolList:
    """The upstream's tools by name, and when the upstream said to fetch them again."""

    def __init__(self, name: str, max_pages: int, clock: Clock,
                 on_change: Callable[[dict[str, types.Tool]], None]) -> None:
        self.name = name
        self.max_pages = max_pages
        self.clock = clock
        self.tools: dict[str, types.Tool] = {}
        self.expire_at: float | None = None
        self._on_change = on_change
        self._lock = anyio.Lock()
        self._seq = 0

    async def refresh(self, client: Client) -> None:
        """Fetch every page; concurrent refreshes share one upstream listing."""
        seq = self._seq
        async with self._lock:
            if self._seq != seq:
                return
            listed, ttl_ms = await pages(self.name, "tools/list", self.max_pages,
                                         lambda cursor: client.list_tools(cursor=cursor))
            self._seq += 1
        self.expire_at = self.clock.now() + ttl_ms / 1000 if ttl_ms else None
        tools: dict[str, types.Tool] = {}
        for page in listed:
            for tool in page.tools:
                tools.setdefault(tool.name, tool)
        before = {n: t.model_dump(exclude_none=True) for n, t in self.tools.items()}
        self.tools = tools
        if before != {n: t.model_dump(exclude_none=True) for n, t in tools.items()}:
            self._on_change(tools)

    def expired(self) -> bool:
        return self.expire_at is not None and self.clock.now() >= self.expire_at

    def ttl_left_ms(self) -> int | None:
        """What is left of the upstream's cache hint (None: it gave none)."""
        if self.expire_at is None:
            return None
        return max(int((self.expire_at - self.clock.now()) * 1000), 0)


class Catalog:
    """Resources, templates and prompts, listed on demand where the upstream offers them."""

    def __init__(self, name: str, max_pages: int, requests: Requester,
                 offers: Callable[[Literal["resources", "prompts"]], bool]) -> None:
        self.name = name
        self.max_pages = max_pages
        self.requests = requests
        self.offers = offers
        self.ttl_ms: dict[str, int | None] = {}  # method -> the upstream's hint on its last listing

    async def _listing(self, request: Callable[..., types.PaginatedRequest[Any]],
                       result: type[Page]) -> list[Page]:
        """Every page of a listing; ``request`` is its request class (one whose method has a default)."""
        async def page(cursor: str | None) -> Page:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
            return await self.requests.request(request(params=params), result)

        method = request().method
        listed, self.ttl_ms[method] = await pages(self.name, method, self.max_pages, page)
        return listed

    async def list_resources(self) -> list[types.Resource]:
        if not self.offers("resources"):
            return []
        listed = await self._listing(types.ListResourcesRequest, types.ListResourcesResult)
        return [r for page in listed for r in page.resources]

    async def list_resource_templates(self) -> list[types.ResourceTemplate]:
        if not self.offers("resources"):
            return []
        listed = await self._listing(types.ListResourceTemplatesRequest, types.ListResourceTemplatesResult)
        return [t for page in listed for t in page.resource_templates]

    async def list_prompts(self) -> list[types.Prompt]:
        if not self.offers("prompts"):
            return []
        listed = await self._listing(types.ListPromptsRequest, types.ListPromptsResult)
        return [p for page in listed for p in page.prompts]
