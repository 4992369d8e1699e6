"""Several replicas, one Redis: do limits, dedup and faults hold as for one gateway?

Three ``multiplexer serve`` processes share ``state.url``; clients spread calls
round-robin over them; an upstream (``benchmarks/_recorder.py``) records the time
of every request and how many were in flight. Each scenario is compared in the
same run against one gateway, or against the same three replicas without
``state.url`` (each with its own in-process state, the way they ran before):

- rpm: 5x the limit offered for ``--duration`` s; the most upstream requests in any
  60-s window, as a ratio to one gateway (floor: 0.95-1.01).
- concurrency: 60 callers over 3 replicas, limit 4: the most in flight upstream (<= 4).
- dedup: 300 identical concurrent calls over 3 replicas: upstream executions (1).
- latency: added p50 of one call with Redis on the path (goal < 0.5 ms).
- kill: a replica SIGKILLed under load: its slots come back within the lease; no
  call executes twice.
- redis down: Redis killed for 10 s under load: no more than one gateway's rate
  upstream meanwhile, every call answered, shared mode back afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import httpx

from benchmarks._gateway import GatewayProc, gateway, metric_sum
from benchmarks._procs import child, free_port, percentile, save, table
from multiplexer.transport.http1 import Http1Transport
from tests.redis_helpers import OwnRedis

CONFIG = """
server: {host: 127.0.0.1, port: {port}, default_timeout_ms: %(timeout_ms)s}
%(state)s
providers:
  up:
    kind: jsonrpc
    url: http://127.0.0.1:%(up)s/
    timeout_ms: 30000
    batch: {max_items: 1, max_wait_ms: 0}
    limits: {%(limits)s max_queue: 100000}
routes:
  work: {provider: up, dedup: false}
  same: {provider: up, dedup: true, dedup_scope: global}
"""


def config(up: int, state: str | None, *, rpm: float | None = None, concurrency: int = 64,
           timeout_ms: int = 30000, lease_s: float = 30.0, prefix: str | None = None) -> str:
    """A gateway config; with ``state``, its keys under ``prefix`` (a fresh one unless given: a test
    passes its own, so its cleanup finds them)."""
    limits = (f"rpm: {rpm}, " if rpm else "") + f"concurrency: {concurrency},"
    prefix = prefix or f"mxbench-{secrets.token_hex(3)}"
    block = (f"state: {{url: '{state}', prefix: {prefix}, lease_s: {lease_s}}}" if state else "")
    return CONFIG % {"up": up, "state": block, "limits": limits, "timeout_ms": timeout_ms}


@contextlib.contextmanager
def upstream() -> Iterator[tuple[int, str]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with child(["-m", "benchmarks._recorder", "--port", str(port)], f"{url}/stats"):
        yield port, url


@contextlib.contextmanager
def replicas(n: int, yaml: str) -> Iterator[list[GatewayProc]]:
    """``n`` gateways with one config, sharing its ``state.prefix`` (one deployment)."""
    with contextlib.ExitStack() as stack:
        yield [start(stack, yaml) for _ in range(n)]


def start(stack: contextlib.ExitStack, yaml: str, tries: int = 3) -> GatewayProc:
    """A gateway child; on a busy machine its free port can be taken first: try another."""
    for attempt in range(tries):
        try:
            return stack.enter_context(gateway(yaml))
        except RuntimeError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def stats(up: str) -> dict[str, Any]:
    return httpx.get(f"{up}/stats", timeout=10).json()


def reset(up: str) -> None:
    httpx.post(f"{up}/reset", timeout=10)


def max_window(times: list[float], width: float = 60.0) -> int:
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - width:
            j += 1
        best = max(best, i - j + 1)
    return best


class Load:
    """Round-robin JSON-RPC calls over the replicas; every answer (result or error) is counted."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.n = 0
        self.ok = self.errors = self.lost = 0
        self.lost_by: Counter[str] = Counter()
        self.offered_at = 0.0
        # the lean transport: httpx's own pool scans every connection per request, and with a few
        # hundred open it became the slowest part of the run (the client, not the gateways,
        # set the upstream's rate)
        self.http = httpx.AsyncClient(timeout=60, transport=Http1Transport(max_connections=1000))

    async def call(self, method: str, params: dict[str, Any]) -> bool:
        self.n += 1
        url = self.urls[self.n % len(self.urls)]
        try:
            r = await self.http.post(f"{url}/rpc", json={"jsonrpc": "2.0", "id": self.n,
                                                         "method": method, "params": params})
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.lost += 1  # no answer: the replica died with the call
            self.lost_by[type(e).__name__] += 1
            return False
        if "result" in body:
            self.ok += 1
            return True
        self.errors += 1
        return False

    async def offer(self, rate: float, duration: float, method: str = "work", ms: float = 0) -> None:
        """``rate`` calls per second for ``duration`` s, each in its own task (open loop)."""
        async with anyio.create_task_group() as tg:
            start = time.monotonic()
            k = 0
            while (now := time.monotonic()) < start + duration:
                due = start + k / rate
                if due > now:
                    await anyio.sleep(due - now)
                tg.start_soon(self.call, method, {"key": f"c{self.n}-{k}", "ms": ms})
                k += 1
            self.offered_at = time.monotonic()

    async def aclose(self) -> None:
        await self.http.aclose()


