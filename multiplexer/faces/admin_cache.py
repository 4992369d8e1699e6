"""``/admin/cache``: the caches' operator endpoints, behind the admin key.

- ``GET /admin/cache``: per route, the semantic cache's entries, lookups, hits, hit rate and
  wrong hits;
- ``DELETE /admin/cache?route=NAME&key=NAME``: answers removed by route, by key (its own scope),
  both, or all (neither; the exact TTL cache is emptied too); ``{"deleted": n}``, every replica;
- ``GET /admin/cache/hits?limit=100``: the newest hits kept for audit (the question asked, the one
  it matched, their similarity, both request ids);
- ``POST /admin/cache/hits/{id}/wrong``: a wrong hit reported: its entry removed everywhere and
  its scope's threshold raised by ``wrong_step`` (0.02 by default)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from multiplexer.access.admin import AdminKey
from multiplexer.gateway.gateway import Gateway


def cache_stats(gateway: Gateway) -> dict[str, dict[str, Any]]:
    """Per route: entries, lookups, hits, hit_rate, exact hits, wrong hits."""
    cache = gateway.semantic
    if cache is None:
        return {}
    sizes = cache.sizes()
    out: dict[str, dict[str, Any]] = {}
    for route in sorted(set(sizes) | set(cache.counts)):
        c = cache.counts.get(route)
        lookups, hits = (c.lookups, c.hits) if c is not None else (0, 0)
        out[route] = {"entries": sizes.get(route, 0), "lookups": lookups, "hits": hits,
                      "hit_rate": round(hits / lookups, 4) if lookups else 0.0,
                      "exact_hits": c.exact if c is not None else 0,
                      "wrong_hits": c.wrong if c is not None else 0}
    return out


def mount_cache(gateway: Gateway, admin: AdminKey, route: Callable[..., BaseRoute],
                error: Callable[..., JSONResponse]) -> list[BaseRoute]:
    async def stats(request: Request) -> Response:
        return JSONResponse({"semantic": gateway.semantic is not None, "routes": cache_stats(gateway)})

    async def delete(request: Request) -> Response:
        route_name = request.query_params.get("route") or None
        key = request.query_params.get("key") or None
        if route_name is not None and route_name not in gateway.config.routes and \
                route_name not in gateway.config.groups:
            return error(404, f"no route or model group named {route_name!r}")
        deleted = 0
        if gateway.semantic is not None:
            deleted = gateway.semantic.clear(route_name, key)
        if route_name is None and key is None:
            deleted += len(gateway.cache)
            gateway.cache.clear()
        return JSONResponse({"deleted": deleted})

    async def hits(request: Request) -> Response:
        raw = request.query_params.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
            return error(400, "limit: a whole number from 1 to 10000")
        found = [] if gateway.semantic is None else gateway.semantic.hits(int(raw))
        return JSONResponse({"hits": found})

    async def wrong(request: Request) -> Response:
        hit_id = request.path_params["hit_id"]
        found = None if gateway.semantic is None else gateway.semantic.wrong(hit_id)
        if found is None:
            return error(404, f"no hit {hit_id!r} is kept (GET /admin/cache/hits lists them)")
        return JSONResponse(found)

    return [route(admin, "/admin/cache", stats, ["GET"]),
            route(admin, "/admin/cache", delete, ["DELETE"]),
            route(admin, "/admin/cache/hits", hits, ["GET"]),
            route(admin, "/admin/cache/hits/{hit_id}/wrong", wrong, ["POST"])]
