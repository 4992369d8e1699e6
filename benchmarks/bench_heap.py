"""Full garbage collections in a serving gateway, with its start-up heap frozen and without.

Each variant runs in its own child process: the shipped default config
(``multiplexer/defaults/default.yaml``: the echo routes, the MCP stdio upstream, the local
embedding model) served by ``multiplexer.server.running`` as ``multiplexer serve``
serves it, with ``server.freeze_heap`` on or off. Once the model has loaded, 64
callers in the same process send embed calls over HTTP; then a full collection
(``gc.collect()``, which the collector also runs on its own as the heap grows) is
timed, each time a pause of the event loop. The table compares the two in the
same run.

    python -m benchmarks.bench_heap
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio

from benchmarks._h11 import Conn
from benchmarks._procs import ROOT, save, table
from multiplexer.defaults import DEFAULT_CONFIG

CALLERS = 64
COLLECTIONS = 5


async def variant(freeze: bool, calls: int) -> dict[str, Any]:
    from multiplexer.gateway.config import load_config
    from multiplexer.server import running

    config = load_config(DEFAULT_CONFIG)
    config.server.freeze_heap = freeze
    body = b'{"jsonrpc":"2.0","method":"embed_local","params":{"input":"a cat sat on the mat"},"id":1}'
    async with running(config, port=0) as (_, url):
        conns = [Conn.to(url, timeout=120) for _ in range(CALLERS)]
        first = await conns[0].request("POST", "/rpc", {"content-type": "application/json"}, body)
        assert b'"result"' in first.body, first.body[:300]  # the model has loaded
        left = iter(range(calls))

        async def caller(conn: Conn) -> None:
            for _ in left:
                reply = await conn.request("POST", "/rpc", {"content-type": "application/json"}, body)
                assert reply.status == 200 and b'"result"' in reply.body

        async with anyio.create_task_group() as tg:
            for conn in conns:
                tg.start_soon(caller, conn)
        pauses = []
        for _ in range(COLLECTIONS):
            start = time.perf_counter()
            gc.collect()
            pauses.append(time.perf_counter() - start)
        walked = len(gc.get_objects())
        for conn in conns:
            await conn.aclose()
    return {"freeze_heap": freeze, "calls": calls, "objects_walked": walked,
            "frozen": gc.get_freeze_count(), "full_collection_ms": statistics.median(pauses) * 1e3,
            "pauses_ms": [p * 1e3 for p in pauses]}


def run_child(freeze: bool, calls: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_heap", "--child", str(int(freeze)),
                          "--calls", str(calls)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--child", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(anyio.run(variant, bool(args.child), args.calls)))
        return
    off, on = run_child(False, args.calls), run_child(True, args.calls)
    rows = [[name, f"{r['objects_walked']:,}", f"{r['frozen']:,}", f"{r['full_collection_ms']:.1f}",
             f"{off['full_collection_ms'] / r['full_collection_ms']:.0f}x"]
            for name, r in (("freeze_heap: false", off), ("freeze_heap: true (default)", on))]
    print(table(["default config, after the calls", "objects a full collection walks", "frozen",
                 "full collection ms (median of 5)", "shorter than without"], rows))
    save("bench_heap", {"off": off, "on": on})


if __name__ == "__main__":
    main()
