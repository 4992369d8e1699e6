"""bench_mcp's task rows: a batch-mode ``tools/call`` as an MCP task, against the fake OpenAI batch API.

The same route is called two ways from a 2026-07-28 client over /mcp: holding the
request open until the batch ends (no opt-in), and as a task (``tools/call`` answers
at once with a handle, ``tasks/get`` until ``completed``). The gateway runs in this
process, the fake batch API in a child.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks._procs import child, free_port, percentile
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import McpHttp

POLL_S = 0.05  # how often the bench client polls tasks/get (the gateway suggests 1 s or more)


def config(fake_port: int, store: Path) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "store": {"path": str(store)},
        "providers": {"oai": {"kind": "openai", "base_url": f"http://127.0.0.1:{fake_port}/v1",
                              "api_key": "sk-bench", "batch_poll_interval_s": POLL_S}},
        "routes": {"chat_batch": {"provider": "oai", "operation": "chat", "mode": "batch",
                                  "params": {"model": "gpt-bench"},
                                  "batch": {"max_items": 1000, "max_wait_ms": 20}}},
    }


def message(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"task {i}"}]}


async def _blocking(client: McpHttp, i: int, lat: dict[str, list[float]]) -> None:
    t = time.perf_counter()
    reply = await client.call("chat_batch", message(i))
    lat["blocking"].append(time.perf_counter() - t)
    assert reply["result"]["resultType"] == "complete", reply


async def _task(client: McpHttp, i: int, lat: dict[str, list[float]]) -> None:
    t = time.perf_counter()
    created = (await client.call("chat_batch", message(i)))["result"]
    lat["create"].append(time.perf_counter() - t)
    assert created["resultType"] == "task", created
    while True:
        await anyio.sleep(POLL_S)
        g = time.perf_counter()
        got = (await client.task("tasks/get", created["taskId"]))["result"]
        lat["get"].append(time.perf_counter() - g)
        if got["status"] != "working":
            break
    lat["round_trip"].append(time.perf_counter() - t)
    assert got["status"] == "completed", got
    assert got["result"]["structuredContent"]["choices"][0]["message"]["content"] == f"echo: task {i}"


def batches_created(gw: Gateway) -> int:
    value = gw.metrics.registry.get_sample_value(
        "multiplexer_events_total", {"component": "oai", "event": "batch_submitted"})
    return int(value or 0)


async def _run(gw: Gateway, url: str, n: int, concurrency: int
               ) -> tuple[dict[str, list[float]], dict[str, int]]:
    lat: dict[str, list[float]] = {"blocking": [], "create": [], "get": [], "round_trip": []}
    batches: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=300) as http:
        plain, opted = McpHttp(http, url, None, tasks=False), McpHttp(http, url, None)
        for client, one in ((plain, _blocking), (opted, _task)):
            before = batches_created(gw)
            sem = anyio.Semaphore(concurrency)

            async def guarded(i: int, client: McpHttp = client, one: Any = one,
                              sem: anyio.Semaphore = sem) -> None:
                async with sem:
                    await one(client, i, lat)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(guarded, i)
            batches["blocking" if one is _blocking else "round_trip"] = batches_created(gw) - before
    return lat, batches


def task_rows(n: int, concurrency: int = 20) -> tuple[list[list[object]], dict[str, Any]]:
    """Rows (what, p50 ms, p90 ms, remote batches created) and the raw data."""
    fake_port = free_port()
    with tempfile.TemporaryDirectory() as tmp, child(
            ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port)],
            f"http://127.0.0.1:{fake_port}/v1/models"):

        async def main() -> tuple[dict[str, list[float]], dict[str, int]]:
            async with running(parse_config(config(fake_port, Path(tmp) / "jobs.db"))) as (gw, base):
                return await _run(gw, base + "/mcp", n, concurrency)

        lat, batches = anyio.run(main)
    labels = {"blocking": "blocking tools/call, held open until the batch ends",
              "round_trip": "task: tools/call, then tasks/get until completed",
              "create": "task: tools/call until the CreateTaskResult (stored)",
              "get": "task: one tasks/get"}
    rows: list[list[object]] = [[labels[k], len(v), f"{percentile(v, 0.5) * 1e3:.0f}",
                                 f"{percentile(v, 0.9) * 1e3:.0f}", batches.get(k, "")]
                                for k, v in lat.items()]
    return rows, {"calls": n, "concurrency": concurrency, "poll_s": POLL_S, "batches": batches,
                  "p50_ms": {k: percentile(v, 0.5) * 1e3 for k, v in lat.items()}}
