"""A 50,000-line ``/v1/batches`` job on the default config's mock embeddings route, through a real
gateway process on 127.0.0.1: the gateway's peak RSS, the event loop's longest stall while the
batch runs, and the time to create, run, list and fetch the output.

Stalls are seen two ways. From outside: a tiny ``/healthz`` request every 10 ms from a client
process of its own (its max and p99 latency, from the upload to the output's last byte; the
same for 3 s of the gateway idle first; and the prober's own lag, how late its 10 ms waits
ended). From inside (``_loop_watch``): each gap over 20 ms between beats of a callback on the
gateway's loop, its wall time, the loop thread's CPU time in it, the gateway's own part (its
process's CPU time), its garbage collections, and where the loop was. On a loaded host the
outside figure and the wall time mostly measure the machine not running the gateway (or the
prober); the floor (no stall over 50 ms) is judged on the gateway's own part.

The config is the packaged default one without its ``local`` model and MCP ``tools`` (torch and
a child process would dominate RSS and start-up and are not on this path), with the job store
in a temporary folder. ``--against REF`` runs the same on a copy of another commit's tree (``git
archive``; nothing of the repository changes) in the same run, for a before/after table.

    python -m benchmarks.bench_v1_batch [--lines 50000] [--against main]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks._gateway import RssSampler
from benchmarks._loop_watch import STALL_MS, stalls
from benchmarks._procs import ROOT, free_port, logged_child, percentile, save, table

STALL_FLOOR_MS = 50.0
IDLE_S = 3.0


def config(store: Path, port: int) -> str:
    data = yaml.safe_load((ROOT / "multiplexer" / "defaults" / "default.yaml").read_text())
    data["server"]["port"] = port
    for provider in ("local", "tools"):
        data["providers"].pop(provider)
    data["routes"] = {name: r for name, r in data["routes"].items()
                      if r.get("provider") not in ("local", "tools")}
    data["store"] = {"path": str(store / "jobs.db")}
    return yaml.safe_dump(data)


def batch_file(lines: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "mock-embedding", "input": f"text number {i}"}},
                               separators=(",", ":")).encode() + b"\n" for i in range(lines))


def tick(url: str, stop: Any, out: Any) -> None:
    """``GET /healthz`` every 10 ms on one kept-alive connection, in a process of its own (the
    client's downloads would otherwise hold this timer's GIL); (when sent, ms) of each, to
    ``out``, and the prober's own lag: how late each 10 ms wait of its ended (the machine not
    running the prober)."""
    latencies: list[tuple[float, float]] = []
    lags: list[float] = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(url + "/healthz")
            t1 = time.perf_counter()
            latencies.append((t0, (t1 - t0) * 1000))
            stop.wait(0.01)
            lags.append(max(0.0, (time.perf_counter() - t1 - 0.01) * 1000))
    out.send((latencies, lags))


class Ticker:
    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=tick, args=(url, self.stop, send), daemon=True)
        self.latencies: list[tuple[float, float]] = []
        self.lags: list[float] = []

    def start(self) -> None:
        self._proc.start()

    def join(self) -> None:
        self.latencies, self.lags = self._recv.recv()
        self._proc.join()


def loop_stalls(seen: list[dict[str, Any]], phases: dict[str, tuple[float, float]],
                wall_minus_perf: float) -> dict[str, Any]:
    """The gateway's own stalls (``_loop_watch``) by phase: how many, the longest in wall time,
    in the loop thread's CPU time and in the gateway's (``own_ms``); the five that held the loop's
    CPU longest and the five longest, with where the loop was.

    A stall's ``own_ms`` is the part of it the gateway's process ran (its CPU time, at most the
    wall time): the loop's own work, or a worker thread holding the GIL it waits for. The rest
    of the wall time nothing of the gateway ran: the machine ran other processes."""
    for s in seen:
        s["own_ms"] = min(s["wall_ms"], s.get("proc_cpu_ms", s["wall_ms"]))

    def phase(s: dict[str, Any]) -> str:
        return next((p for p, (lo, hi) in phases.items()
                     if lo + wall_minus_perf <= s["at"] <= hi + wall_minus_perf), "start")

    seen = [s for s in seen if phase(s) != "start"]  # starting up (the heap frozen): not served
    by_phase = {p: [s for s in seen if phase(s) == p] for p in phases}
    return {"phases": {p: {"n": len(mine), "max_wall_ms": max((s["wall_ms"] for s in mine), default=0.0),
                           "max_cpu_ms": max((s["cpu_ms"] for s in mine), default=0.0),
                           "max_own_ms": max((s["own_ms"] for s in mine), default=0.0)}
                       for p, mine in by_phase.items()},
            "max_wall_ms": max((s["wall_ms"] for mine in by_phase.values() for s in mine), default=0.0),
            "max_cpu_ms": max((s["cpu_ms"] for mine in by_phase.values() for s in mine), default=0.0),
            "max_own_ms": max((s["own_ms"] for mine in by_phase.values() for s in mine), default=0.0),
            "worst": [{**s, "phase": phase(s)} for s in sorted(seen, key=lambda s: -s["cpu_ms"])[:5]],
            "longest": [{**s, "phase": phase(s)} for s in sorted(seen, key=lambda s: -s["wall_ms"])[:5]]}


def run(tree: Path, lines: int, content: bytes) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "gateway.yaml"
        conf.write_text(config(Path(tmp), port))
        env = {"PYTHONPATH": str(tree)}
        stalls_at = Path(tmp) / "stalls.jsonl"
        watch = ROOT / "benchmarks" / "_loop_watch.py"  # this tree's watch, on either tree
        args = ["-c", f"import os, runpy, sys; os.chdir({str(tree)!r}); sys.path.insert(0, {str(tree)!r}); "
                f"sys.argv[1:] = [{str(stalls_at)!r}, *sys.argv[1:]]; "
                f"runpy.run_path({str(watch)!r}, run_name='__main__')", "serve", "--config", str(conf)]
        with logged_child(args, f"{url}/healthz", Path(tmp) / "server.log", env) as proc, \
                RssSampler(proc.pid) as rss, httpx.Client(base_url=url, timeout=600) as client:
            ticker = Ticker(url)
            t_ready = time.perf_counter()
            ticker.start()
            time.sleep(IDLE_S)  # the machine's own noise: the same ticks with the gateway idle
            t0 = time.perf_counter()
            upload = client.post("/v1/files", files={"file": ("in.jsonl", content)},
                                 data={"purpose": "batch"})
            upload.raise_for_status()
            t_upload = time.perf_counter()
            batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                     "endpoint": "/v1/embeddings",
                                                     "completion_window": "24h"}).json()
            t_create = time.perf_counter()
            while batch["status"] not in ("completed", "failed", "cancelled"):
                time.sleep(0.25)
                batch = client.get(f"/v1/batches/{batch['id']}").json()
            t_done = time.perf_counter()
            if batch["request_counts"]["failed"]:  # say why, while the gateway is there to ask
                errors = client.get(f"/v1/files/{batch['error_file_id']}/content").text
                raise RuntimeError(f"{batch['request_counts']}: {errors[:600]}; "
                                   + (Path(tmp) / "server.log").read_text(errors="replace")
                                   .partition("Traceback")[2][:3000])
            for path in ("/v1/batches?limit=100", "/v1/files", f"/v1/files/{batch['output_file_id']}"):
                client.get(path).raise_for_status()  # listings, and the output's size (built whole)
            t_listed = time.perf_counter()
            out = client.get(f"/v1/files/{batch['output_file_id']}/content")
            out.raise_for_status()
            t_out = time.perf_counter()
            ticker.stop.set()
            ticker.join()
            log = (Path(tmp) / "server.log").read_text(errors="replace")
        phases = {"idle": (t_ready, t0), "upload": (t0, t_upload), "create": (t_upload, t_create),
                  "running": (t_create, t_done), "listing": (t_done, t_listed),
                  "output": (t_listed, t_out)}
        loop = loop_stalls(stalls(stalls_at), phases, time.time() - time.perf_counter())
        assert batch["request_counts"]["completed"] == lines, batch
        assert out.content.count(b"\n") == lines
    ms = [m for t, m in ticker.latencies if t >= t0]
    idle = [m for t, m in ticker.latencies if t < t0] or [0.0]
    worst_at = max((m, t) for t, m in ticker.latencies if t >= t0)[1] - t_create
    running = [m for t, m in ticker.latencies if t_create <= t < t_done] or [0.0]
    output = [m for t, m in ticker.latencies if t >= t_done] or [0.0]  # listings and output
    peak = max(s[2] for s in rss.samples) / 2**20
    return {"tree": str(tree), "lines": lines, "peak_rss_mb": round(peak, 1),
            "healthz_max_ms": round(max(ms), 1), "healthz_p99_ms": round(percentile(ms, 0.99), 1),
            "healthz_n": len(ms), "prober_lag_max_ms": round(max(ticker.lags, default=0.0), 1),
            "worst_s_after_create": round(worst_at, 2),
            "max_ms_idle": round(max(idle), 1),
            "p99_ms_idle": round(percentile(idle, 0.99), 1), "max_ms_running": round(max(running), 1),
            "p99_ms_running": round(percentile(running, 0.99), 1),
            "max_ms_output": round(max(output), 1), "upload_s": round(t_upload - t0, 2),
            "create_s": round(t_create - t_upload, 2), "run_s": round(t_done - t_create, 2),
            "listing_s": round(t_listed - t_done, 2), "output_s": round(t_out - t_listed, 2),
            "total_s": round(t_out - t0, 2),
            "tracebacks": log.count("Traceback (most recent call last)"),
            "loop_max_wall_ms": loop["max_wall_ms"], "loop_max_cpu_ms": loop["max_cpu_ms"],
            "loop_max_own_ms": loop["max_own_ms"],
            "loop": loop, "created_at": round(t_create + time.time() - time.perf_counter(), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--against", default=None, help="a git ref to compare with (e.g. main)")
    args = parser.parse_args()
    content = batch_file(args.lines)
    trees: list[tuple[str, Path]] = [("this tree", ROOT)]
    with tempfile.TemporaryDirectory() as other:
        if args.against:
            archive = subprocess.run(["git", "archive", args.against], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", other], input=archive, check=True)
            trees.insert(0, (args.against, Path(other)))
        results = [(name, run(tree, args.lines, content)) for name, tree in trees]
    rows = [[name, r["peak_rss_mb"], r["healthz_max_ms"], r["prober_lag_max_ms"], r["healthz_p99_ms"],
             r["max_ms_running"], r["p99_ms_running"], r["max_ms_output"],
             f'{r["max_ms_idle"]} / {r["p99_ms_idle"]}',
             f'{r["loop_max_wall_ms"]} / {r["loop_max_cpu_ms"]} / {r["loop_max_own_ms"]}',
             r["create_s"], r["run_s"], r["listing_s"], r["output_s"], r["total_s"], r["tracebacks"]]
            for name, r in results]
    print(f"{args.lines} lines, /v1/embeddings on mock-embedding; /healthz every 10 ms during the run")
    print(table(["tree", "peak RSS MB", "healthz max ms", "prober's own lag max ms", "healthz p99 ms",
                 "max ms (running)", "p99 ms (running)", "max ms (output)", "idle max / p99 ms",
                 "gateway's stall max ms: wall / loop cpu / own", "create s", "run s", "listing s",
                 "output s", "total s", "tracebacks"], rows))
    for name, r in results:
        print(f"{name}: the gateway's stalls over {STALL_MS} ms by phase (n, max wall / loop cpu / own ms): "
              + ", ".join(f'{k} {p["n"]}, {p["max_wall_ms"]} / {p["max_cpu_ms"]} / {p["max_own_ms"]}'
                          for k, p in r["loop"]["phases"].items()))
        for s in r["loop"]["worst"] + r["loop"]["longest"]:
            print(f'  {s["phase"]} ({s["at"] - r["created_at"]:.2f} s after create): '
                  f'{s["wall_ms"]} ms wall, {s["cpu_ms"]} ms cpu, '
                  f'{s.get("proc_cpu_ms", 0)} ms the process\'s '
                  f'({s.get("gc_ms", 0)} ms gc) at {s["where"]}')
    save("bench_v1_batch", {name: r for name, r in results})
    last = results[-1][1]
    if last["loop_max_own_ms"] > STALL_FLOOR_MS:  # the gateway's part: host load stretches the rest
        print(f"FLOOR MISSED: the gateway held its loop {last['loop_max_own_ms']} ms at once "
              f"(floor {STALL_FLOOR_MS} ms)", file=sys.stderr)
        return 1
    if last["healthz_max_ms"] > STALL_FLOOR_MS:
        print(f"healthz max {last['healthz_max_ms']} ms over {STALL_FLOOR_MS} ms, with the gateway's "
              f"own part of any stall at most {last['loop_max_own_ms']} ms: the machine's load "
              f"(the prober itself lagged up to {last['prober_lag_max_ms']} ms)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
