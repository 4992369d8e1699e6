"""``GET /admin/spend``: spend and savings summed by key, team, route, model and/or day.

``?group_by=key,route&since=2026-12-01&until=2026-12-03`` (ISO dates, both included, in
``budgets.timezone``); the body is ``{"rows": [{<groups>, calls, cost_usd, saved_usd,
unknown_cost_calls, input_tokens, cache_read_tokens, cache_read_share, cache_writes_usd,
cache_moves, cache_moves_usd, saved_by}], "total": {...}}``, each row by key naming it
(``key_name`` beside ``key``: ``access/names.py``); the cache-read share is the part of the input
a provider read from its prompt cache, ``cache_writes_usd`` what its cache writes cost beyond
plain input, ``cache_moves`` the calls affinity sent away from the deployment holding their
prefix and ``cache_moves_usd`` what those moves cost at most. Behind the admin key like every
``/admin/``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import date

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiplexer.access.names import KeyNames
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.gateway.gateway import Gateway
from multiplexer.money.spend_store import GROUPS


def key_names(gateway: Gateway) -> KeyNames:
    """The gateway's one ``KeyNames`` (its cache shared by the report and the dashboard)."""
    names: KeyNames | None = gateway.faces.get("key_names")
    if names is None:
        names = gateway.faces["key_names"] = KeyNames(gateway.keys)
    return names


def _day(request: Request, name: str) -> date | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise invalid_params(f"{name} must be an ISO date (2026-12-01), not {raw!r}") from None


def spend_endpoint(gateway: Gateway) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint; ``faces/admin.py`` mounts it behind the admin key."""

    async def spend(request: Request) -> Response:
        money = gateway.money
        if money is None:
            raise RpcError(Code.NOT_FOUND, "Not found", {"detail": "spend is off (spend.enabled: false)"})
        raw = request.query_params.get("group_by", "key")
        groups = [g.strip() for g in raw.split(",") if g.strip()]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown or len(set(groups)) != len(groups):
            raise invalid_params(f"group_by takes distinct names among {', '.join(GROUPS)}; got {raw!r}")
        since, until = _day(request, "since"), _day(request, "until")
        body = await money.report(groups, since, until)
        if "key" in groups:
            body["rows"] = await key_names(gateway).named(body["rows"])
        return JSONResponse(body)

    return spend