async def rpm_scenario(up_port: int, up: str, rpm: float, duration: float) -> dict[str, Any]:
    out = {}
    for label, n, state in (("one gateway", 1, None), ("3 replicas, shared", 3, "redis"),
                            ("3 replicas, in-process", 3, None)):
        reset(up)
        yaml = config(up_port, "redis://127.0.0.1:6379/0" if state else None, rpm=rpm,
                      timeout_ms=3000)
        with replicas(n, yaml) as gws:
            load = Load([g.url for g in gws])
            await load.offer(5 * rpm / 60, duration)
            await load.aclose()
        out[label] = {"window_max": max_window(stats(up)["times"]), "ok": load.ok,
                      "refused": load.errors, "lost": load.lost}
    one = out["one gateway"]["window_max"]
    for v in out.values():
        v["ratio"] = v["window_max"] / one
    return out


def per_second(times: list[float], start: float, end: float) -> list[int]:
    """Upstream requests in each whole second of [start, end)."""
    counts = [0] * int(end - start)
    for t in times:
        k = int(t - start)
        if 0 <= k < len(counts):
            counts[k] += 1
    return counts


async def steady_scenario(up_port: int, up: str, rpm: float, duration: float,
                          concurrency: int = 64) -> dict[str, Any]:
    """Steady overload (6x the limit) over 3 replicas: after the bucket's first burst drains, the
    upstream must see the limit's rate (rpm / 60 per second), neither above nor well below."""
    reset(up)
    yaml = config(up_port, "redis://127.0.0.1:6379/0", rpm=rpm, timeout_ms=3000,
                  concurrency=concurrency)
    with replicas(3, yaml) as gws:
        load = Load([g.url for g in gws])
        start = time.monotonic()
        await load.offer(6 * rpm / 60, duration)
        end = time.monotonic()
        offered = load.offered_at
        await load.aclose()
    counts = per_second(stats(up)["times"], start, end)
    last = counts[-10:]
    return {"limit_per_s": rpm / 60, "last_10s_per_s": sum(last) / len(last), "per_second": counts,
            "total": sum(counts), "offered": load.n, "ok": load.ok, "refused": load.errors,
            "lost": load.lost, "lost_by": dict(load.lost_by), "offer_s": offered - start,
            "run_s": end - start}


async def calls(load: Load, c: int, n: int) -> None:
    for k in range(n):
        await load.call("work", {"key": f"{c}-{k}", "ms": 50})


async def concurrency_scenario(up_port: int, up: str) -> dict[str, Any]:
    out = {}
    for label, state in (("shared", "redis://127.0.0.1:6379/0"), ("in-process", None)):
        reset(up)
        with replicas(3, config(up_port, state, concurrency=4)) as gws:
            load = Load([g.url for g in gws])
            async with anyio.create_task_group() as tg:
                for c in range(60):
                    tg.start_soon(calls, load, c, 2)
            await load.aclose()
        out[label] = {"max_in_flight": stats(up)["max_in_flight"], "ok": load.ok}
    return out


async def dedup_scenario(up_port: int, up: str) -> dict[str, Any]:
    out = {}
    for label, state in (("shared", "redis://127.0.0.1:6379/0"), ("in-process", None)):
        reset(up)
        with replicas(3, config(up_port, state)) as gws:
            load = Load([g.url for g in gws])
            async with anyio.create_task_group() as tg:
                for _ in range(300):
                    tg.start_soon(load.call, "same", {"key": "d", "ms": 300})
            await load.aclose()
        out[label] = {"executions": stats(up)["executions"].get("d", 0), "ok": load.ok}
    return out


