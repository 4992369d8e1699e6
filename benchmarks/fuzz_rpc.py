"""Fuzz a real gateway over HTTP: ``/rpc`` (and ``/mcp``) with generated hostile inputs.

Every input comes from a seeded generator (``fuzz_inputs``): malformed JSON, wrong
types, huge ids, deep nesting, giant batches, invalid UTF-8, oversized bodies,
random bytes, mutated valid requests, bad keys. Each reply is judged by an oracle
built from the request bytes: no 5xx, JSON-RPC 2.0 shaped, ids as owed, 204 only
when nothing is owed, 401/413 with JSON-RPC error bodies. Afterwards the gateway
must still answer ``/healthz`` and its log must hold no traceback.

    python -m benchmarks.fuzz_rpc --n 100000 --mcp 30000
"""

from __future__ import annotations

import argparse
import base64
import itertools
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import h11
import httpx
import psutil

from benchmarks._gateway import gateway, upstream
from benchmarks._h11 import Conn
from benchmarks._procs import save, table
from benchmarks.fuzz_inputs import Case, Limits, RpcFuzzer
from benchmarks.fuzz_mcp import McpFuzzer
from benchmarks.fuzz_oracle import check_mcp, check_rpc, expect_rpc

KEY = "fuzz-key-0000"
MAX_SERIES = 100  # metric series must not grow with the inputs (routes x outcomes)
LIMITS = Limits(max_body=65_536, max_items=200, max_depth=64)
CONFIG = """
server:
  host: 127.0.0.1
  port: {port}
  max_body_bytes: 65536
  max_batch_items: 200
  max_json_depth: 64
  default_timeout_ms: 3000
  api_keys: {fuzz: "${FUZZ_KEY}"}
providers:
  calc:
    kind: jsonrpc
    url: http://127.0.0.1:{upstream}/
    batch: {max_items: 50, max_wait_ms: 1}
    limits: {concurrency: 16, max_queue: 5000}
    retry: {attempts: 2, base_wait_ms: 5, max_wait_ms: 20}
routes:
  subtract: {provider: calc}
  minus: {provider: calc, method: subtract}
  sum: {provider: calc, dedup: true, cache_ttl_s: 5}
  get_data: {provider: calc}
  notify_hello: {provider: calc}
  echo: {provider: calc}
  fail: {provider: calc}
  calc_*: {provider: calc}
store: {path: "{store}"}
"""


@dataclass
class Tally:
    """Counts by input class, HTTP status and reply class; the first violations in full
    (case index, body, reply), so ``RpcFuzzer(seed, LIMITS, KEY).case(i)`` replays one."""

    by_class: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    labels: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    samples: list[dict[str, Any]] = field(default_factory=list)
    inputs: int = 0
    seconds: Counter[str] = field(default_factory=Counter)

    def record(self, case: Case, status: int | None, label: str, problems: list[str],
               reply: bytes = b"", seconds: float = 0.0) -> None:
        self.inputs += 1
        self.seconds[case.cls] += seconds
        self.by_class[case.cls]["inputs"] += 1
        self.statuses[case.cls][status or 0] += 1
        self.labels[label] += 1
        if problems:
            self.by_class[case.cls]["violations"] += 1
            for p in problems:
                self.violations[p.split(":")[0][:80]] += 1
            if len(self.samples) < 30:
                self.samples.append({
                    "case": case.index, "class": case.cls, "status": status,
                    "problems": problems, "headers": case.headers,
                    "body_b64": base64.b64encode(case.body[:2000]).decode(),
                    "reply": reply[:500].decode(errors="replace"),
                })

    @property
    def total_violations(self) -> int:
        return sum(c["violations"] for c in self.by_class.values())


async def fire(base: str, path: str, cases: Callable[[int], Case], n: int,
               check: Callable[[Case, int, str, bytes], tuple[str, list[str]]],
               concurrency: int, tally: Tally, progress: bool = False) -> None:
    counter = itertools.count()

    async def worker() -> None:
        conn = Conn.to(base, timeout=30.0)
        try:
            while (i := next(counter)) < n:
                case = cases(i)
                start = time.perf_counter()
                try:
                    r = await conn.request("POST", path, case.headers, case.body, chunked=case.chunked)
                except TimeoutError:
                    tally.record(case, None, "timeout", ["no reply within 30 s (hang)"])
                    continue
                except (OSError, anyio.BrokenResourceError, h11.ProtocolError) as e:
                    tally.record(case, None, "transport error", [f"transport: {type(e).__name__}"])
                    continue
                label, problems = check(case, r.status, r.content_type, r.body)
                tally.record(case, r.status, label, problems, r.body, time.perf_counter() - start)
                if progress and tally.inputs % 10_000 == 0:
                    print(f"  {path}: {tally.inputs:,} inputs, {tally.total_violations} violations",
                          file=sys.stderr, flush=True)
        finally:
            await conn.aclose()

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)


def rpc_check(case: Case, status: int, ctype: str, content: bytes) -> tuple[str, list[str]]:
    """(reply class, problems) for a ``/rpc`` reply to ``case`` under this run's limits and key."""
    return check_rpc(expect_rpc(case, LIMITS, KEY), status, ctype, content)


def mcp_check(case: Case, status: int, ctype: str, content: bytes) -> tuple[str, list[str]]:
    """(reply class, problems) for a ``/mcp`` reply to ``case``."""
    return check_mcp(case, KEY, LIMITS, status, ctype, content)


