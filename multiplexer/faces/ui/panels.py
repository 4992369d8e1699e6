"""The dashboard's panels: one function each, from the gateway's own numbers to plain JSON.

A panel reads what `/metrics`, `/healthz` and `/readyz` read (the metrics registry through one
``Samples`` per snapshot, the lanes, the limiters, the job store, the providers' ``Readiness`` and
``Describes`` capabilities), so every number on the page equals theirs. Counters stay cumulative
(as in `/metrics`): a reader takes rates from two snapshots.

A room that lands later adds its panel with ``panel("name")``; a panel whose source is absent
answers ``not_configured(...)`` so the page shows an empty state instead of nothing.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from multiplexer.access.names import KeyNames
from multiplexer.core.jobrows import JobRow, PartRow
from multiplexer.core.limiter import RateLimiter, TokenBucket
from multiplexer.core.provider import Describes, McpUpstream
from multiplexer.faces.ready import provider_status, state_status, store_status
from multiplexer.faces.spend import key_names
from multiplexer.faces.ui.samples import Samples, per_bucket, quantile
from multiplexer.gateway.gateway import Gateway

JOBS_SHOWN = 25  # open jobs listed (the totals count all of them)


@dataclass(slots=True)
class View:
    """Whose snapshot: the admin's (``identity`` None, everything) or one caller key's own."""

    gateway: Gateway
    samples: Samples
    admin: bool
    identity: str | None = None


Panel = Callable[[View], Awaitable[dict[str, Any]]]
PANELS: dict[str, tuple[Panel, bool]] = {}  # name -> (panel, shown to a caller key's own view)


def panel(name: str, *, callers: bool = False) -> Callable[[Panel], Panel]:
    def register(fn: Panel) -> Panel:
        PANELS[name] = (fn, callers)
        return fn
    return register


def not_configured(detail: str) -> dict[str, Any]:
    return {"configured": False, "detail": detail}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@panel("routes")
async def routes(view: View) -> dict[str, Any]:
    """Calls per route (by outcome, in flight, latency), lanes (queue, batches), providers
    (upstream requests: calls / requests is the multiplexing ratio)."""
    s, gw = view.samples, view.gateway
    names = sorted({lab["route"] for lab, _ in s.rows("multiplexer_calls_total")}
                   | {lab["route"] for lab, _ in s.rows("multiplexer_calls_in_flight")})
    out_routes = []
    for name in names:
        outcomes = s.by("multiplexer_calls_total", "outcome", route=name)
        hist = s.buckets("multiplexer_call_duration_seconds", route=name)
        out_routes.append({
            "route": name, "ok": int(outcomes.pop("ok", 0)),
            "errors": {code: int(n) for code, n in sorted(outcomes.items())},
            "in_flight": int(s.value("multiplexer_calls_in_flight", route=name)),
            "latency": {"count": int(s.value("multiplexer_call_duration_seconds_count", route=name)),
                        "sum_s": s.value("multiplexer_call_duration_seconds_sum", route=name),
                        "p50_ms": _ms(quantile(0.5, hist)), "p99_ms": _ms(quantile(0.99, hist))},
        })
    lanes = []
    for lane in gw.lanes.values():
        sizes = s.buckets("multiplexer_batch_size", provider=lane.name)
        lanes.append({
            "lane": lane.name, "provider": lane.provider,
            "queued": int(s.value("multiplexer_queue_depth", provider=lane.name)),
            "in_flight": lane.in_flight, "held_by": lane.holding() if len(lane.queue) else None,
            "batches": int(s.value("multiplexer_batch_size_count", provider=lane.name)),
            "items": int(s.value("multiplexer_batch_size_sum", provider=lane.name)),
            "batch_sizes": [[le, n] for le, n in per_bucket(sizes)],
            "rejections": {k: int(v) for k, v in s.by("multiplexer_rejections_total", "reason",
                                                      provider=lane.name).items()},
        })
    providers = []
    for name in gw.config.providers:
        providers.append({
            "provider": name,
            "upstream_requests": int(s.value("multiplexer_upstream_requests_total", provider=name)),
            "upstream_batches": int(s.value("multiplexer_upstream_batches_total", provider=name)),
            "retries": int(s.value("multiplexer_retries_total", provider=name)),
            "errors": {k: int(v) for k, v in s.by("multiplexer_upstream_errors_total", "kind",
                                                  provider=name).items()},
        })
    calls = int(s.value("multiplexer_calls_total"))
    requests = int(s.value("multiplexer_upstream_requests_total"))
    errors: dict[str, int] = {}
    for labels, n in s.rows("multiplexer_calls_total"):
        if labels["outcome"] != "ok":
            errors[labels["outcome"]] = errors.get(labels["outcome"], 0) + int(n)
    return {"routes": out_routes, "lanes": lanes, "providers": providers,
            "totals": {"calls": calls, "upstream_requests": requests, "errors": errors,
                       "ratio": round(calls / requests, 3) if requests else None}}


def _bucket(bucket: TokenBucket | None, now: float) -> dict[str, Any] | None:
    if bucket is None:
        return None
    available = max(0.0, bucket.available(now))
    return {"limit": bucket.capacity, "configured": bucket.ceiling,
            "used": round(bucket.capacity - available, 3), "available": round(available, 3),
            "learned": bucket.ceiling is None or bucket.until > now or bucket.capacity != bucket.ceiling}


@panel("limits")
async def limits(view: View) -> dict[str, Any]:
    """Each provider's limiter: rpm / tpm use against the limit (and whether the upstream's
    headers taught it), concurrency in use, a Retry-After pause, and which lane it holds."""
    gw = view.gateway
    now = gw.clock.now()
    out = []
    for name, limiter in gw.limiters.items():
        row: dict[str, Any] = {"provider": name, "shared": bool(getattr(limiter, "shared", False))}
        if isinstance(limiter, RateLimiter):
            row.update({
                "rpm": _bucket(limiter.requests, now), "tpm": _bucket(limiter.tokens, now),
                "concurrency": {"limit": limiter.concurrency or None, "in_flight": limiter.in_flight},
                "paused_s": round(max(0.0, limiter.paused_until - now), 3),
            })
        held = {lane.name: lane.holding() for lane in gw.lanes.values()
                if lane.provider == name and len(lane.queue) and lane.holding()}
        row["held"] = held  # lane -> the limit that keeps its queue waiting now
        row["waiting"] = sum(len(lane.queue) for lane in gw.lanes.values() if lane.name in held)
        row["rejections"] = {k: int(v) for k, v in view.samples.by(
            "multiplexer_rejections_total", "reason", provider=name).items()}
        out.append(row)
    return {"providers": out}


def _job(job: JobRow, counts: dict[str, int], parts: list[PartRow]) -> dict[str, Any]:
    return {"job_id": job.id, "identity": job.identity, "source": job.source, "state": job.state,
            "total": job.total, "created_at": job.created, "updated_at": job.updated,
            "counts": {"pending": counts.get("queued", 0), "running": counts.get("submitted", 0),
                       "done": counts.get("succeeded", 0), "failed": counts.get("failed", 0)},
            "batches": [{"provider": p.provider, "remote_id": p.remote_id, "state": p.state,
                         "remote_status": p.remote_status} for p in parts]}


@panel("jobs", callers=True)
async def jobs(view: View) -> dict[str, Any]:
    """Open batch jobs with their items by state and their remote batches; MCP tasks are the
    jobs whose source is ``task``. A caller key sees its own jobs (open or not) only."""
    face = view.gateway.faces.get("jobs")
    if face is None:
        return not_configured("no provider runs batch jobs (an openai or anthropic provider does)")
    st = face.store()

    def read() -> list[dict[str, Any]]:
        rows = st.open_jobs(JOBS_SHOWN) if view.admin else st.list_jobs(view.identity, JOBS_SHOWN)
        return [_job(j, st.counts(j.id), st.job_parts(j.id)) for j in rows]

    listed = await st.run(read)
    out: dict[str, Any] = {"configured": True, "jobs": listed,
                           "mcp_tasks": sum(1 for j in listed if j["source"] == "task")}
    if view.admin:  # the store's totals, as /metrics has them (refreshed before this snapshot)
        s = view.samples
        out["open"] = int(s.value("multiplexer_batch_jobs_open"))
        out["items"] = {k: int(v) for k, v in s.by("multiplexer_batch_items", "state").items()}
    return out


@panel("mcp")
async def mcp(view: View) -> dict[str, Any]:
    """Each MCP upstream: up / starting / failing with its last error, protocol era, tools."""
    gw = view.gateway
    out = []
    for name, provider in gw.providers.items():
        if not isinstance(provider, McpUpstream):
            continue
        row: dict[str, Any] = {"provider": name, **provider_status(gw, name)}
        if isinstance(provider, Describes):
            row.update(provider.describe())
        row["disconnects"] = int(view.samples.value("multiplexer_events_total", component=f"mcp:{name}",
                                                 event="disconnected"))
        out.append(row)
    if not out:
        return not_configured("no mcp provider in the config")
    return {"configured": True, "upstreams": out}


@panel("local")
async def local(view: View) -> dict[str, Any]:
    """In-process models: device, batch budget, tokens and batches (cumulative), padding share,
    OOM splits (the ``local`` component's events in /metrics)."""
    gw = view.gateway
    out = []
    for name, provider in gw.providers.items():
        if gw.config.providers[name].kind != "local" or not isinstance(provider, Describes):
            continue
        described = provider.describe()
        out.append({"provider": name, **provider_status(gw, name), **described,
                    "cpu_s": view.samples.by("multiplexer_compute_cpu_seconds", "model", provider=name),
                    "oom_splits": int(view.samples.value("multiplexer_events_total", component="local",
                                                         event="oom_split"))})
    if not out:
        return not_configured("no local provider in the config")
    return {"configured": True, "providers": out}


@panel("state")
async def state(view: View) -> dict[str, Any]:
    """Shared state (mode, reachable, replicas seen, local decisions while it was down) and the
    job store; what /readyz checks, read the same way."""
    gw = view.gateway
    out: dict[str, Any] = {}
    if gw.state is not None and gw.config.state.url is not None:
        out["state"] = await state_status(gw.state, gw.config.state.url)
        out["state"]["replicas"] = gw.state.live_replicas()
    else:
        out["state"] = {"mode": "local", "reachable": True, "replicas": 1}
    out["state"]["degraded"] = {k: int(v) for k, v in view.samples.by(
        "multiplexer_state_degraded_total", "part").items()}
    face = gw.faces.get("jobs")
    out["store"] = (await store_status(face.store, gw.config.store.url is not None)
                    if face is not None else None)
    return out


@panel("spend", callers=True)
async def spend(view: View) -> dict[str, Any]:
    """What calls cost and what the gateway saved, by route, with the share of each route's input
    tokens its provider read from a prompt cache (live), from the counters `/metrics` has
    (cumulative since start), and from the spend store by day (two weeks) and by key (this month),
    as `GET /admin/spend` has them (``stored``; read at most every few seconds). A caller
    key sees its own: today and this month by route and model, and its budget's use, from the
    spend store (``money/own.py``; `/metrics` has no key label). Keys are named beside their ids
    (``key_name``), as `GET /admin/spend` names them."""
    money = getattr(view.gateway, "money", None)
    if money is None:
        return not_configured("calls are not priced (spend.enabled: false)")
    names = key_names(view.gateway)
    if not view.admin:
        if view.identity is None:
            return not_configured("a keyless caller has no spend of its own")
        own = await money.own.of(view.identity)
        return {"configured": True, "key": view.identity, "key_name": await names.of(view.identity), **own}
    s = view.samples
    cost = s.by("multiplexer_spend_usd_total", "route")
    saved = s.by("multiplexer_saved_usd_total", "route")
    unknown = s.by("multiplexer_unknown_cost_calls_total", "route")
    sent = s.by("multiplexer_input_tokens_total", "route")
    read = s.by("multiplexer_cache_read_tokens_total", "route")
    routes = [{"route": r, "cost_usd": cost.get(r, 0.0), "saved_usd": saved.get(r, 0.0),
               "unknown_cost_calls": int(unknown.get(r, 0)), "input_tokens": int(sent.get(r, 0)),
               "cache_read_tokens": int(read.get(r, 0)),
               "cache_read_share": round(read.get(r, 0) / sent[r], 4) if sent.get(r) else None}
              for r in sorted(set(cost) | set(saved) | set(unknown) | set(sent))]
    return {"configured": True, "cost_usd": sum(cost.values()), "saved_usd": sum(saved.values()),
            "saved_by": s.by("multiplexer_saved_usd_total", "how"),
            "unknown_cost_calls": int(sum(unknown.values())), "routes": routes,
            "stored": await _named(names, await money.overview())}


async def _named(names: KeyNames, stored: dict[str, Any]) -> dict[str, Any]:
    """The overview with its keys named (a copy: the overview is cached as the store had it)."""
    return {**stored, "keys": await names.named(stored["keys"])}


@panel("breakers")
async def breakers(view: View) -> dict[str, Any]:
    """Circuit breakers by endpoint (0 closed, 1 open, 2 half-open), fallbacks taken and attempts
    by result: the `/metrics` series of docs/fallbacks.md."""
    gw, s = view.gateway, view.samples
    configured = bool(gw.config.groups) or any(
        r.fallbacks or r.context_window_fallbacks for r in gw.config.routes.values()) or any(
        p.breaker is not None for p in gw.config.providers.values())
    if not configured:
        return not_configured("no fallbacks, model groups or circuit breakers are configured")
    states = {0: "closed", 1: "open", 2: "half_open"}
    return {"configured": True,
            "breakers": {e: states.get(int(v), str(v))
                         for e, v in sorted(s.by("multiplexer_breaker_state", "endpoint").items())},
            "fallbacks": [{"from": labels.get("from_route", ""), "to": labels.get("to_route", ""),
                           "reason": labels.get("reason", ""), "calls": int(v)}
                          for labels, v in s.rows("multiplexer_fallbacks_total")],
            "attempts": {f"{labels.get('route', '')}:{labels.get('result', '')}": int(v)
                         for labels, v in s.rows("multiplexer_attempts_total")}}


@panel("cache")
async def cache(view: View) -> dict[str, Any]:
    """The semantic cache per route: hit rate, hits, lookups, what it saved (``/metrics``'
    ``multiplexer_saved_usd{how="semantic_cache"}``), index size and wrong hits reported."""
    gw = view.gateway
    if gw.semantic is None:
        return not_configured("no route, key or team is semantically cached (cache.semantic)")
    from multiplexer.faces.admin_cache import cache_stats

    saved = view.samples.by("multiplexer_saved_usd_total", "route", how="semantic_cache")
    return {"configured": True, "routes": [{"route": route, **stats, "saved_usd": saved.get(route, 0.0)}
                                           for route, stats in cache_stats(gw).items()]}


def finite(value: Any) -> Any:
    """JSON has no infinities: a bound or limit of inf is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
