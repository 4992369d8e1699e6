"""A 50,000-line ``/v1/batches`` job on the default config's mock embeddings route, through a real
gateway process on 127.0.0.1: the gateway's peak RSS, the event loop's longest stall while the
batch runs (a tiny ``/healthz`` request every 10 ms from a client process of its own: its max
and p99 latency, from the upload to the output's last byte; the same for 3 s of the gateway idle
first, the machine's own noise), and the time to create, run and fetch the output.

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
    client's downloads would otherwise hold this timer's GIL); (when sent, ms) of each, to ``out``."""
    latencies: list[tuple[float, float]] = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(url + "/healthz")
            latencies.append((t0, (time.perf_counter() - t0) * 1000))
            stop.wait(0.01)
    out.send(latencies)


class Ticker:
    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=tick, args=(url, self.stop, send), daemon=True)
        self.latencies: list[tuple[float, float]] = []

    def start(self) -> None:
        self._proc.start()

    def join(self) -> None:
        self.latencies = self._recv.recv()
        self._proc.join()


def run(tree: Path, lines: int, content: bytes) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "gateway.yaml"
        conf.write_text(config(Path(tmp), port))
        env = {"PYTHONPATH": str(tree)}
        args = ["-c", f"import os, sys; os.chdir({str(tree)!r}); sys.path.insert(0, {str(tree)!r}); "
                "from multiplexer.cli import main; sys.exit(main())", "serve", "--config", str(conf)]
        with logged_child(args, f"{url}/healthz", Path(tmp) / "server.log", env) as proc, \
                RssSampler(proc.pid) as rss, httpx.Client(base_url=url, timeout=600) as client:
            ticker = Ticker(url)
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
            out = client.get(f"/v1/files/{batch['output_file_id']}/content")
            out.raise_for_status()
            t_out = time.perf_counter()
            ticker.stop.set()
            ticker.join()
            log = (Path(tmp) / "server.log").read_text(errors="replace")
        assert batch["request_counts"]["completed"] == lines, batch
        assert out.content.count(b"\n") == lines
    ms = [m for t, m in ticker.latencies if t >= t0]
    idle = [m for t, m in ticker.latencies if t < t0] or [0.0]
    worst_at = max((m, t) for t, m in ticker.latencies if t >= t0)[1] - t_create
    running = [m for t, m in ticker.latencies if t_create <= t < t_done] or [0.0]
    output = [m for t, m in ticker.latencies if t >= t_done] or [0.0]
    peak = max(s[2] for s in rss.samples) / 2**20
    return {"tree": str(tree), "lines": lines, "peak_rss_mb": round(peak, 1),
            "healthz_max_ms": round(max(ms), 1), "healthz_p99_ms": round(percentile(ms, 0.99), 1),
            "healthz_n": len(ms), "worst_s_after_create": round(worst_at, 2),
            "max_ms_idle": round(max(idle), 1),
            "p99_ms_idle": round(percentile(idle, 0.99), 1), "max_ms_running": round(max(running), 1),
            "p99_ms_running": round(percentile(running, 0.99), 1),
            "max_ms_output": round(max(output), 1), "upload_s": round(t_upload - t0, 2),
            "create_s": round(t_create - t_upload, 2), "run_s": round(t_done - t_create, 2),
            "output_s": round(t_out - t_done, 2), "total_s": round(t_out - t0, 2),
            "tracebacks": log.count("Traceback (most recent call last)")}


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
    rows = [[name, r["peak_rss_mb"], r["healthz_max_ms"], r["healthz_p99_ms"], r["max_ms_running"],
             r["p99_ms_running"], r["max_ms_output"], f'{r["max_ms_idle"]} / {r["p99_ms_idle"]}',
             r["create_s"], r["run_s"], r["output_s"], r["total_s"], r["tracebacks"]]
            for name, r in results]
    print(f"{args.lines} lines, /v1/embeddings on mock-embedding; /healthz every 10 ms during the run")
    print(table(["tree", "peak RSS MB", "healthz max ms", "healthz p99 ms", "max ms (running)",
                 "p99 ms (running)", "max ms (output)", "idle max / p99 ms", "create s", "run s",
                 "output s", "total s", "tracebacks"], rows))
    save("bench_v1_batch", {name: r for name, r in results})
    worst = results[-1][1]["healthz_max_ms"]
    if worst > STALL_FLOOR_MS:
        print(f"FLOOR MISSED: a {worst} ms stall (floor {STALL_FLOOR_MS} ms)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
