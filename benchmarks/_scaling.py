"""The scaling phase of ``bench_llm`` (``--scaling-phase``): ``serve --workers N`` for several N on a
machine with many cores, against calling the upstream directly.

The workers phase keeps the issue's setting (256 callers in this one process, one upstream
process): at 50 ms a call 256 callers can make at most 5,120 calls/s, and one process of callers
or one upstream process tops out near a core's worth, so on a machine with many cores that phase
measures its callers and its upstream, not the gateway. Here the callers are spread over several
processes (``benchmarks/_load.py``), the upstream is several processes of the fake OpenAI API on one
port (SO_REUSEPORT), and there are enough callers (2,048 by default: 40,960 calls/s at 50 ms) that
the gateway's workers are what limits. Every gateway runs at once, idle between its turns; the
paths take turns in each round and the rounds' calls/s are summed over their seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._llm_phases import gateway_config, load_average, wait_ready
from benchmarks._procs import ROOT, child, free_port, logged_child, table

READY_LINE = b"fake openai API on"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scaling-phase", action="store_true",
                        help="also: --workers N for several N with callers and upstream in several processes")
    parser.add_argument("--scaling-workers", default="1,2,4,8",
                        help="the worker counts, comma-separated (auto: the cores)")
    parser.add_argument("--scaling-callers", type=int, default=2048)
    parser.add_argument("--scaling-calls", type=int, default=60_000, help="per path and round")
    parser.add_argument("--scaling-rounds", type=int, default=2)
    parser.add_argument("--scaling-clients", type=int, default=0,
                        help="processes of callers (0: a quarter of the cores, at least 1)")
    parser.add_argument("--scaling-upstreams", type=int, default=0,
                        help="processes of the fake upstream (0: a quarter of the cores, at least 1)")


@contextlib.contextmanager
def upstreams(count: int, port: int, tmp: str) -> Any:
    """``count`` fake OpenAI processes on one port, each waited for until it accepts."""
    args = ["-m", "tests.fakes.serve", "openai", "--port", str(port), "--reuse-port", "--latency-ms", "50",
            "--requests-per-window", "1000000000", "--keepalive-s", "600"]
    with contextlib.ExitStack() as stack:
        procs = []
        for i in range(count):
            log = Path(tmp) / f"upstream{i}.log"
            procs.append(stack.enter_context(logged_child(args, f"http://127.0.0.1:{port}/", log)))
            end = time.monotonic() + 60
            while READY_LINE not in log.read_bytes():  # its own socket listens, not a sibling's
                if time.monotonic() > end:
                    raise RuntimeError(f"upstream {i} did not start: {log.read_text()[-500:]}")
                time.sleep(0.05)
        yield procs


def load(url: str, callers: int, calls: int, clients: int) -> tuple[float, float]:
    """Wall seconds from the start signal to the last caller's end, and the callers' CPU seconds."""
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks._load", url,
                               str(callers // clients), str(calls // clients)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(clients)]
    try:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a load process for {url} did not start")
        t = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
        return time.perf_counter() - t, sum(r["cpu_s"] for r in reports)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_scaling(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_llm import cpu_seconds

    cores = os.cpu_count() or 1
    clients = args.scaling_clients or max(1, cores // 4)
    ups = args.scaling_upstreams or max(1, cores // 4)
    callers = args.scaling_callers // clients * clients
    calls = args.scaling_calls // clients * clients
    fake_port = free_port()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        fakes = stack.enter_context(upstreams(ups, fake_port, tmp))
        paths: list[tuple[str, str, int | None]] = [("direct (upstream +50 ms)",
                                                     f"http://127.0.0.1:{fake_port}", None)]
        for workers in args.scaling_workers.split(","):
            conf, url = gateway_config(tmp, f"s{workers}", fake_port, concurrency=callers * 2)
            proc = stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf),
                                              "--workers", workers], f"{url}/healthz"))
            wait_ready(url)
            paths.append((f"gateway --workers {workers}", url, proc.pid))
        load_before = load_average()
        seconds, proxy, callers_cpu, upstream = ([0.0] * len(paths) for _ in range(4))
        for _ in range(args.scaling_rounds):
            for i, (_, url, pid) in enumerate(paths):
                before, up = cpu_seconds(pid), sum(cpu_seconds(f.pid) for f in fakes)
                wall, cpu = load(url, callers, calls, clients)
                seconds[i] += wall
                callers_cpu[i] += cpu
                proxy[i] += cpu_seconds(pid) - before
                upstream[i] += sum(cpu_seconds(f.pid) for f in fakes) - up
    n = calls * args.scaling_rounds
    rows = [{"name": name, "calls_per_s": n / s, "proxy_cpu_ms_per_call": p / n * 1e3 if pid else None,
             "callers_cpu_ms_per_call": c / n * 1e3, "upstream_cpu_ms_per_call": u / n * 1e3}
            for (name, _, pid), s, p, c, u in zip(paths, seconds, proxy, callers_cpu, upstream, strict=True)]
    for r in rows:
        r["vs_direct"] = r["calls_per_s"] / rows[0]["calls_per_s"]
        if len(rows) > 1 and r is not rows[0]:
            r["vs_first_gateway"] = r["calls_per_s"] / rows[1]["calls_per_s"]
    return {"rows": rows, "cores": cores, "clients": clients, "upstreams": ups, "callers": callers,
            "calls": n, "load": load_before}


def print_scaling(result: dict[str, Any]) -> None:
    rows = result["rows"]
    print(f"\nscaling: chat calls, upstream +50 ms ({result['upstreams']} processes on one port), "
          f"{result['callers']:,} callers in {result['clients']} processes, "
          f"{result['calls']:,} calls per path; "
          f"{result['load']} (at the start)")
    first = rows[1]["name"] if len(rows) > 1 else ""
    print(table(["path", "calls/s", "vs direct", f"vs {first.removeprefix('gateway ')}", "proxy CPU ms/call",
                 "callers CPU ms/call", "upstream CPU ms/call"],
                [[r["name"], f"{r['calls_per_s']:,.0f}", f"{r['vs_direct']:.2f}x",
                  f"{r['vs_first_gateway']:.2f}x" if "vs_first_gateway" in r else "",
                  "" if r["proxy_cpu_ms_per_call"] is None else f"{r['proxy_cpu_ms_per_call']:.3f}",
                  f"{r['callers_cpu_ms_per_call']:.3f}", f"{r['upstream_cpu_ms_per_call']:.3f}"]
                 for r in rows]))