async def fuzz(base: str, n_rpc: int, n_mcp: int, seed: int, concurrency: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, n, fuzzer, check in (
        ("rpc", n_rpc, RpcFuzzer(seed, LIMITS, KEY), rpc_check),
        ("mcp", n_mcp, McpFuzzer(seed, LIMITS, KEY), mcp_check),
    ):
        if n <= 0:
            continue
        tally = Tally()
        start = time.perf_counter()
        await fire(base, f"/{name}", fuzzer.case, n, check, concurrency, tally, progress=True)
        results[name] = {"tally": tally, "seconds": time.perf_counter() - start}
    return results


def has_mcp() -> bool:
    try:
        import multiplexer.faces.mcp.http  # noqa: F401
    except ImportError:
        return False
    return True


def render(name: str, tally: Tally) -> str:
    statuses = sorted({s for c in tally.statuses.values() for s in c})
    heads = ["input class", "inputs", *[("no reply" if s == 0 else f"HTTP {s}") for s in statuses],
             "mean ms", "violations"]
    rows = []
    for cls in sorted(tally.by_class, key=lambda c: -tally.by_class[c]["inputs"]):
        rows.append([cls, f"{tally.by_class[cls]['inputs']:,}",
                     *[f"{tally.statuses[cls][s]:,}" for s in statuses],
                     f"{1e3 * tally.seconds[cls] / tally.by_class[cls]['inputs']:.1f}",
                     tally.by_class[cls]["violations"]])
    rows.append(["**all**", f"{tally.inputs:,}",
                 *[f"{sum(c[s] for c in tally.statuses.values()):,}" for s in statuses],
                 f"{1e3 * sum(tally.seconds.values()) / max(tally.inputs, 1):.1f}",
                 tally.total_violations])
    return f"### /{name}\n\n" + table(heads, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=100_000, help="inputs to /rpc")
    parser.add_argument("--mcp", type=int, default=30_000, help="inputs to /mcp (0: skip)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    n_mcp = args.mcp if has_mcp() else 0
    with tempfile.TemporaryDirectory() as tmp, upstream("examples/jsonrpc_upstream.py") as up, \
            gateway(CONFIG.replace("{upstream}", up.rsplit(":", 1)[1]).replace("{store}", f"{tmp}/store.db"),
                    env={"FUZZ_KEY": KEY}) as gw:
        proc = psutil.Process(gw.pid)
        rss_before = proc.memory_info().rss
        cpu_before = sum(proc.cpu_times()[:2])
        start = time.perf_counter()
        out = anyio.run(fuzz, gw.url, args.n, n_mcp, args.seed, args.concurrency)
        wall = time.perf_counter() - start
        gateway_cpu = sum(proc.cpu_times()[:2]) - cpu_before
        alive, healthy = gw.alive(), gw.healthy()
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10) if alive else None
        series = metrics.text.count("multiplexer_calls_total{") if metrics else 0
        rss_after = proc.memory_info().rss if alive else 0
        tracebacks = gw.tracebacks()
        log_tail = gw.log()[-3000:] if tracebacks else ""
    summary: dict[str, Any] = {
        "seed": args.seed, "concurrency": args.concurrency, "gateway_alive": alive,
        "healthz_after": healthy, "gateway_tracebacks": tracebacks,
        "rss_before_mb": rss_before / 2**20, "rss_after_mb": rss_after / 2**20,
        "cpus": os.cpu_count(), "wall_s": wall, "gateway_cpu_s": gateway_cpu,
        "metrics_status_after": metrics.status_code if metrics else None, "calls_series": series,
    }
    for name, r in out.items():
        tally: Tally = r["tally"]
        print(render(name, tally), end="\n\n")
        summary[name] = {
            "inputs": tally.inputs, "seconds": r["seconds"], "inputs_per_s": tally.inputs / r["seconds"],
            "violations": tally.total_violations, "by_class": {k: dict(v) for k, v in tally.by_class.items()},
            "statuses": {k: {str(s): c for s, c in v.items()} for k, v in tally.statuses.items()},
            "reply_classes": dict(tally.labels.most_common()), "violation_kinds": dict(tally.violations),
            "samples": tally.samples,
        }
    names = list(out)
    classes = sorted({lbl for n in names for lbl in out[n]["tally"].labels},
                     key=lambda lbl: -sum(out[n]["tally"].labels[lbl] for n in names))
    print(table(["response class (HTTP status, JSON-RPC code or result)", *[f"/{n}" for n in names]],
                [[lbl, *[f"{out[n]['tally'].labels[lbl]:,}" for n in names]] for lbl in classes]),
          end="\n\n")
    rows = [[f"/{name}", f"{summary[name]['inputs']:,}", f"{summary[name]['inputs_per_s']:,.0f}",
             summary[name]["violations"]] for name in out]
    print(table(["endpoint", "inputs", "inputs/s", "violations"], rows))
    print(f"\ngateway alive after: {alive}; /healthz 200 after: {healthy}; tracebacks in its log: "
          f"{tracebacks}; RSS {rss_before / 2**20:.0f} MiB -> {rss_after / 2**20:.0f} MiB; "
          f"gateway CPU {gateway_cpu:.0f} s in {wall:.0f} s; /metrics after: "
          f"{summary['metrics_status_after']} with {series} call series")
    if log_tail:
        print(log_tail)
    summary["ok"] = alive and healthy and tracebacks == 0 and summary["metrics_status_after"] == 200 \
        and series < MAX_SERIES and all(
        summary[n]["violations"] == 0 for n in out)
    save("fuzz_rpc", summary)
    raise SystemExit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
