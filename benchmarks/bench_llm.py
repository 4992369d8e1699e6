"""The LLM hot path: chat calls through the gateway vs straight to the same fake OpenAI upstream.

Measures, in one run, against the fake OpenAI API (tests/fakes) in its own process and
the gateway (shipped defaults: no limits or batching set) in its own:
- added p50 of one non-streamed chat call, sequential, through ``/rpc`` and through
  ``/v1/chat/completions`` (that row once the ``/v1`` face answers);
- throughput of 64 concurrent clients, as a ratio of calling the upstream directly;
- added time to the first streamed chunk (once the fake and the gateway stream);
- the same for the Responses API (``/v1/responses``), in its own phase against the fake's;
- the same for a LiteLLM proxy on the same upstream, when ``litellm`` (``litellm[proxy]``)
  is on PATH or in $LITELLM_BIN and $LITELLM_MASTER_KEY is set;
- ``--transport``: the lean transport alone against httpx's own pool, in this process;
- the dashboard's cost: added p50 through ``/v1`` with ten dashboard pages open (ten
  ``/ui/api/stream`` subscribers) against none open, in alternating rounds (``--dashboards``).
Clients are lean h11 connections (benchmarks/_h11.py), one per concurrent worker: they cost
little CPU, so on a small machine the gateway's own CPU shows in full. Two more rows measure
it as applications call it: 64 tasks sharing one official ``openai.AsyncOpenAI`` client,
straight to the fake and through ``/v1`` (``--no-sdk`` skips them). ``--upstream-ms`` adds
model time to every answer (0 by default: the gateway's cost at its most visible).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

from benchmarks._h11 import Conn, Reply
from benchmarks._procs import child, free_port, percentile, save, table
from benchmarks._scaling import add_arguments as add_scaling_arguments
from multiplexer.transport.http1 import Http1Transport

MODEL = "gpt-bench"
CONFIG = """
server: {{host: 127.0.0.1, port: {port}, admin_key: {admin}}}
store: {{path: {store}}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench}}
routes:
  chat: {{provider: oai, operation: chat, models: [{model}]}}
"""
# The money phase: the same gateway with a key, its model priced and a budget on the key (every
# call priced, recorded for the spend store and reserved/settled against the budget), and with
# ``spend.enabled: false``; both measured in one phase against direct.
MONEY_CONFIG = """
server: {{host: 127.0.0.1, port: {port}, api_keys: {{bench: {key}}}}}
store: {{path: {store}}}
spend: {{enabled: {enabled}}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench,
        price: {{input_per_mtok: 2.5, output_per_mtok: 10, cached_input_per_mtok: 1.25}}}}
routes:
  chat: {{provider: oai, operation: chat, models: [{model}]}}
"""
MONEY_KEY_ON = '{key: sk-bench, budget_usd: {daily: 1000000, monthly: 10000000}}'
LITELLM_CONFIG = """
model_list:
  - model_name: {model}
    litellm_params: {{model: openai/{model}, api_base: "http://127.0.0.1:{fake}/v1", api_key: sk-bench}}
"""
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
ROUNDS = 4
JSON = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
ADMIN = "bench-admin-key-0123456789"  # the dashboard phase's streams

Call = Callable[[Conn], Awaitable[Reply]]


def posting(path: str, payload: dict[str, Any], headers: dict[str, str] = JSON,
            check: bool = True) -> Call:
    """A call that POSTs ``payload`` to ``path`` and checks the reply carries the echoed text."""
    body = json.dumps(payload).encode()

    async def call(conn: Conn) -> Reply:
        reply = await conn.request("POST", path, headers, body)
        if reply.status != 200 or (check and b"echo: hello there" not in reply.body):
            raise RuntimeError(f"{path}: {reply.status} {reply.body[:200]!r}")
        return reply

    return call


def openai_call(path: str, stream: bool = False, headers: dict[str, str] = JSON) -> Call:
    """Chat, whole (the echoed text checked) or streamed (the text comes a word a chunk)."""
    return posting(path, {**CHAT, "stream": True} if stream else CHAT, headers, check=not stream)


RESPONSE = {"model": MODEL, "input": "hello there"}


def responses_call(stream: bool = False) -> Call:
    """``POST /v1/responses``: the reply's text checked (streamed: in its ``done`` events)."""
    return posting("/v1/responses", {**RESPONSE, "stream": True} if stream else RESPONSE)


