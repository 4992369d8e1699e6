"""What relaying an upstream's question adds beyond the client's own answer time (issue 54; floor:
at most 2 ms).

The upstream is ``tests/asking_upstream.py``; its tool ``timed`` asks its client one question (an
elicitation form) and returns how long the answer took to come back, as the upstream saw it:
from sending the request to reading its answer (handshake era, a request pushed mid-call), or
from answering ``input_required`` to reading the call that brings the answer (2026-07-28). The
client (the SDK's, over Streamable HTTP) answers at once. Each row times the same question asked
straight (the client calls the upstream, served over HTTP by a child of its own, in the
upstream's era) and relayed (the client calls the gateway, in this process, whose upstream is a
stdio child in that era), in alternating rounds of 20 calls so a busy machine slows both alike;
the figure is the relayed p50 less the straight p50. ``plain`` (a tool that asks nothing) is
timed the same two ways beside it: the gateway's own cost per call, for scale.

    python3 -m benchmarks.bench_mcp_relay            # 200 questions per series
    python3 -m benchmarks.bench_mcp_relay --calls 1000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp import Client

from benchmarks._procs import percentile, table
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import free_port, mcp_http_client, until_connected, wait_listening

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = str(ROOT / "tests" / "asking_upstream.py")
ERAS = {"auto": "2026-07-28", "legacy": "2025-11-25"}
FLOOR_MS = 2.0


async def answer(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
    return types.ElicitResult(action="accept", content={"name": "Ada"})


async def asked(client: Client, tool: str, calls: int) -> list[float]:
    """The upstream's own measure of each question's round trip, in ms."""
    out = []
    for _ in range(calls):
        result = await client.call_tool(tool, {})
        first = result.content[0]
        assert not result.is_error and isinstance(first, types.TextContent), result
        out.append(float(first.text))
    return out


async def plain(client: Client, tool: str, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        began = time.perf_counter()
        await client.call_tool(tool, {"text": "hello"})
        out.append((time.perf_counter() - began) * 1000)
    return out


async def rounds(straight: Client, through: Client, up: str, calls: int) -> dict[str, float]:
    """p50s in ms: the question's round trip and a plain call, straight and through the gateway."""
    series: dict[str, list[float]] = {"straight q": [], "relayed q": [], "straight plain": [],
                                      "gateway plain": []}
    await asked(straight, "timed", 10)
    await asked(through, f"{up}_timed", 10)
    for _ in range(max(calls // 20, 1)):
        series["straight q"] += await asked(straight, "timed", 20)
        series["relayed q"] += await asked(through, f"{up}_timed", 20)
        series["straight plain"] += await plain(straight, "plain", 20)
        series["gateway plain"] += await plain(through, f"{up}_plain", 20)
    return {name: percentile(values, 0.5) for name, values in series.items()}


async def main(calls: int) -> int:
    port = free_port()
    child = subprocess.Popen([sys.executable, UPSTREAM, "--http", "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = {"server": {"host": "127.0.0.1", "port": 0}, "log": {"enabled": False},
              "providers": {up: {"kind": "mcp", "command": sys.executable, "args": [UPSTREAM],
                                 "protocol": mode, "limits": {"concurrency": 8}}
                            for up, mode in (("modern", "auto"), ("legacy", "legacy"))},
              "routes": {"modern_*": {"provider": "modern"}, "legacy_*": {"provider": "legacy"}}}
    rows: list[list[object]] = []
    worst = 0.0
    try:
        await wait_listening(port, child)
        async with running(parse_config(config)) as (gw, url):
            await until_connected(gw, ["modern", "legacy"])
            for up_mode, up in (("auto", "modern"), ("legacy", "legacy")):
                for client_mode in ERAS:
                    async with mcp_http_client(f"http://127.0.0.1:{port}/mcp", up_mode,
                                               elicitation_callback=answer) as straight, \
                            mcp_http_client(url + "/mcp", client_mode,
                                            elicitation_callback=answer) as through:
                        p50 = await rounds(straight, through, up, calls)
                    added = p50["relayed q"] - p50["straight q"]
                    worst = max(worst, added)
                    rows.append([ERAS[client_mode], ERAS[up_mode], f"{p50['straight q']:.2f}",
                                 f"{p50['relayed q']:.2f}", f"{added:+.2f}", f"{p50['straight plain']:.2f}",
                                 f"{p50['gateway plain']:.2f}"])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    print(table(["client", "upstream", "question straight p50 ms", "question relayed p50 ms",
                 "relay adds ms", "plain straight p50 ms", "plain via gateway p50 ms"], rows))
    verdict = "within" if worst <= FLOOR_MS else "OVER"
    print(f"\nworst: a relayed question adds {worst:+.2f} ms ({verdict} the {FLOOR_MS} ms floor)")
    return 0 if worst <= FLOOR_MS else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    sys.exit(anyio.run(main, args.calls))
