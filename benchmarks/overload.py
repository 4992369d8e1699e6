"""Overload: a slow upstream of known capacity, offered 1x and then 10x that load.

The upstream (``examples/jsonrpc_upstream.py``, method ``sleep``) takes ``--upstream-ms``
per call and the gateway lets ``--concurrency`` calls run at once, so capacity is
``concurrency / upstream_ms`` calls/s. An open-loop client (arrivals on a fixed
schedule, whatever the replies do) offers 1x, then 10x, then 1x again. Measured per
phase: admitted calls/s, rejections (-32002 with ``retry_after``), p50/p99 latency of
admitted calls (request sent to reply read; the client's lag behind its schedule is
reported apart), and the gateway's peak RSS (psutil). With
a bounded queue the 10x phase must keep memory flat and admitted latency within
``max_queue / capacity`` of the 1x phase.

    python -m benchmarks.overload
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import psutil

from benchmarks._gateway import RssSampler, gateway, metric_sum, upstream
from benchmarks._h11 import Conn
from benchmarks._procs import percentile, save, table
from multiplexer.core.json_codec import loads

CONFIG = """
server: {host: 127.0.0.1, port: {port}, default_timeout_ms: 10000}
providers:
  slow:
    kind: jsonrpc
    url: http://127.0.0.1:{upstream}/
    batch: {max_items: 1}
    limits: {concurrency: {concurrency}, max_queue: {max_queue}}
routes:
  work: {provider: slow, method: sleep, params: {ms: {ms}}}