def rpc_call() -> Call:
    return posting("/rpc", {"jsonrpc": "2.0", "method": "chat", "params": CHAT, "id": 1})


@dataclass
class Target:
    """One way to the same upstream: its name, base URL, call, and streamed call (if any)."""

    name: str
    url: str
    call: Call
    stream: Call | None = None
    pid: int | None = None  # the proxy in the way (gateway, LiteLLM): its CPU is measured


async def latencies(paths: list[Target], n: int, first_chunk: bool = False,
                    shuffled: bool = False) -> list[list[float]]:
    """Sequential calls, one path after the other in every round, each on its own kept-alive
    connection, so a busy moment on a shared machine hits every path alike; seconds to the
    whole reply (or to the first chunk of a stream). ``shuffled``: each round in its own order,
    so no path always follows the same one (a place in the round is worth up to ~20 µs)."""
    calls = [p.stream if first_chunk else p.call for p in paths]
    conns = [Conn.to(p.url) for p in paths]
    out: list[list[float]] = [[] for _ in paths]
    try:
        for _ in range(max(20, n // 10)):
            for conn, call in zip(conns, calls, strict=True):
                await call(conn)  # type: ignore[misc]
        order = list(enumerate(zip(conns, calls, strict=True)))
        shuffle = random.Random(1).shuffle if shuffled else (lambda _: None)
        for _ in range(n):
            shuffle(order)
            for i, (conn, call) in order:
                t = time.perf_counter()
                reply = await call(conn)  # type: ignore[misc]
                out[i].append((reply.first_data_at if first_chunk else time.perf_counter()) - t)
    finally:
        for conn in conns:
            await conn.aclose()
    return out


async def warm(conns: list[Conn], call: Call) -> None:
    """One call on every connection at once, so each is open before anything is timed."""
    async with anyio.create_task_group() as tg:
        for conn in conns:
            tg.start_soon(call, conn)


async def spread(conns: list[Conn], call: Call, n: int) -> None:
    """``n`` calls by one worker per connection, each taking the next call until none is left."""
    left = n

    async def worker(conn: Conn) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call(conn)

    async with anyio.create_task_group() as tg:
        for conn in conns:
            tg.start_soon(worker, conn)


async def throughput(url: str, call: Call, clients: int, n: int) -> float:
    """Seconds for ``n`` calls by ``clients`` workers, each on its own (warmed) connection."""
    conns = [Conn.to(url) for _ in range(clients)]
    try:
        await warm(conns, call)
        t = time.perf_counter()
        await spread(conns, call, n)
        return time.perf_counter() - t
    finally:
        for conn in conns:
            await conn.aclose()


async def sdk_throughput(base_url: str, clients: int, n: int, pid: int | None) -> tuple[float, float]:
    """Seconds and proxy CPU seconds for ``n`` chat calls by ``clients`` tasks sharing one
    official ``openai.AsyncOpenAI`` client: how an application calls an OpenAI endpoint."""
    from openai import AsyncOpenAI

    left = n
    async with AsyncOpenAI(base_url=base_url, api_key="sk-bench", max_retries=0) as client:
        async def call() -> None:
            reply = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"])
            if reply.choices[0].message.content != "echo: hello there":
                raise RuntimeError(f"{base_url}: {reply}")

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await call()

        async with anyio.create_task_group() as tg:  # warm the pool's connections
            for _ in range(clients):
                tg.start_soon(call)
        before, t = cpu_seconds(pid), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(worker)
        return time.perf_counter() - t, cpu_seconds(pid) - before


async def measure_sdk(fake: str, gateway: str, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Direct and through /v1 with the OpenAI SDK as the client, rounds alternating."""
    paths = [("direct (OpenAI SDK client)", fake, None), ("gateway /v1 (OpenAI SDK client)", gateway, pid)]
    elapsed, cpu = [0.0, 0.0], [0.0, 0.0]
    per_round = args.calls // ROUNDS
    for _ in range(ROUNDS):
        for i, (_, url, proxy) in enumerate(paths):
            e, c = await sdk_throughput(f"{url}/v1", args.clients, per_round, proxy)
            elapsed[i] += e
            cpu[i] += c
    n = per_round * ROUNDS
    out = [{"name": name, "calls_per_s": n / e, "proxy_cpu_ms_per_call": c / n * 1e3 if proxy else None}
           for (name, _, proxy), e, c in zip(paths, elapsed, cpu, strict=True)]
    out[1]["ratio"] = out[1]["calls_per_s"] / out[0]["calls_per_s"]
    return out


async def answers(url: str, call: Call) -> bool:
    conn = Conn.to(url)
    try:
        await call(conn)
        return True
    except RuntimeError:
        return False
    finally:
        await conn.aclose()


async def streams(url: str, path: str, headers: dict[str, str] = JSON) -> bool:
    conn = Conn.to(url)
    try:
        reply = await conn.request("POST", path, headers, json.dumps({**CHAT, "stream": True}).encode())
        return reply.status == 200 and reply.content_type.startswith("text/event-stream")
    finally:
        await conn.aclose()


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process and its children (0 for none)."""
    if pid is None:
        return 0.0
    proc = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


def litellm_program() -> str | None:
    if not os.environ.get("LITELLM_MASTER_KEY"):
        return None
    return os.environ.get("LITELLM_BIN") or shutil.which("litellm")


async def measure(paths: list[Target], args: argparse.Namespace,
                  shuffled: bool = True) -> list[dict[str, Any]]:
    seq = await latencies(paths, args.sequential, shuffled=shuffled)
    elapsed, cpu = [0.0] * len(paths), [0.0] * len(paths)
    n = args.calls // ROUNDS * ROUNDS
    for _ in range(ROUNDS):  # alternate the paths in rounds, for the same reason
        for i, p in enumerate(paths):
            before = cpu_seconds(p.pid)
            elapsed[i] += await throughput(p.url, p.call, args.clients, args.calls // ROUNDS)
            cpu[i] += cpu_seconds(p.pid) - before
    out = [{"name": p.name, "p50_ms": percentile(s, 0.5) * 1e3, "p99_ms": percentile(s, 0.99) * 1e3,
            "calls_per_s": n / e, "proxy_cpu_ms_per_call": c / n * 1e3 if p.pid else None}
           for p, s, e, c in zip(paths, seq, elapsed, cpu, strict=True)]
    streamed = [i for i, p in enumerate(paths) if p.stream is not None]
    if paths[0].stream is not None:
        firsts = await latencies([paths[i] for i in streamed], args.sequential, first_chunk=True,
                                 shuffled=shuffled)
        for i, first in zip(streamed, firsts, strict=True):
            out[i]["first_chunk_p50_ms"] = percentile(first, 0.5) * 1e3
    return out


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.only_money:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            return await money_phase(stack, tmp, args)
    fake_port, gw_port = free_port(), free_port()
    fake, gw = f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{gw_port}"
    fake_args = ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                 "--latency-ms", str(args.upstream_ms), "--requests-per-window", "1000000000"]
    chat = "/v1/chat/completions"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        conf = Path(tmp) / "gateway.yaml"
        conf.write_text(CONFIG.format(port=gw_port, fake=fake_port, store=Path(tmp) / "jobs.db",
                                      model=MODEL, admin=ADMIN))
        stack.enter_context(child(fake_args, f"{fake}/"))
        gateway = stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf)],
                                            f"{gw}/healthz"))
        streaming = await streams(fake, chat)
        paths = [Target("direct", fake, openai_call(chat), openai_call(chat, True) if streaming else None),
                 Target("gateway /rpc", gw, rpc_call(), pid=gateway.pid)]
        if await answers(gw, openai_call(chat)):
            paths.append(Target("gateway /v1", gw, openai_call(chat), openai_call(chat, True)
                                if streaming and await streams(gw, chat) else None, gateway.pid))
        else:
            print("(no /v1 row: the gateway does not serve /v1/chat/completions yet)")
        if args.dashboard_only:
            return await dashboard_phase(paths[0], paths[2], args) if len(paths) > 2 else []
        results = compared(await measure(paths, args))
        if args.sdk and len(paths) > 2:
            results += await measure_sdk(fake, gw, gateway.pid, args)
        if await answers(gw, responses_call()):  # the Responses API, its own phase against direct
            phase = [Target("direct /v1/responses", fake, responses_call(), responses_call(True)),
                     Target("gateway /v1/responses", gw, responses_call(), responses_call(True),
                            gateway.pid)]
            results += compared(await measure(phase, args))
        if args.dashboards and len(paths) > 2:
            results += await dashboard_phase(paths[0], paths[2], args)
        if args.money:
            results += await money_phase(stack, tmp, args)
        program = litellm_program()
        if program is None:
            print("(no LiteLLM row: needs litellm on PATH or $LITELLM_BIN, and $LITELLM_MASTER_KEY)")
        else:
            # its own phase, against direct again: its background work would slow the others
            proxy = litellm(stack, program, fake_port, tmp, streaming)
            again = compared(await measure([paths[0], proxy], args))
            again[0]["name"] = "direct (LiteLLM phase)"
            results += again
    return results


