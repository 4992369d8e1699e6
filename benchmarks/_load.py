"""One load-generating process of the scaling phase (``benchmarks/_scaling.py``).

One Python process of callers tops out near one core's worth of calls, so on a machine with many
cores the phase starts several of these. Each opens its callers' connections and warms them with
one call each, prints ``ready``, waits for a line on stdin (the parent starts them all at once),
sends its share of the calls, and prints ``{"seconds": ..., "cpu_s": ...}``.

    python -m benchmarks._load URL CALLERS CALLS
"""

from __future__ import annotations

import json
import sys
import time

import anyio

from benchmarks._h11 import Conn
from benchmarks._llm_phases import CHAT_PATH
from benchmarks.bench_llm import openai_call, spread, warm


async def main(url: str, callers: int, calls: int) -> None:
    call = openai_call(CHAT_PATH)
    conns = [Conn.to(url) for _ in range(callers)]
    try:
        await warm(conns, call)
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        t, cpu = time.perf_counter(), time.process_time()
        await spread(conns, call, calls)
        print(json.dumps({"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}),
              flush=True)
    finally:
        for conn in conns:
            await conn.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), backend_options={"use_uvloop": True})