"""
BODY = b'{"jsonrpc":"2.0","method":"work","id":1}'
UPSTREAM = "multiplexer_upstream_requests_total"


@dataclass
class Phase:
    name: str
    rate: float
    seconds: float
    sent: int = 0
    latencies: list[float] = field(default_factory=list)  # admitted (ok) calls, send to reply
    outcomes: Counter[str] = field(default_factory=Counter)
    retry_after: list[float] = field(default_factory=list)
    max_lag: float = 0.0  # how far the client fell behind its own schedule
    cpu_s: float = 0.0
    upstream: float = 0.0  # upstream requests the gateway made
    samples: list[Any] = field(default_factory=list)  # unexpected errors, for the JSON


async def offer(url: str, phase: Phase, workers: int) -> None:
    """Open loop: call k is due at ``start + k / rate``; a free worker sends it then."""
    send, receive = anyio.create_memory_object_stream[float](math.inf)
    start = time.perf_counter()
    total = int(phase.rate * phase.seconds)

    async def schedule() -> None:
        async with send:
            for k in range(total):
                due = start + k / phase.rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                await send.send(due)

    async def worker() -> None:
        conn = Conn.to(url, timeout=30.0)
        try:
            async for due in receive:
                sent = time.perf_counter()
                phase.max_lag = max(phase.max_lag, sent - due)
                phase.sent += 1
                try:
                    r = await conn.request("POST", "/rpc", {"content-type": "application/json"}, BODY)
                except Exception as e:
                    phase.outcomes[f"transport {type(e).__name__}"] += 1
                    continue
                done = time.perf_counter()
                body = loads(r.body) if r.status == 200 else None
                if not isinstance(body, dict):
                    phase.outcomes[f"HTTP {r.status}"] += 1
                elif "result" in body:
                    phase.outcomes["ok"] += 1
                    phase.latencies.append(done - sent)
                else:
                    code = body["error"]["code"]
                    phase.outcomes[str(code)] += 1
                    if code not in (-32002,) and len(phase.samples) < 5:
                        phase.samples.append(body["error"])
                    if code == -32002:
                        phase.retry_after.append((body["error"].get("data") or {}).get("retry_after", 0))
        finally:
            await conn.aclose()

    async with receive, anyio.create_task_group() as tg:
        tg.start_soon(schedule)
        for _ in range(workers):
            tg.start_soon(worker)


@dataclass
class Settings:
    concurrency: int = 8
    upstream_ms: float = 100.0
    max_queue: int = 16
    seconds: float = 10.0
    workers: int = 256

    @property
    def capacity(self) -> float:
        return self.concurrency * 1000.0 / self.upstream_ms


def run(s: Settings) -> dict[str, Any]:
    with upstream("examples/jsonrpc_upstream.py") as up_url:
        return _run(s, up_url.rsplit(":", 1)[1])


def _run(s: Settings, up: str) -> dict[str, Any]:
    config = (CONFIG.replace("{upstream}", up).replace("{concurrency}", str(s.concurrency))
              .replace("{max_queue}", str(s.max_queue)).replace("{ms}", str(s.upstream_ms)))
    phases = [Phase("warm-up 1x", s.capacity, 2.0), Phase("1x", s.capacity, s.seconds),
              Phase("10x", 10 * s.capacity, s.seconds), Phase("1x after", s.capacity, s.seconds / 2)]
    with gateway(config) as gw, RssSampler(gw.pid) as rss:
        proc = psutil.Process(gw.pid)
        for phase in phases:
            rss.mark(phase.name)
            cpu, ups = sum(proc.cpu_times()[:2]), metric_sum(gw.metrics(), UPSTREAM)
            anyio.run(offer, gw.url, phase, s.workers)
            phase.cpu_s = sum(proc.cpu_times()[:2]) - cpu
            phase.upstream = metric_sum(gw.metrics(), UPSTREAM) - ups
        alive, tracebacks = gw.alive() and gw.healthy(), gw.tracebacks()
    return {"settings": s, "phases": phases, "rss": rss, "alive": alive, "tracebacks": tracebacks}


def summarise(s: Settings, phases: list[Phase], rss: RssSampler) -> dict[str, Any]:
    out: dict[str, Any] = {"capacity_calls_per_s": s.capacity, "concurrency": s.concurrency,
                           "upstream_ms": s.upstream_ms, "max_queue": s.max_queue, "phases": {}}
    for p in phases:
        lat = p.latencies or [math.nan]
        out["phases"][p.name] = {
            "offered_per_s": p.rate, "sent": p.sent, "seconds": p.seconds,
            "admitted_per_s": p.outcomes["ok"] / p.seconds, "outcomes": dict(p.outcomes),
            "rejected": p.outcomes["-32002"],
            "rejections_with_retry_after": sum(1 for x in p.retry_after if x and x > 0),
            "p50_ms": percentile(lat, 0.5) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3,
            "max_client_lag_ms": p.max_lag * 1e3, "gateway_cpu_s": p.cpu_s,
            "upstream_per_s": p.upstream / p.seconds, "error_samples": p.samples,
            "peak_rss_mb": rss.peak(p.name) / 2**20,
        }
    ten = rss.series("10x")
    half = len(ten) // 2
    out["rss_10x_first_half_peak_mb"] = max(ten[:half], default=0) / 2**20
    out["rss_10x_second_half_peak_mb"] = max(ten[half:], default=0) / 2**20
    return out


def render(out: dict[str, Any]) -> str:
    rows = []
    base = out["phases"]["1x"]
    for name, p in out["phases"].items():
        rows.append([name, f"{p['offered_per_s']:,.0f}", f"{p['admitted_per_s']:,.0f}",
                     f"{p['rejected']:,} ({p['rejections_with_retry_after']:,} with retry_after)",
                     f"{sum(v for k, v in p['outcomes'].items() if k not in ('ok', '-32002')):,}",
                     f"{p['p50_ms']:.1f}", f"{p['p99_ms']:.1f}",
                     f"{p['p99_ms'] / base['p99_ms']:.2f}x", f"{p['peak_rss_mb']:.1f}",
                     f"{p['gateway_cpu_s'] / p['seconds']:.0%}", f"{p['max_client_lag_ms']:.0f}"])
    return table(["phase", "offered calls/s", "admitted calls/s", "rejected -32002", "other errors",
                  "admitted p50 ms", "admitted p99 ms", "p99 vs 1x", "gateway peak RSS MiB",
                  "gateway CPU", "client lag max ms"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--upstream-ms", type=float, default=100.0)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    args = parser.parse_args()
    s = Settings(args.concurrency, args.upstream_ms, args.max_queue, args.seconds)
    r = run(s)
    out = summarise(s, r["phases"], r["rss"])
    out.update(gateway_alive=r["alive"], gateway_tracebacks=r["tracebacks"])
    print(f"capacity: {s.concurrency} x {s.upstream_ms:g} ms = {s.capacity:,.0f} calls/s; "
          f"queue bound {s.max_queue}\n")
    print(render(out))
    growth = out["rss_10x_second_half_peak_mb"] - out["rss_10x_first_half_peak_mb"]
    bound_ms = 1e3 * (s.max_queue + s.concurrency) / s.capacity
    print(f"\nRSS during 10x: first-half peak {out['rss_10x_first_half_peak_mb']:.1f} MiB, second-half "
          f"peak {out['rss_10x_second_half_peak_mb']:.1f} MiB (growth {growth:+.1f} MiB); "
          f"queueing bound on admitted latency: {bound_ms:.0f} ms + upstream; "
          f"gateway alive after: {r['alive']}, tracebacks: {r['tracebacks']}")
    out["rss_growth_during_10x_mb"] = growth
    save("overload", out)


if __name__ == "__main__":
    main()
