"""Two more phases of ``bench_llm`` (``--workers-phase``, ``--features-phase``), each against its
own baseline in the same run.

- **workers**: an upstream that takes 50 ms per chat call, 256 concurrent callers, through
  ``multiplexer serve --workers 1`` and ``--workers auto`` and straight to the upstream: calls/s,
  the ratio, and the proxy's CPU per call (the supervisor and all its workers).
- **features**: sequential chat calls through a gateway with everything off (no traces, no key,
  ``spend.enabled: false``), and one as a team runs it: OTLP traces (to a local receiver, which
  counts what it got), an API key with a budget, and priced calls with spend on, paths taking
  turns call by call (each round in its own order); the added p50 of everything on over
  everything off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks._procs import child, free_port, percentile, table

GATEWAY = """
server: {{host: 127.0.0.1, port: {port}, access_log: false{server}}}
store: {{path: {store}}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench,
         limits: {{concurrency: {concurrency}, max_queue: 100000}}{price}}}
routes:
  chat: {{provider: oai, operation: chat, models: [gpt-bench]}}
{extra}"""
CHAT_PATH = "/v1/chat/completions"
FEATURES_KEY = "{key: sk-bench, budget_usd: {daily: 1000000, monthly: 10000000}}"
FEATURES_PRICE = ", price: {input_per_mtok: 2.5, output_per_mtok: 10}"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def wait_ready(url: str, timeout: float = 90.0) -> None:
    """Until ``/readyz`` says 200 (with workers: every one of them)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")


def gateway_config(tmp: str, name: str, fake_port: int, server: str = "",
                   extra: str = "", price: str = "", concurrency: int = 512) -> tuple[Path, str]:
    port = free_port()
    conf = Path(tmp) / f"{name}.yaml"
    conf.write_text(GATEWAY.format(port=port, fake=fake_port, store=Path(tmp) / f"{name}.db",
                                   server=server, extra=extra, price=price,
                                   concurrency=concurrency))
    return conf, f"http://127.0.0.1:{port}"


async def run_workers(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.bench_llm import Target, cpu_seconds, openai_call, throughput

    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    fake_args = ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                 "--latency-ms", "50", "--requests-per-window", "1000000000", "--keepalive-s", "600"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        upstream = stack.enter_context(child(fake_args, f"{fake}/"))
        paths = [Target("direct (upstream +50 ms)", fake, openai_call(CHAT_PATH))]
        for workers in ("1", "auto"):
            conf, url = gateway_config(tmp, f"w{workers}", fake_port)
            proc = stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf),
                                              "--workers", workers], f"{url}/healthz"))
            wait_ready(url)
            paths.append(Target(f"gateway --workers {workers}", url, openai_call(CHAT_PATH), pid=proc.pid))
        elapsed, cpu = [0.0] * len(paths), [0.0] * len(paths)
        others = [0.0] * len(paths)  # the callers' (this process) and the upstream's CPU
        rounds, per_round = 3, args.workers_calls // 3
        load = load_average()
        for _ in range(rounds):  # the paths take turns, so a busy moment hits each alike
            for i, p in enumerate(paths):
                before, side = cpu_seconds(p.pid), time.process_time() + cpu_seconds(upstream.pid)
                elapsed[i] += await throughput(p.url, p.call, 256, per_round)
                cpu[i] += cpu_seconds(p.pid) - before
                others[i] += time.process_time() + cpu_seconds(upstream.pid) - side
    n = rounds * per_round
    cores = os.cpu_count() or 1
    out = [{"name": p.name, "calls_per_s": n / e, "proxy_cpu_ms_per_call": c / n * 1e3 if p.pid else None,
            "others_cpu_ms_per_call": o / n * 1e3,
            # what the machine allows when every core is busy: cores over all CPU one call takes
            "ceiling_calls_per_s": cores / ((c + o) / n)}
           for p, e, c, o in zip(paths, elapsed, cpu, others, strict=True)]
    for r in out:
        r["vs_direct"] = r["calls_per_s"] / out[0]["calls_per_s"]
    out[2]["vs_workers_1"] = out[2]["calls_per_s"] / out[1]["calls_per_s"]
    out[2]["ceiling_vs_workers_1"] = out[2]["ceiling_calls_per_s"] / out[1]["calls_per_s"]
    out[0]["load"] = load
    return out


