"""``GET /readyz``: whether this gateway can serve now, part by part, for load balancers.

``/healthz`` is liveness (the process answers); this is readiness. Required, and so
answered 503 while down or starting: every configured provider (``up``; a provider with
the ``Readiness`` capability says ``starting`` or ``failing`` with its last error, any
other is ``up`` once started), the shared state when ``state.url`` is set (one round
trip), and the job store when some provider runs batch jobs (one query). Secrets stay
out: the state is named by its scheme, the store by its kind. The parts and their errors
are the admin key's (``faces/probe_access.py``); anyone else reads ``for_anyone``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from multiplexer.core.jobs import JobStore
from multiplexer.core.provider import Readiness
from multiplexer.core.state import SharedState, StateUnavailable
from multiplexer.gateway.gateway import Gateway

CHECK_TIMEOUT_S = 2.0  # a check slower than this counts as unreachable


def provider_status(gateway: Gateway, name: str) -> dict[str, Any]:
    provider = gateway.providers.get(name)
    if provider is None or name not in gateway.started:
        return {"status": "starting"}
    if not isinstance(provider, Readiness):
        return {"status": "up"}
    status, detail = provider.readiness()
    out: dict[str, Any] = {"status": status}
    if detail is not None:
        out["error" if status == "failing" else "detail"] = detail
    return out


async def state_status(state: SharedState, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": url.partition("://")[0], "reachable": False}
    try:
        with anyio.fail_after(CHECK_TIMEOUT_S):
            await state.ping()
    except (StateUnavailable, TimeoutError) as e:
        out["error"] = str(e) or "timed out"
    else:
        out["reachable"] = True
    return out


async def store_status(open_store: Callable[[], JobStore], postgres: bool) -> dict[str, Any]:
    """The store the jobs face uses (opened here if no job has opened it yet, as the first would)."""
    out: dict[str, Any] = {"mode": "postgresql" if postgres else "sqlite", "reachable": False}
    try:
        store = open_store()
        with anyio.fail_after(CHECK_TIMEOUT_S):  # the thread is left to finish on its own
            await anyio.to_thread.run_sync(store.ping, abandon_on_cancel=True)
    except TimeoutError:
        out["error"] = "timed out"
    except Exception as e:  # the driver's own errors: the store cannot answer
        out["error"] = f"{type(e).__name__}: {e}"
    else:
        out["reachable"] = True
    return out


async def readiness(gateway: Gateway) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 when everything required is ready, else 503."""
    providers = {name: provider_status(gateway, name) for name in gateway.config.providers}
    body: dict[str, Any] = {"providers": providers}
    ready = not gateway.closing and all(p["status"] == "up" for p in providers.values())
    if gateway.state is not None and gateway.config.state.url is not None:
        body["state"] = await state_status(gateway.state, gateway.config.state.url)
        ready = ready and body["state"]["reachable"]
    jobs = gateway.faces.get("jobs")
    if jobs is not None:
        body["store"] = await store_status(jobs.store, gateway.config.store.url is not None)
        ready = ready and body["store"]["reachable"]
    body = {"status": "shutting_down" if gateway.closing else "ready" if ready else "not_ready", **body}
    return (200 if ready else 503), body


def for_anyone(body: dict[str, Any]) -> dict[str, Any]:
    """What a caller without the admin key reads: the status, and each worker's under ``serve
    --workers N`` (status words only); no part's name, no error text (a store's or Redis's own
    words name hosts and users)."""
    out: dict[str, Any] = {"status": body["status"]}
    if "workers" in body:
        out["workers"] = body["workers"]
    return out