async def latency_scenario(up_port: int, up: str, calls: int) -> dict[str, Any]:
    with gateway(config(up_port, "redis://127.0.0.1:6379/0")) as shared, \
            gateway(config(up_port, None)) as local:
        lat: dict[str, list[float]] = {"redis": [], "in-process": []}
        async with httpx.AsyncClient(timeout=30) as http:
            for i in range(calls + 50):
                for label, g in (("redis", shared), ("in-process", local)):
                    t0 = time.perf_counter()
                    await http.post(f"{g.url}/rpc", json={"jsonrpc": "2.0", "id": i, "method": "work",
                                                          "params": {"key": "l"}})
                    if i >= 50:  # warm-up
                        lat[label].append((time.perf_counter() - t0) * 1000)
    p50 = {k: percentile(v, 0.5) for k, v in lat.items()}
    return {"p50_ms": p50, "added_p50_ms": p50["redis"] - p50["in-process"]}


async def kill_scenario(up_port: int, up: str, lease_s: float) -> dict[str, Any]:
    reset(up)
    with replicas(3, config(up_port, "redis://127.0.0.1:6379/0", concurrency=4,
                            lease_s=lease_s)) as gws:
        load = Load([g.url for g in gws])
        stop = anyio.Event()

        async def caller(c: int) -> None:
            k = 0
            while not stop.is_set():
                await load.call("work", {"key": f"k{c}-{k}", "ms": 200})
                k += 1

        async with anyio.create_task_group() as tg:
            for c in range(30):
                tg.start_soon(caller, c)
            await anyio.sleep(2.0)
            gws[0].proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            load.urls = [g.url for g in gws[1:]]
            recovered = None
            await anyio.sleep(0.3)
            while time.monotonic() - killed < lease_s * 3:
                if stats(up)["in_flight"] >= 4:
                    recovered = time.monotonic() - killed
                    break
                await anyio.sleep(0.05)
            await anyio.sleep(1.0)
            stop.set()
        await load.aclose()
    s = stats(up)
    return {"slots_back_s": recovered, "lease_s": lease_s, "max_in_flight": s["max_in_flight"],
            "max_executions_per_call": max(s["executions"].values()), "lost_with_replica": load.lost}


def stamped(action: Any) -> float:
    """Run ``action``; the time it ended."""
    action()
    return time.monotonic()


async def redis_down_scenario(up_port: int, up: str, rpm: float) -> dict[str, Any]:
    reset(up)
    server = OwnRedis()
    server.start()
    try:
        with replicas(3, config(up_port, server.url, rpm=rpm, timeout_ms=3000)) as gws:
            load = Load([g.url for g in gws])
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.offer, 5 * rpm / 60, 30.0)
                await anyio.sleep(8.0)
                # off the loop (the load goes on); each instant is taken in the thread, as it
                # happens: the loop, busy with the load, may hear of it seconds later
                down = await anyio.to_thread.run_sync(stamped, server.stop)
                await anyio.sleep(10.0)
                up_again = await anyio.to_thread.run_sync(stamped, server.start)
                await anyio.sleep(6.0)
                degraded_mid = sum(metric_sum(g.metrics(), "multiplexer_state_degraded_total") for g in gws)
                await anyio.sleep(6.0)
                degraded_end = sum(metric_sum(g.metrics(), "multiplexer_state_degraded_total") for g in gws)
            await load.aclose()
    finally:
        server.stop()
    times = stats(up)["times"]
    during = [t for t in times if down <= t < up_again]
    # the bound is the limit's rate over the window as it was (a busy host stretches it past 10 s)
    return {"upstream_during_outage": len(during), "one_gateway_rate_10s": rpm / 60 * (up_again - down),
            "offered": load.n, "answered": load.ok + load.errors, "lost": load.lost,
            "lost_by": dict(load.lost_by),
            "per_second_from_down": per_second(times, down - 2, up_again + 3),
            "up_again_s": up_again - down, "degraded_decisions": degraded_mid,
            "degraded_after_return": degraded_end - degraded_mid}


SCENARIOS = ("latency", "concurrency", "dedup", "kill", "redis_down", "rpm", "steady")