async def dashboard_phase(direct: Target, gateway: Target, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Added p50 through the gateway with ``args.dashboards`` pages open (each a /ui/api/stream
    subscriber, reading every snapshot) against none open: rounds alternate the two states, each
    round measures direct and the gateway call by call, as ``latencies`` does."""
    seq: dict[bool, list[list[float]]] = {False: [[], []], True: [[], []]}
    cpu, wall, calls = {False: 0.0, True: 0.0}, {False: 0.0, True: 0.0}, {False: 0, True: 0}
    frames = 0
    rounds = 4 * ROUNDS  # short rounds: a shared host's drift hits both states alike
    per_round = max(50, args.sequential // rounds)

    async def page(http: httpx.AsyncClient, opened: anyio.Event) -> None:
        nonlocal frames
        async with http.stream("GET", "/ui/api/stream", headers={"authorization": f"Bearer {ADMIN}"}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    frames += 1
                    opened.set()

    async with httpx.AsyncClient(base_url=gateway.url, timeout=None,
                                 limits=httpx.Limits(max_connections=args.dashboards + 1)) as http:
        t = time.perf_counter()
        await http.get("/ui/api/state", headers={"authorization": f"Bearer {ADMIN}"})
        snapshot_ms = (time.perf_counter() - t) * 1e3
        for _ in range(rounds):
            for watched in (False, True):
                async with anyio.create_task_group() as tg:
                    if watched:
                        for _ in range(args.dashboards):
                            opened = anyio.Event()
                            tg.start_soon(page, http, opened)
                            await opened.wait()
                    cpu_before, t = cpu_seconds(gateway.pid), time.perf_counter()
                    d, g = await latencies([direct, gateway], per_round)
                    cpu[watched] += cpu_seconds(gateway.pid) - cpu_before
                    wall[watched] += time.perf_counter() - t
                    calls[watched] += len(g)
                    seq[watched][0] += d
                    seq[watched][1] += g
                    tg.cancel_scope.cancel()
    out = []
    for watched in (False, True):
        d, g = seq[watched]
        name = f"gateway /v1, {args.dashboards} dashboards open" if watched else "gateway /v1, no dashboard"
        out.append({"name": name, "p50_ms": percentile(g, 0.5) * 1e3, "p99_ms": percentile(g, 0.99) * 1e3,
                    "added_p50_ms": (percentile(g, 0.5) - percentile(d, 0.5)) * 1e3,
                    "direct_p50_ms": percentile(d, 0.5) * 1e3, "calls_per_s": None,
                    "proxy_cpu_ms_per_call": cpu[watched] / calls[watched] * 1e3,
                    "gateway_cpu_share": cpu[watched] / wall[watched]})
    out[1]["dashboard_added_p50_ms"] = out[1]["added_p50_ms"] - out[0]["added_p50_ms"]
    out[1]["dashboard_frames"] = frames
    out[0]["snapshot_ms"] = snapshot_ms
    print(f"dashboard phase: {frames} snapshots read by {args.dashboards} pages; one /ui/api/state "
          f"took {snapshot_ms:.1f} ms; added p50 with {args.dashboards} pages open vs none: "
          f"{out[1]['dashboard_added_p50_ms']:+.3f} ms (floor: +0.05 ms); gateway CPU "
          f"{out[0]['gateway_cpu_share']:.1%} of a core with none open, "
          f"{out[1]['gateway_cpu_share']:.1%} with {args.dashboards}")
    return out


async def money_phase(stack: contextlib.ExitStack, tmp: str,
                      args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prices, spend and budgets off and on against direct, on an upstream of their own (the
    earlier phases' gateway keeps its connections to theirs). Two gateway processes of each, the
    paths in a new order every round: two processes of one config differ by up to ~25 µs of p50
    (where each lands, its place in the round), as large as what is measured; the A/A rows show
    that spread in the same run, and on vs off compares the pairs' means."""
    chat = "/v1/chat/completions"
    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    stack.enter_context(child(["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                               "--latency-ms", str(args.upstream_ms), "--requests-per-window", "1000000000"],
                              f"{fake}/"))
    targets = [Target("direct", fake, openai_call(chat))]
    for name, enabled, key in (("gateway /v1, money off", "false", "sk-bench"),
                               ("gateway /v1, money on", "true", MONEY_KEY_ON)):
        for copy in (1, 2):
            port = free_port()
            conf = Path(tmp) / f"money-{enabled}-{copy}.yaml"
            conf.write_text(MONEY_CONFIG.format(port=port, fake=fake_port, model=MODEL, enabled=enabled,
                                                store=Path(tmp) / f"m-{enabled}-{copy}.db", key=key))
            proc = stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf)],
                                             f"http://127.0.0.1:{port}/healthz"))
            targets.append(Target(f"{name} ({copy})", f"http://127.0.0.1:{port}", openai_call(chat),
                                  None, proc.pid))
    rows = compared(await measure(targets, args))
    rows[0]["name"] = "direct (money phase)"
    off, on = (rows[1]["p50_ms"] + rows[2]["p50_ms"]) / 2, (rows[3]["p50_ms"] + rows[4]["p50_ms"]) / 2
    rows[3]["money_added_p50_ms"] = on - off
    rows[3]["money_aa_ms"] = (abs(rows[2]["p50_ms"] - rows[1]["p50_ms"]),
                              abs(rows[4]["p50_ms"] - rows[3]["p50_ms"]))
    return rows


