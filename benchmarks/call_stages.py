"""Where one proxied chat call's time goes inside the gateway: the median time between stages.

The gateway runs in this process (on uvloop, as ``multiplexer serve`` does) with probes on the
functions each stage enters; the fake OpenAI API and a lean h11 client run in their own
processes, the client sending sequential ``/v1/chat/completions`` calls. Two configs, one after
the other: everything off, and traces (OTLP to a local receiver) + a key with a budget + priced
spend on (``bench_llm --features-phase``'s). Each probe costs about a microsecond; the stages
show where the gateway's added latency is spent, not its total (``bench_llm`` measures that).

    python -m benchmarks.call_stages [--calls 3000] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from benchmarks._llm_phases import FEATURES_KEY, FEATURES_PRICE, GATEWAY, load_average, otlp_receiver
from benchmarks._procs import child, free_port, save, table

# (stage, module, object, function, async): the first time a call enters each, in this order
PROBES = [
    ("request bytes in", "multiplexer.faces.server_protocol", "GatewayHttpProtocol", "data_received", False),
    ("endpoint", "multiplexer.faces.v1.endpoint", "Endpoint", "__call__", True),
    ("gateway submit", "multiplexer.gateway.gateway", "Gateway", "submit_many", True),
    ("lane express", "multiplexer.core.lane", "Lane", "express", False),  # a lone call: its batch at once
    ("batch dispatched", "multiplexer.core.lane", "Lane", "_dispatch", True),
    ("upstream request", "multiplexer.transport.http1", "Http1Transport", "fetch", True),
    ("upstream reply in", "multiplexer.transport.connection", "Conn", "data_received", False),
    ("outcome settled", "multiplexer.gateway.gateway", "Gateway", "_finish", False),
    ("response written", "multiplexer.faces.server_protocol", "JoinedWrites", "write_now", False),
    ("response written", "multiplexer.faces.server_protocol", "JoinedWrites", "flush", False),
]
# ``--stream``: a streamed call, to its first chunk written (the ASGI path, the lean stream read)
STREAM_PROBES = [
    *PROBES[:5],
    ("upstream request", "multiplexer.transport.http1", "Http1Transport", "open", True),
    ("upstream reply in", "multiplexer.transport.connection", "Conn", "data_received", False),
    ("first chunk to the face", "multiplexer.faces.v1.sse", "_Events", "out", True),
    ("first chunk written", "multiplexer.faces.server_protocol", "JoinedWrites", "flush", False),
]
STAGES = list(dict.fromkeys(stage for stage, *_ in PROBES))
CLIENT = """
import sys, anyio
sys.path.insert(0, sys.argv[2])
from benchmarks.bench_llm import openai_call
from benchmarks._h11 import Conn
async def main():
    call, conn = openai_call("/v1/chat/completions", sys.argv[4] == "stream"), Conn.to(sys.argv[1])
    for _ in range(int(sys.argv[3])):
        await call(conn)
    await conn.aclose()
anyio.run(main)
"""

_stamps: list[tuple[int, int]] = []  # (stage index, ns)


def probe() -> None:
    """Wrap each probed function so that entering it stamps its stage."""
    import importlib

    clock = time.perf_counter_ns
    for stage_name, module, owner, name, is_async in PROBES:
        index = STAGES.index(stage_name)
        target = getattr(importlib.import_module(module), owner)
        inner: Callable[..., Any] = getattr(target, name)

        def wrapped(inner: Callable[..., Any] = inner, index: int = index, is_async: bool = is_async) -> Any:
            if is_async:
                async def stage(*args: Any, **kwargs: Any) -> Any:
                    _stamps.append((index, clock()))
                    return await inner(*args, **kwargs)
            else:
                def stage(*args: Any, **kwargs: Any) -> Any:
                    _stamps.append((index, clock()))
                    return inner(*args, **kwargs)
            return stage

        setattr(target, name, wrapped())


def medians(calls: int) -> dict[str, float]:
    """Median µs from each stage to the next, over the calls that went through every stage."""
    runs: list[dict[int, int]] = []
    for index, at in _stamps:
        if index == 0:
            runs.append({0: at})
        elif runs:
            runs[-1].setdefault(index, at)
    whole = [r for r in runs if len(r) == len(STAGES)]
    if len(whole) < calls // 2:
        raise RuntimeError(f"only {len(whole)} of {len(runs)} calls passed every stage")
    out = {f"{STAGES[i - 1]} -> {STAGES[i]}": statistics.median(r[i] - r[i - 1] for r in whole) / 1e3
           for i in range(1, len(STAGES))}
    out[f"whole (request in -> {STAGES[-1]})"] = statistics.median(r[len(STAGES) - 1] - r[0]
                                                                   for r in whole) / 1e3
    return out


async def measure(config: Path, calls: int, kind: str) -> dict[str, float]:
    from multiplexer.gateway.config import load_config
    from multiplexer.server import running

    async with running(load_config(config), port=0) as (_, url):
        script = config.with_suffix(".client.py")
        script.write_text(CLIENT)
        await anyio.run_process([sys.executable, str(script), url, os.getcwd(), "300", kind])  # warm up
        _stamps.clear()
        await anyio.run_process([sys.executable, str(script), url, os.getcwd(), str(calls), kind])
    return medians(calls)


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    probe()
    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        receiver = stack.enter_context(otlp_receiver())
        stack.enter_context(child(["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                                   "--requests-per-window", "1000000000", "--keepalive-s", "600"],
                                  f"{fake}/"))
        configs = {
            "all off": dict(server="", extra="spend: {enabled: false}\n", price=""),
            "traces + key + budget + spend on": dict(
                server=f", api_keys: {{bench: {FEATURES_KEY}}}",
                extra=f"telemetry: {{otlp_endpoint: '{receiver}'}}\n", price=FEATURES_PRICE),
        }
        out = {}
        for name, parts in configs.items():
            path = Path(tmp) / f"{len(out)}.yaml"
            store = Path(tmp) / f"{len(out)}.db"
            path.write_text(GATEWAY.format(port=0, fake=fake_port, store=store, concurrency=512, **parts))
            out[name] = await measure(path, args.calls, "stream" if args.stream else "whole")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--stream", action="store_true",
                        help="streamed calls, to the first chunk written")
    args = parser.parse_args()
    if args.stream:
        PROBES[:] = STREAM_PROBES
        STAGES[:] = list(dict.fromkeys(stage for stage, *_ in PROBES))
    load = load_average()
    import uvloop

    found = uvloop.run(run(args)) if hasattr(uvloop, "run") else asyncio.run(run(args))
    names = list(found)
    kind = "streamed" if args.stream else "whole"
    print(f"stages of a sequential /v1 chat call ({kind}), {args.calls:,} calls a config, median µs; {load}")
    print(table(["stage", *names, "difference"],
                [[stage, *(f"{found[n][stage]:.1f}" for n in names),
                  f"{found[names[1]][stage] - found[names[0]][stage]:+.1f}"] for stage in found[names[0]]]))
    save("call_stages_stream" if args.stream else "call_stages",
         {"load": load, "calls": args.calls, "stages": found})


if __name__ == "__main__":
    main()
