"""Gateway core against a fast JSON-RPC upstream on 127.0.0.1 (issue: gateway core).

Measures, in one run: added latency of one call through the gateway vs straight
to the upstream; 10,000 calls by one ``call_many``; 1,000 identical concurrent
calls on a dedup route. Upstream, gateway and client are separate processes.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from benchmarks._procs import child, free_port, percentile, save, table
from multiplexer import Client

CONFIG = """
server: {{host: 127.0.0.1, port: {port}}}
providers:
  calc:
    kind: jsonrpc
    url: http://127.0.0.1:{upstream}/
    batch: {{max_items: 100, max_wait_ms: 2}}
    limits: {{rpm: 600000, concurrency: 16}}
routes:
  subtract: {{provider: calc}}
  sum: {{provider: calc, dedup: true}}
  get_data: {{provider: calc}}
  notify_hello: {{provider: calc}}
  stats: {{provider: calc}}
"""


async def latencies(url: str, n: int) -> list[float]:
    body = b'{"jsonrpc":"2.0","method":"subtract","params":[42,23],"id":1}'
    out = []
    async with httpx.AsyncClient() as http:
        for _ in range(50):
            await http.post(url, content=body)
        for _ in range(n):
            t = time.perf_counter()
            r = await http.post(url, content=body)
            out.append(time.perf_counter() - t)
            assert r.json()["result"] == 19
    return out


def upstream_requests(metrics: str) -> float:
    m = re.search(r'multiplexer_upstream_requests_total\{provider="calc"\} ([0-9.e+]+)', metrics)
    return float(m.group(1)) if m else 0.0


async def run(n_latency: int, n_many: int) -> dict:
    up_port, gw_port = free_port(), free_port()
    up_url, gw = f"http://127.0.0.1:{up_port}/", f"http://127.0.0.1:{gw_port}"
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "bench.yaml"
        conf.write_text(CONFIG.format(port=gw_port, upstream=up_port))
        with child(["examples/jsonrpc_upstream.py", "--port", str(up_port)], up_url), \
                child(["-m", "multiplexer", "serve", "--config", str(conf)], f"{gw}/healthz"):
            direct = await latencies(up_url, n_latency)
            through = await latencies(f"{gw}/rpc", n_latency)
            async with Client(gw) as client, httpx.AsyncClient() as http:
                before = upstream_requests((await http.get(f"{gw}/metrics")).text)
                t = time.perf_counter()
                results = await client.call_many([("subtract", [i, 1]) for i in range(n_many)])
                many_s = time.perf_counter() - t
                assert results == [i - 1 for i in range(n_many)]
                after = upstream_requests((await http.get(f"{gw}/metrics")).text)
                base = (await client.call("stats"))["executions"].get("sum", 0)
                same = await client.call_many([("sum", [1, 2, 3])] * 1000)
                assert same == [6] * 1000
                dedup_execs = (await client.call("stats"))["executions"]["sum"] - base
    return {
        "direct_p50_ms": percentile(direct, 0.5) * 1e3,
        "direct_p99_ms": percentile(direct, 0.99) * 1e3,
        "gateway_p50_ms": percentile(through, 0.5) * 1e3,
        "gateway_p99_ms": percentile(through, 0.99) * 1e3,
        "added_p50_ms": (percentile(through, 0.5) - percentile(direct, 0.5)) * 1e3,
        "added_p99_ms": (percentile(through, 0.99) - percentile(direct, 0.99)) * 1e3,
        "call_many_calls": n_many,
        "call_many_calls_per_s": n_many / many_s,
        "call_many_upstream_requests": after - before,
        "dedup_calls": 1000,
        "dedup_upstream_executions": dedup_execs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--latency-calls", type=int, default=2000)
    parser.add_argument("--many", type=int, default=10_000)
    args = parser.parse_args()
    r = anyio.run(run, args.latency_calls, args.many)
    rows = [
        ["one call, p50 (ms)", f"{r['direct_p50_ms']:.3f}", f"{r['gateway_p50_ms']:.3f}",
         f"added {r['added_p50_ms']:.3f}", "added < 1 ms"],
        ["one call, p99 (ms)", f"{r['direct_p99_ms']:.3f}", f"{r['gateway_p99_ms']:.3f}",
         f"added {r['added_p99_ms']:.3f}", ""],
        [f"{r['call_many_calls']:,} calls by one call_many", "", f"{r['call_many_calls_per_s']:,.0f} calls/s",
         f"{r['call_many_upstream_requests']:.0f} upstream requests", ">= 5,000/s; <= 110 requests"],
        ["1,000 identical calls, dedup route", "1,000 executions (no dedup)",
         f"{r['dedup_upstream_executions']} execution(s)", "", "1 execution"],
    ]
    print(table(["measure", "straight to upstream", "through gateway", "note", "floor"], rows))
    save("bench_core", r)


if __name__ == "__main__":
    main()