def print_workers(rows: list[dict[str, Any]], calls: int) -> None:
    print(f"\nworkers: chat calls, upstream +50 ms, {calls:,} calls by 256 concurrent callers; "
          f"{rows[0]['load']} (at the start)")
    print(table(["path", "calls/s", "vs direct", "vs --workers 1", "proxy CPU ms/call",
                 "callers + upstream CPU ms/call", "all cores busy: calls/s"],
                [[r["name"], f"{r['calls_per_s']:,.0f}", f"{r['vs_direct']:.2f}x",
                  f"{r['vs_workers_1']:.2f}x" if "vs_workers_1" in r else "",
                  "" if r["proxy_cpu_ms_per_call"] is None else f"{r['proxy_cpu_ms_per_call']:.3f}",
                  f"{r['others_cpu_ms_per_call']:.3f}", f"{r['ceiling_calls_per_s']:,.0f}"]
                 for r in rows]))
    auto = rows[2]
    print(f"floor: --workers auto >= 1.15x --workers 1 ({os.cpu_count()} cores shared with the callers and "
          f"the upstream); with every core busy at this CPU per call, --workers auto could reach at most "
          f"{auto['ceiling_vs_workers_1']:.2f}x --workers 1 on this machine")


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that takes every export and counts it."""

    exports = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).exports += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def otlp_receiver() -> Any:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    with contextlib.ExitStack() as stack:
        import threading

        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        stack.callback(server.shutdown)
        yield f"http://127.0.0.1:{server.server_address[1]}"


async def run_features(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.bench_llm import Target, latencies, openai_call

    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    fake_args = ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                 "--requests-per-window", "1000000000", "--keepalive-s", "600"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        receiver = stack.enter_context(otlp_receiver())
        stack.enter_context(child(fake_args, f"{fake}/"))
        off, off_url = gateway_config(tmp, "off", fake_port, extra="spend: {enabled: false}\n")
        again, again_url = gateway_config(tmp, "again", fake_port, extra="spend: {enabled: false}\n")
        on, on_url = gateway_config(  # a team's setup: traces, a key with a budget, priced calls
            tmp, "on", fake_port, server=f", api_keys: {{bench: {FEATURES_KEY}}}",
            extra=f"telemetry: {{otlp_endpoint: '{receiver}'}}\n", price=FEATURES_PRICE)
        for conf, url in ((off, off_url), (on, on_url), (again, again_url)):  # the span processor's defaults
            stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf)],
                                      f"{url}/healthz"))
        bare_port = free_port()  # what the hop alone costs: a proxy that only forwards bytes
        bare = f"http://127.0.0.1:{bare_port}"
        stack.enter_context(child(["-m", "benchmarks._bare_proxy", str(bare_port), str(fake_port)],
                                  f"{bare}/"))
        paths = [Target("direct", fake, openai_call(CHAT_PATH)),
                 Target("gateway, all off", off_url, openai_call(CHAT_PATH)),
                 Target("gateway, traces (OTLP) + key + budget + spend on", on_url, openai_call(CHAT_PATH)),
                 # a second all-off gateway: what two processes of one config differ by (A/A)
                 Target("gateway, all off (a second process)", again_url, openai_call(CHAT_PATH)),
                 Target("bare proxy (uvloop + httptools, bytes forwarded)", bare, openai_call(CHAT_PATH))]
        load = load_average()
        seq = await latencies(paths, args.features_calls, shuffled=True)
        await anyio.sleep(0.5)  # the last spans' export
        exports = _Sink.exports
    out: list[dict[str, Any]] = [
        {"name": p.name, "p50_ms": percentile(s, 0.5) * 1e3, "p90_ms": percentile(s, 0.9) * 1e3}
        for p, s in zip(paths, seq, strict=True)]
    for r in out[1:]:
        r["added_p50_ms"] = r["p50_ms"] - out[0]["p50_ms"]
    out[2]["over_off_ms"] = out[2]["p50_ms"] - (out[1]["p50_ms"] + out[3]["p50_ms"]) / 2
    out[0]["load"], out[0]["otlp_exports"] = load, exports
    out[0]["aa_ms"] = abs(out[3]["p50_ms"] - out[1]["p50_ms"])
    out[2]["own_ms"] = out[2]["p50_ms"] - out[4]["p50_ms"]  # the gateway's own work, the hop aside
    return out


def print_features(rows: list[dict[str, Any]], calls: int) -> None:
    print(f"\nfeatures on vs off: {calls:,} sequential chat calls per path, taking turns in a new "
          f"order each round; {rows[0]['load']}; OTLP exports received: {rows[0]['otlp_exports']}; "
          f"the two all-off gateways (A/A) differed by {rows[0]['aa_ms']:.3f} ms; on over off is "
          "over their mean")
    print(table(["path", "p50 (ms)", "p90 (ms)", "added p50 vs direct (ms)", "on over off (ms)"],
                [[r["name"], f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}",
                  f"{r['added_p50_ms']:+.3f}" if "added_p50_ms" in r else "",
                  f"{r['over_off_ms']:+.3f}" if "over_off_ms" in r else ""] for r in rows]))
    on, direct, bare = rows[2], rows[0], rows[4]
    print(f"floors: on over off <= 0.15 ms; added p50 with everything on <= 1.0x direct p50: "
          f"{on['added_p50_ms'] / direct['p50_ms']:.2f}x, of which the hop alone (the bare proxy) "
          f"{bare['added_p50_ms'] / direct['p50_ms']:.2f}x and the gateway's own work "
          f"{on['own_ms'] / direct['p50_ms']:.2f}x ({on['own_ms']:.3f} ms)")