async def main(args: argparse.Namespace) -> None:
    results: dict[str, Any] = {}
    wanted = args.only.split(",") if args.only else SCENARIOS
    with upstream() as (up_port, up):
        runs = {
            "latency": lambda: latency_scenario(up_port, up, args.calls),
            "concurrency": lambda: concurrency_scenario(up_port, up),
            "dedup": lambda: dedup_scenario(up_port, up),
            "kill": lambda: kill_scenario(up_port, up, args.lease_s),
            "redis_down": lambda: redis_down_scenario(up_port, up, args.rpm),
            "rpm": lambda: rpm_scenario(up_port, up, args.rpm, args.duration),
            "steady": lambda: steady_scenario(up_port, up, args.steady_rpm, args.steady_s,
                                                     args.steady_concurrency),
        }
        for name in SCENARIOS:
            if name in wanted:
                results[name] = await runs[name]()
    save("bench_replicas" + ("_" + "_".join(wanted) if args.only else ""), results)
    print(table(["scenario", "3 replicas + Redis", "3 replicas, in-process", "floor / notes"],
                rows(results, args)))


def rows(results: dict[str, Any], args: argparse.Namespace) -> list[list[Any]]:
    out: list[list[Any]] = []
    if (r := results.get("rpm")) is not None:
        out.append([f"rpm {args.rpm:g}, 5x offered, {args.duration:g} s: most upstream in a 60-s window",
                    f"{r['3 replicas, shared']['window_max']} ({r['3 replicas, shared']['ratio']:.3f}x "
                    "one gateway)",
                    f"{r['3 replicas, in-process']['window_max']} "
                    f"({r['3 replicas, in-process']['ratio']:.2f}x)",
                    f"one gateway: {r['one gateway']['window_max']}; the bucket's bound (2 x rpm): "
                    f"{2 * args.rpm:g}; floor 0.95-1.01x"])
    if (st := results.get("steady")) is not None:
        rate = st["last_10s_per_s"]
        out.append([f"rpm {args.steady_rpm:g}, 6x offered, {args.steady_s:g} s: upstream/s over the "
                    "last 10 s", f"{rate:.1f} ({rate / st['limit_per_s']:.3f}x the limit)", "-",
                    f"limit {st['limit_per_s']:g}/s, floor 0.95-1.05x; per second: "
                    f"{st['per_second'][-10:]}; answered {st['ok'] + st['refused']} of "
                    f"{st['offered']} (lost {st['lost']})"])
    if (c := results.get("concurrency")) is not None:
        out.append(["concurrency 4, 60 callers: most in flight upstream", c["shared"]["max_in_flight"],
                    c["in-process"]["max_in_flight"], "<= 4"])
    if (d := results.get("dedup")) is not None:
        out.append(["300 identical calls: upstream executions", d["shared"]["executions"],
                    d["in-process"]["executions"], "1"])
    if (lat := results.get("latency")) is not None:
        out.append(["p50 of one call (ms)", f"{lat['p50_ms']['redis']:.2f}",
                    f"{lat['p50_ms']['in-process']:.2f}",
                    f"added {lat['added_p50_ms']:.2f} ms (goal < 0.5)"])
    if (k := results.get("kill")) is not None:
        back = f"{k['slots_back_s']:.2f}" if k["slots_back_s"] is not None else "not within 3 leases"
        out.append(["replica SIGKILLed: its slots back after (s)", back, "-",
                    f"lease {k['lease_s']} s; max in flight {k['max_in_flight']}; "
                    f"max executions per call {k['max_executions_per_call']}"])
    if (rd := results.get("redis_down")) is not None:
        out.append(["Redis down 10 s: upstream requests meanwhile", rd["upstream_during_outage"], "-",
                    f"the limit's rate over the outage: {rd['one_gateway_rate_10s']:.0f}; "
                    f"answered {rd['answered']} "
                    f"of {rd['offered']} (lost {rd['lost']}); degraded decisions "
                    f"{rd['degraded_decisions']:.0f}, after return {rd['degraded_after_return']:.0f}"])
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rpm", type=float, default=600)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--steady-rpm", type=float, default=1200)
    ap.add_argument("--steady-s", type=float, default=30)
    ap.add_argument("--steady-concurrency", type=int, default=64)
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    anyio.run(main, ap.parse_args())
