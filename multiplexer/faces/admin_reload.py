"""``POST /admin/reload``: the config file read again and applied (``gateway/reload.py``).

Behind the admin key like every ``/admin/`` endpoint. 200 with what changed; a file that does not
validate or fails ``check-config``'s checks is a 400 whose ``detail.errors`` are its lines (the
running config stays); a new provider that did not start is a 409 (the running config stays).
Under ``serve --workers N`` the worker that answers reloads, then has every other worker reload
(over their sockets, ``faces/siblings.py``), and ``workers`` says how many did."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from multiplexer.access.admin import AdminKey
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.reload import ConfigReloader

STATUS = {"ok": 200, "invalid": 400, "failed": 409}


async def relayed(gateway: Gateway) -> dict[str, Any] | None:
    """Every other worker's reload, asked at once: ``{count, reloaded, results}`` (None: a lone
    gateway). A worker that does not answer in time is ``not_answering``."""
    siblings = gateway.faces.get("workers")
    if siblings is None:
        return None
    results: dict[str, str] = {str(siblings.slot.index): "ok"}
    for index, answer in sorted((await siblings.reload_all()).items()):
        results[str(index)] = json.loads(answer)["result"] if answer else "not_answering"
    return {"count": siblings.slot.count, "reloaded": sum(r == "ok" for r in results.values()),
            "results": results}


def mount_reload(gateway: Gateway, admin: AdminKey, route: Callable[..., Route],
                 error: Callable[..., JSONResponse]) -> list[BaseRoute]:
    from multiplexer.faces.admin_keys import _actor

    async def reload(request: Request) -> Response:
        reloader: ConfigReloader | None = gateway.faces.get("reloader")
        if reloader is None:
            return error(409, "this gateway reloads no config file")
        done = await reloader.reload(_actor(request))
        body = done.as_json()
        if done.result != "ok":
            message = "\n  ".join(done.errors) if done.result == "invalid" else "; ".join(done.errors)
            return error(STATUS[done.result], message, {"errors": done.errors, "result": done.result})
        workers = await relayed(gateway)
        if workers is not None:
            body["workers"] = workers
        return JSONResponse(body)

    return [route(admin, "/admin/reload", reload, ["POST"])]
