"""Config reloads under load: calls sent, answered, lost and answered with a 5xx.

A gateway child process serves the default config (``multiplexer/defaults/default.yaml``, copied
with a free port); callers send ``echo`` over ``/rpc`` at a fixed rate (open loop: each call has
its send time, and a caller that falls behind sends at once), in three phases of the same run:

* ``none``: no reload (the control);
* ``routes``: SIGHUP every 200 ms, each time with a route added or removed in the file;
* ``provider``: SIGHUP every 200 ms, each time with the ``echo`` route's provider's settings
  changed (``batch.max_wait_ms`` 1 <-> 2), so each reload starts that provider beside the old one
  and drains the old.

A call is lost when its connection failed or it got no answer; a 5xx is an HTTP status >= 500;
an error is a JSON-RPC error answer. Reloads are counted from ``multiplexer_config_reloads_total``.

    python -m benchmarks.bench_reload [--rate 1000] [--seconds 10] [--callers 48]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import yaml

from benchmarks._gateway import _served, metric_sum
from benchmarks._h11 import Conn
from benchmarks._procs import ROOT, free_port, percentile, save, table

DEFAULT = ROOT / "multiplexer" / "defaults" / "default.yaml"
RELOAD_EVERY_S = 0.2


def config(port: int, phase: str, n: int) -> dict[str, Any]:
    data = yaml.safe_load(DEFAULT.read_text())
    data["server"]["port"] = port
    data["server"]["access_log"] = False
    if phase == "routes" and n % 2:
        data["routes"][f"extra_{n}"] = {"provider": "builtin"}
    if phase == "provider":
        data["providers"]["builtin"]["batch"]["max_wait_ms"] = 1 + n % 2
    return data


async def load(url: str, rate: float, seconds: float, callers: int) -> dict[str, Any]:
    """Open-loop calls at ``rate`` for ``seconds`` over ``callers`` connections."""
    total = int(rate * seconds)
    body = b'{"jsonrpc":"2.0","id":1,"method":"echo","params":{"x":1}}'
    headers = {"content-type": "application/json"}
    conns = [Conn.to(url, timeout=30) for _ in range(callers)]
    out: dict[str, Any] = {"sent": 0, "ok": 0, "errors": 0, "5xx": 0, "lost": 0, "latency": [], "why": {}}
    nxt = 0
    start = time.perf_counter() + 0.05

    async def caller(conn: Conn) -> None:
        nonlocal nxt
        while nxt < total:
            i = nxt
            nxt += 1
            due = start + i / rate
            wait = due - time.perf_counter()
            if wait > 0:
                await anyio.sleep(wait)
            out["sent"] += 1
            t = time.perf_counter()
            try:
                reply = await conn.request("POST", "/rpc", headers, body)
            except Exception:
                out["lost"] += 1
                continue
            out["latency"].append(time.perf_counter() - t)
            if reply.status >= 500:
                out["5xx"] += 1
            elif reply.status != 200 or "result" not in (answer := json.loads(reply.body)):
                out["errors"] += 1
                why = answer.get("error", {}).get("message", "?") if reply.status == 200 else reply.status
                out["why"][str(why)] = out["why"].get(str(why), 0) + 1
            else:
                out["ok"] += 1

    try:
        async with anyio.create_task_group() as tg:
            for conn in conns:
                tg.start_soon(caller, conn)
    finally:
        for conn in conns:
            await conn.aclose()
    out["seconds"] = time.perf_counter() - start
    return out


async def reloading(pid: int, path: Path, port: int, phase: str, stop: anyio.Event) -> int:
    """Rewrite the file and SIGHUP the gateway every 200 ms until ``stop``; the SIGHUPs sent."""
    n = 0
    while not stop.is_set():
        with anyio.move_on_after(RELOAD_EVERY_S):
            await stop.wait()
        if stop.is_set():
            break
        n += 1
        new = path.with_suffix(".new")  # written beside it and renamed over it: never read half written
        new.write_text(yaml.safe_dump(config(port, phase, n)))
        new.replace(path)
        os.kill(pid, signal.SIGHUP)
    return n


async def phase_run(proc: Any, path: Path, port: int, phase: str, args: argparse.Namespace) -> list[Any]:
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        before = (await http.get(f"{proc.url}/metrics")).text
    stop = anyio.Event()
    signals: list[int] = []

    async def reload_task() -> None:
        signals.append(await reloading(proc.pid, path, port, phase, stop))

    async with anyio.create_task_group() as tg:
        if phase != "none":
            tg.start_soon(reload_task)
        result = await load(proc.url, args.rate, args.seconds, args.callers)
        stop.set()
    await anyio.sleep(1.0)  # the last reload ends before its count is read
    async with httpx.AsyncClient(timeout=10) as http:
        after = (await http.get(f"{proc.url}/metrics")).text
    reloads = {r: int(metric_sum(after, "multiplexer_config_reloads_total", result=r)
                      - metric_sum(before, "multiplexer_config_reloads_total", result=r))
               for r in ("ok", "invalid", "failed")}
    lat = result["latency"] or [0.0]
    if result["why"]:
        print(phase, "errors:", result["why"])
    return [phase, signals[0] if signals else 0, reloads["ok"],
            reloads["invalid"] + reloads["failed"], result["sent"], result["ok"], result["lost"],
            result["5xx"], result["errors"], f"{result['sent'] / result['seconds']:.0f}",
            f"{percentile(lat, 0.5) * 1000:.1f}", f"{percentile(lat, 0.99) * 1000:.1f}"]


async def main(args: argparse.Namespace) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.yaml"
        path.write_text(yaml.safe_dump(config(port, "none", 0)))
        with _served(["-m", "multiplexer", "serve", "--config", str(path)], port, Path(tmp)) as proc:
            try:
                rows = [await phase_run(proc, path, port, phase, args)
                        for phase in args.phases.split(",")]
            except Exception:
                if args.log:
                    Path(args.log).write_text(proc.log())
                print(f"gateway {'alive' if proc.alive() else 'exited'}; its log: {args.log}")
                raise
            tracebacks = proc.tracebacks()
            if args.log:
                Path(args.log).write_text(proc.log())
    headers = ["phase", "SIGHUPs", "reloads ok", "reloads refused", "sent", "answered", "lost",
               "5xx", "errors", "calls/s", "p50 ms", "p99 ms"]
    print(f"default config, {args.rate:.0f} calls/s asked for {args.seconds:.0f} s per phase, "
          f"{args.callers} connections, {os.cpu_count()} cores; gateway tracebacks: {tracebacks}")
    print(table(headers, rows))
    save("reload", {"args": vars(args), "headers": headers, "rows": rows})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--callers", type=int, default=48)
    parser.add_argument("--log", default=None, help="a file to copy the gateway's log to")
    parser.add_argument("--phases", default="none,routes,provider", help="of none, routes, provider")
    anyio.run(main, parser.parse_args(), backend_options={"use_uvloop": True})
