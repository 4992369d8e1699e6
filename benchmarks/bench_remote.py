"""Remote providers against the fake OpenAI server (issue: remote LLM providers).

Measures, in one run:
- 10,000 concurrent single-text embedding calls through a packing route vs a route that
  sends one upstream request per call: upstream HTTP requests and calls/s;
- 50,000 chat calls in batch mode (a ``mode: batch`` route, and the SDK's
  ``call_many(mode="batch")``): batch jobs created, wall time, the gateway's peak RSS,
  every result delivered.
Fake server, gateway and client are separate processes; RSS is the gateway's.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

from benchmarks._gateway import RssSampler, gateway, metric_sum
from benchmarks._procs import child, free_port, save, table
from multiplexer import Client
from multiplexer.core.errors import RpcError

MAX_INPUTS = 2048
CONCURRENCY = 16

CONFIG = """
server: {{host: 127.0.0.1, port: {{port}}, grace_period_s: 2}}
store: {{path: {store}}}
providers:
  oai:
    kind: openai
    base_url: http://127.0.0.1:{fake}/v1
    api_key: sk-bench
    max_inputs: {max_inputs}
    batch: {{max_items: {max_inputs}, max_wait_ms: 5}}
    limits: {{concurrency: {concurrency}, max_queue: 200000}}
    batch_poll_interval_s: 0.5
routes:
  embed: {{provider: oai, operation: embeddings, params: {{model: text-embedding-3-small}}}}
  embed_single:
    provider: oai
    operation: embeddings
    params: {{model: text-embedding-3-small}}
    batch: {{max_items: 1, max_wait_ms: 0}}
  chat: {{provider: oai, operation: chat, params: {{model: gpt-test}}}}
  chat_batch:
    provider: oai
    operation: chat
    mode: batch
    params: {{model: gpt-test}}
    batch: {{max_items: 50000, max_wait_ms: 2000}}
    timeout_ms: 1800000
"""


def prompt(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"question {i}"}]}


def text_of(result: Any) -> Any:
    return result["choices"][0]["message"]["content"] if isinstance(result, dict) else result


async def metrics(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/metrics", timeout=30)).text


async def upstream(url: str) -> float:
    return metric_sum(await metrics(url), "multiplexer_upstream_requests_total", provider="oai")


async def embeddings(url: str, route: str, n: int) -> dict[str, Any]:
    async with Client(url, timeout=600, concurrency=max(1, n // 1000) + 1) as client:
        await client.call(route, {"input": "warm up"})
        before = await upstream(url)
        t = time.perf_counter()
        results = await client.call_many([(route, {"input": f"text number {i}"}) for i in range(n)])
        seconds = time.perf_counter() - t
        requests = await upstream(url) - before
    ok = sum(1 for r in results if isinstance(r, dict) and len(r["data"]) == 1
             and r["data"][0]["index"] == 0)
    return {"calls": n, "seconds": seconds, "calls_per_s": n / seconds, "upstream_requests": requests,
            "delivered": ok}


async def batch_route(url: str, n: int) -> dict[str, Any]:
    async with Client(url, timeout=1800, concurrency=n // 1000 + 1) as client:
        t = time.perf_counter()
        results = await client.call_many([("chat_batch", prompt(i)) for i in range(n)])
        seconds = time.perf_counter() - t
    ok = sum(1 for i, r in enumerate(results) if text_of(r) == f"echo: question {i}")
    errors = [r for r in results if isinstance(r, RpcError)][:3]
    return {"calls": n, "seconds": seconds, "delivered": ok, "sample_errors": [repr(e) for e in errors]}


async def batch_sdk(url: str, n: int) -> dict[str, Any]:
    async with Client(url, timeout=1800) as client:
        t = time.perf_counter()
        results = await client.call_many([("chat", prompt(i)) for i in range(n)], mode="batch")
        seconds = time.perf_counter() - t
    ok = sum(1 for i, r in enumerate(results) if text_of(r) == f"echo: question {i}")
    return {"calls": n, "seconds": seconds, "delivered": ok}


def jobs_created(text: str) -> float:
    return metric_sum(text, "multiplexer_events_total", component="oai", event="batch_submitted")


def run(n_embed: int, n_batch: int) -> dict[str, Any]:
    fake_port = free_port()
    out: dict[str, Any] = {"max_inputs": MAX_INPUTS, "concurrency_cap": CONCURRENCY}
    with tempfile.TemporaryDirectory() as tmp, child(
            ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port)],
            f"http://127.0.0.1:{fake_port}/v1/models"):
        def config(name: str) -> str:
            return CONFIG.format(fake=fake_port, store=Path(tmp) / f"{name}.db",
                                 max_inputs=MAX_INPUTS, concurrency=CONCURRENCY)

        with gateway(config("embed")) as gw:
            out["embed_packed"] = anyio.run(embeddings, gw.url, "embed", n_embed)
            out["embed_single"] = anyio.run(embeddings, gw.url, "embed_single", n_embed)
        for name, phase in (("batch_route", batch_route), ("batch_sdk", batch_sdk)):
            with gateway(config(name)) as gw, RssSampler(gw.pid) as rss:
                idle = psutil.Process(gw.pid).memory_info().rss
                result = anyio.run(phase, gw.url, n_batch)
                result["jobs_created"] = jobs_created(anyio.run(metrics, gw.url))
                result["peak_rss_mb"] = rss.peak() / 2**20
                result["idle_rss_mb"] = idle / 2**20
                out[name] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--embed-calls", type=int, default=10_000)
    parser.add_argument("--batch-calls", type=int, default=50_000)
    args = parser.parse_args()
    r = run(args.embed_calls, args.batch_calls)
    packed, single = r["embed_packed"], r["embed_single"]
    floor = math.ceil(packed["calls"] / MAX_INPUTS) + CONCURRENCY
    rows = [
        [f"{packed['calls']:,} concurrent embedding calls", "upstream HTTP requests",
         f"{single['upstream_requests']:,.0f}", f"{packed['upstream_requests']:,.0f}",
         f"{single['upstream_requests'] / max(packed['upstream_requests'], 1):,.0f}x fewer",
         f"<= {floor}"],
        ["", "calls/s", f"{single['calls_per_s']:,.0f}", f"{packed['calls_per_s']:,.0f}",
         f"{packed['calls_per_s'] / single['calls_per_s']:.1f}x", ""],
        ["", "delivered, one vector each", f"{single['delivered']:,}", f"{packed['delivered']:,}", "",
         "all"],
    ]
    for name, label in (("batch_route", "mode: batch route"), ("batch_sdk", "call_many(mode=\"batch\")")):
        b = r[name]
        rows += [
            [f"{b['calls']:,} chat calls, {label}", "batch jobs created", "", f"{b['jobs_created']:.0f}",
             "", ""],
            ["", "wall time (s)", "", f"{b['seconds']:.1f}", f"{b['calls'] / b['seconds']:,.0f} calls/s", ""],
            ["", "gateway peak RSS (MB)", f"idle {b['idle_rss_mb']:.0f}", f"{b['peak_rss_mb']:.0f}", "",
             "< 300"],
            ["", "results delivered", "", f"{b['delivered']:,}", "", "all"],
        ]
    print(table(["workload", "measure", "one request per call", "gateway", "ratio", "floor"], rows))
    save("bench_remote", r)


if __name__ == "__main__":
    main()