def compared(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row against the first (direct) of its phase."""
    direct = results[0]
    for r in results[1:]:
        r["added_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
        r["ratio"] = r["calls_per_s"] / direct["calls_per_s"]
        if "first_chunk_p50_ms" in r and "first_chunk_p50_ms" in direct:
            r["added_first_chunk_ms"] = r["first_chunk_p50_ms"] - direct["first_chunk_p50_ms"]
    return results


def litellm(stack: contextlib.ExitStack, program: str, fake_port: int, tmp: str,
            streaming: bool) -> Target:
    """A LiteLLM proxy (one worker) on the same upstream, up until ``stack`` closes."""
    port = free_port()
    conf = Path(tmp) / "litellm.yaml"
    conf.write_text(LITELLM_CONFIG.format(fake=fake_port, model=MODEL))
    headers = {**JSON, "authorization": f"Bearer {os.environ['LITELLM_MASTER_KEY']}"}
    url = f"http://127.0.0.1:{port}"
    proxy = stack.enter_context(child(["--config", str(conf), "--port", str(port),
                                       "--num_workers", "1"], f"{url}/health/liveliness",
                                      program=program))
    chat = "/v1/chat/completions"
    return Target("LiteLLM proxy", url, openai_call(chat, headers=headers),
                 openai_call(chat, True, headers) if streaming else None, proxy.pid)


async def run_transports(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The transport alone: one process, the same client code, Http1Transport vs httpx's pool."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    out = []
    with child(["-m", "tests.fakes.serve", "openai", "--port", str(port),
                "--latency-ms", str(args.upstream_ms), "--requests-per-window", "1000000000"],
               f"http://127.0.0.1:{port}/"):
        for name, transport in (("httpx pool", None), ("lean transport (httptools)", Http1Transport(256))):
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(transport=transport, limits=limits, headers=JSON) as http:
                async def call(_: Any = None, http: httpx.AsyncClient = http) -> None:
                    r = await http.post(url, json=CHAT)
                    assert r.status_code == 200, r.text

                for _ in range(50):
                    await call()
                seq = []
                for _ in range(args.sequential):
                    t = time.perf_counter()
                    await call()
                    seq.append(time.perf_counter() - t)
                left = args.calls

                async def worker() -> None:
                    nonlocal left
                    while left > 0:
                        left -= 1
                        await call()

                t = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for _ in range(args.clients):
                        tg.start_soon(worker)
                out.append({"name": name, "p50_ms": percentile(seq, 0.5) * 1e3,
                            "calls_per_s": args.calls / (time.perf_counter() - t)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequential", type=int, default=300)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--upstream-ms", type=float, default=0.0,
                        help="model time the fake adds to every answer")
    parser.add_argument("--no-sdk", dest="sdk", action="store_false",
                        help="skip the rows with the official OpenAI SDK as the client")
    parser.add_argument("--dashboards", type=int, default=10,
                        help="dashboard pages (stream subscribers) open in the dashboard phase (0: skip it)")
    parser.add_argument("--dashboard-only", action="store_true",
                        help="only the dashboard phase")
    parser.add_argument("--no-money", dest="money", action="store_false",
                        help="skip the phase with prices, spend and budgets off vs on")
    parser.add_argument("--only-money", action="store_true", help="only the money phase")
    parser.add_argument("--transport", action="store_true",
                        help="also the lean transport alone vs httpx's pool")
    parser.add_argument("--workers-phase", action="store_true",
                        help="also: upstream +50 ms, 256 callers, --workers 1 vs auto vs direct")
    parser.add_argument("--workers-calls", type=int, default=12_000)
    parser.add_argument("--features-phase", action="store_true",
                        help="also: traces and an API key on vs all off, sequential")
    parser.add_argument("--features-calls", type=int, default=2000)
    add_scaling_arguments(parser)
    parser.add_argument("--only-phases", action="store_true",
                        help="run only the phases asked for, not the main comparison")
    args = parser.parse_args()
    if args.only_phases:
        phases(args, {"args": vars(args)})
        return
    results = anyio.run(run, args)
    rows = []
    for r in results:
        first = r.get("first_chunk_p50_ms")
        rows.append([
            r["name"], f"{r['p50_ms']:.3f}" if "p50_ms" in r else "",
            f"{r['added_p50_ms']:+.3f}" if "added_p50_ms" in r else "",
            "" if r["calls_per_s"] is None else f"{r['calls_per_s']:,.0f}",
            f"{r['ratio']:.2f}x" if "ratio" in r else "" if r["calls_per_s"] is None else "1.00x",
            "" if first is None else f"{first:.3f}",
            f"{r['added_first_chunk_ms']:+.3f}" if "added_first_chunk_ms" in r else "",
            "" if r["proxy_cpu_ms_per_call"] is None else f"{r['proxy_cpu_ms_per_call']:.3f}",
        ])
    print(f"chat calls, fake upstream +{args.upstream_ms:g} ms; {args.sequential} sequential, "
          f"{args.calls:,} by {args.clients} concurrent clients")
    print(table(["path", "p50 (ms)", "added p50 (ms)", f"{args.clients} clients calls/s",
                 "vs direct", "first chunk p50 (ms)", "added first chunk (ms)",
                 "proxy CPU ms/call"], rows))
    print("floors: added p50 < 1 ms (/rpc, /v1); throughput >= 0.9x direct; added first chunk < 2 ms")
    money = [r for r in results if "money_added_p50_ms" in r]
    if money:
        aa = money[0]["money_aa_ms"]
        print(f"money on vs off (same run, the means of two gateways each): added p50 "
              f"{money[0]['money_added_p50_ms']:+.3f} ms (floor: +0.05 ms); two gateways of one "
              f"config (A/A) differed by {aa[0]:.3f} ms (off) and {aa[1]:.3f} ms (on)")
    saved: dict[str, Any] = {"args": vars(args), "results": results}
    if args.transport:
        transports = anyio.run(run_transports, args)
        base = transports[0]
        print(table(["transport (in-process client)", "p50 (ms)", f"{args.clients} concurrent calls/s",
                     "vs httpx"],
                    [[t["name"], f"{t['p50_ms']:.3f}", f"{t['calls_per_s']:,.0f}",
                      f"{t['calls_per_s'] / base['calls_per_s']:.2f}x"] for t in transports]))
        saved["transports"] = transports
    phases(args, saved)


def phases(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    """The workers, scaling and features phases (benchmarks/_llm_phases.py, _scaling.py), then the
    saved results."""
    from benchmarks._llm_phases import print_features, print_workers, run_features, run_workers
    from benchmarks._scaling import print_scaling, run_scaling

    if args.workers_phase:
        saved["workers"] = anyio.run(run_workers, args)
        print_workers(saved["workers"], args.workers_calls // 3 * 3)
    if args.scaling_phase:
        saved["scaling"] = run_scaling(args)
        print_scaling(saved["scaling"])
    if args.features_phase:
        saved["features"] = anyio.run(run_features, args)
        print_features(saved["features"], args.features_calls)
    save("bench_llm", saved)


if __name__ == "__main__":
    main()
