"""Streams by the thousand: N concurrent SSE chat streams through the gateway and straight to the
same fake upstream, in one run.

The fake (``benchmarks/_stream_fake.py``, its own process) answers every chat call with 40
chunks 50 ms apart (20 chunks/s), a usage chunk and ``[DONE]``, as OpenAI streams them. The
client holds N streams open at once, N workers each on its own keep-alive connection, arriving
one of two ways (``--arrival``, both by default):

- ``burst``: the workers' first streams start at random over one stream's length (2 s), and
  each runs ``--rounds`` streams back to back, so N stay open while calls keep arriving: at
  1,000, 500 streams a second start, each setup in the queue of the others' (what the first
  runs measured);
- ``ramp``: the workers start evenly spread over ``--ramp-k`` chunk periods (100: 5 s), one
  stream each of 40 + k chunks (so the first is still open when the last starts, and all N
  are open at once for 40 chunk periods): each stream arrives while the others
  stream, one setup at a time, as a gateway's traffic arrives; its added first-chunk latency is
  what one stream pays for the others' chunks, not a queue of setups.

Per arrival, target and N the table gives

- max open upstream: the most streams the fake saw open at once (the gateway's lane and
  pool caps show here);
- whole streams: streams that came back 200 with every chunk and ``[DONE]``;
- added first-chunk p99 and added gap p99: the p99 of the time from a request's last byte to
  its first event, and of the time between events as the client reads them, over the direct
  p99 of the same N in the same run;
- CPU per chunk: the gateway's CPU time (its workers' with ``--workers``) over the chunks it
  relayed; then the same streams run again with 2 chunks each, and the difference splits it
  into the relay's CPU per chunk and what a stream costs beyond its chunks (its request,
  admission, upstream request, pricing: "setup per stream");
- RSS per stream: the gateway's peak RSS during the run over its RSS at rest (a fresh gateway
  per N, after a warm-up), per stream.

The baseline (``--baseline REV``, a git worktree in a temporary folder, removed after) runs the
same way in the same run; ``--baseline ''`` skips it. ``--big`` adds 2,000 streams and 10,000
with ``serve --workers auto``. The soft limit on open files is raised to the hard one.

    python -m benchmarks.bench_streams [--baseline 4e15b15] [--this HEAD] [--streams 64,256,1000]
        [--arrival burst,ramp] [--ramp-k 100] [--big]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks._procs import ROOT, free_port, logged_child, percentile, save, table

CHUNKS = 40
CONFIG = """
server: {{host: 127.0.0.1, port: {port}, admin_key: bench-admin-key-0123456789}}
store: {{path: {store}}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench,
        price: {{input_per_mtok: 2.5, output_per_mtok: 10}}}}
routes:
  chat: {{provider: oai, operation: chat, models: [gpt-bench]}}
"""
SERVE = "import sys; sys.path.insert(0, {tree!r}); from multiplexer.cli import main; sys.exit(main())"
HEADS = ["streams", "arrival", "target", "max open upstream", "whole streams",
         "added first-chunk p99 ms (direct: p99)", "added gap p99 ms (direct: p99)",
         "CPU us/chunk", "relay us/chunk", "setup us/stream", "RSS KB/stream",
         "cores: target / client+fake", "load avg 1m"]
SHORT = 2  # the chunks of the streams that measure what a stream costs beyond its chunks


def request(path: str, port: int, chunks: int) -> bytes:
    """A streamed chat call; ``max_tokens`` tells the fake how many chunks to send."""
    body = json.dumps({"model": "gpt-bench", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": chunks}).encode()
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer sk-bench\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), port, len(body), body))


@dataclass
class Runs:
    """What the client saw over every stream of one run."""

    firsts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    whole: int = 0
    streams: int = 0
    events: int = 0
    errors: list[str] = field(default_factory=list)


class Stream(asyncio.Protocol):
    """One keep-alive connection running streams back to back; it reads only what it counts:
    events (blank lines), the status line and the end of the chunked body."""

    def __init__(self, req: bytes, events: int, rounds: int, runs: Runs,
                 done: asyncio.Future[None]) -> None:
        self.req = req
        self.events = events
        self.rounds = rounds
        self.runs = runs
        self.done = done
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.start()

    def start(self) -> None:
        assert self.transport is not None
        self.tail = b""
        self.head = True
        self.times: list[float] = []
        self.rounds -= 1
        self.runs.streams += 1
        self.transport.write(self.req)
        self.sent = time.monotonic()

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if self.head:
            if not data.startswith(b"HTTP/1.1 200"):
                self.fail(data[:200].decode("latin-1", "replace"))
                return
            self.head = False
        seen = (self.tail[-1:] + data).count(b"\n\n")
        if seen:
            self.times.extend([now] * seen)
        self.tail = (self.tail + data)[-32:]
        if self.tail.endswith(b"0\r\n\r\n"):
            self.ended()

    def ended(self) -> None:
        runs, times = self.runs, self.times
        runs.events += len(times)
        if times:
            runs.firsts.append(times[0] - self.sent)
            runs.gaps.extend(b - a for a, b in itertools.pairwise(times))
        if len(times) == self.events and b"data: [DONE]" in self.tail:
            runs.whole += 1
        else:
            runs.errors.append(f"{len(times)} events, ending {self.tail!r}")
        if self.rounds > 0:
            self.start()
        else:
            self.finish()

    def fail(self, why: str) -> None:
        self.runs.errors.append(why)
        self.finish()

    def finish(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.runs.errors.append(f"connection lost: {exc}")
            self.done.set_result(None)


async def run_streams(port: int, path: str, n: int, rounds: int, spread: float,
                      chunks: int = CHUNKS, even: bool = False) -> Runs:
    """N workers, started at random over ``spread`` seconds (``even``: ``spread / n`` apart)."""
    loop = asyncio.get_running_loop()
    runs = Runs()
    req = request(path, port, chunks)

    async def worker(delay: float) -> None:
        await asyncio.sleep(delay)
        done: asyncio.Future[None] = loop.create_future()
        try:
            await loop.create_connection(lambda: Stream(req, chunks + 2, rounds, runs, done),
                                         "127.0.0.1", port)
        except OSError as e:
            runs.errors.append(f"connect: {e}")
            return
        await done

    await asyncio.gather(*(worker(i * spread / n if even else random.uniform(0, spread))
                           for i in range(n)))
    return runs


def p99(values: list[float]) -> float:
    return percentile(values, 0.99) if values else float("nan")


@dataclass
class Gateway:
    url: str
    port: int
    proc: psutil.Process

    def procs(self) -> list[psutil.Process]:
        return [self.proc, *self.proc.children(recursive=True)]

    def cpu(self) -> float:
        return cpu_of(self.procs())

    def rss(self) -> int:
        total = 0
        for p in self.procs():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total


@contextlib.contextmanager
def bare_relay(fake: int, tmp: Path) -> Iterator[Gateway]:
    """The pass-through relay (``benchmarks/_bare_relay.py``): the host's own cost of the hop."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with logged_child(["-m", "benchmarks._bare_relay", str(port), str(fake)], f"{url}/",
                      tmp / f"bare-{port}.log") as proc:
        yield Gateway(url, port, psutil.Process(proc.pid))


@contextlib.contextmanager
def gateway(tree: Path, fake: int, tmp: Path, workers: str | None) -> Iterator[Gateway]:
    port = free_port()
    conf = tmp / f"gw-{port}.yaml"
    conf.write_text(CONFIG.format(port=port, fake=fake, store=tmp / f"{port}.db"))
    args = ["-c", SERVE.format(tree=str(tree)), "serve", "--config", str(conf)]
    if workers:
        args += ["--workers", workers]
    url = f"http://127.0.0.1:{port}"
    with logged_child(args, f"{url}/healthz", tmp / f"gw-{port}.log") as proc:
        time.sleep(0.5 if workers else 0)  # every worker up, not only the first to answer
        yield Gateway(url, port, psutil.Process(proc.pid))


class Peak:
    """The largest of a value sampled on a thread."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.read())

    def __enter__(self) -> Peak:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def fake_stats(fake: int, reset: bool = False) -> dict[str, int]:
    url = f"http://127.0.0.1:{fake}"
    if reset:
        httpx.post(f"{url}/reset", timeout=5)
    return httpx.get(f"{url}/stats", timeout=5).json()


@dataclass
class Arrival:
    """How a run's N streams arrive: over how long, how many each worker runs, how long each is."""

    spread: float
    rounds: int
    chunks: int
    even: bool


def arrival(name: str, args: argparse.Namespace) -> Arrival:
    gap = args.gap_ms / 1000
    if name == "ramp":
        return Arrival(args.ramp_k * gap, 1, CHUNKS + args.ramp_k, True)
    return Arrival(CHUNKS * gap, args.rounds, CHUNKS, False)


def cpu_of(procs: list[psutil.Process]) -> float:
    """The CPU seconds these processes have spent (those gone count nothing)."""
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


class Others:
    """The wall time since it was made and the cores the host's other parts spent in it: this
    process (the client) and the fake's processes."""

    def __init__(self, fakes: list[psutil.Process]) -> None:
        self.fakes = fakes
        self.wall, self.own, self.other = time.monotonic(), time.process_time(), cpu_of(fakes)

    def since(self) -> tuple[float, float]:
        """(wall seconds, the others' cores over them)."""
        wall = time.monotonic() - self.wall
        return wall, (time.process_time() - self.own + cpu_of(self.fakes) - self.other) / wall


def measure(port: int, fake: int, n: int, args: argparse.Namespace,
            gw: Gateway | None, how: Arrival, fakes: list[psutil.Process]) -> tuple[Runs, dict[str, float]]:
    """One run of N streams; with the CPU the host's other two parts (this process's client
    and the fake) spent, in cores: on two cores their share is what the target cannot have."""
    path = "/v1/chat/completions"
    spread, rounds, chunks, even = how.spread, how.rounds, how.chunks, how.even
    if gw is None:
        fake_stats(fake, reset=True)
        others = Others(fakes)
        runs = asyncio.run(run_streams(port, path, n, rounds, spread, chunks, even))
        return runs, {"max_open": fake_stats(fake)["max_open"], "others_cores": others.since()[1]}
    asyncio.run(run_streams(port, path, 8, 1, 0.05))  # warm-up: imports, pools, the first stream
    time.sleep(0.3)
    idle = gw.rss()
    fake_stats(fake, reset=True)
    cpu = gw.cpu()
    share = Others(fakes)
    with Peak(gw.rss) as peak:
        runs = asyncio.run(run_streams(port, path, n, rounds, spread, chunks, even))
    cpu = gw.cpu() - cpu
    wall, others = share.since()
    max_open = fake_stats(fake)["max_open"]
    time.sleep(0.3)
    short_cpu = gw.cpu()  # the same streams, SHORT chunks each: what a stream costs beyond them
    short = asyncio.run(run_streams(port, path, n, rounds, spread, SHORT, even))
    short_cpu = gw.cpu() - short_cpu
    relay = (cpu - short_cpu) / max(runs.events - short.events, 1)
    extra = {"max_open": max_open,
             "cpu_us_per_chunk": cpu * 1e6 / max(runs.events, 1),
             "relay_us_per_chunk": relay * 1e6,
             "setup_us_per_stream": (short_cpu - relay * short.events) * 1e6 / max(short.streams, 1),
             "rss_kb_per_stream": max(peak.peak - idle, 0) / 1024 / n,
             "target_cores": cpu / wall, "others_cores": others}
    return runs, extra


def relay_work(n: int = 20000) -> tuple[float, float]:
    """The relay's own Python work per chunk, in this process (no sockets, no event loop
    wake-ups, so little noise): the bytes split into events, ``passes`` and the chunk framed as
    the server writes it, against the way before (httpx_sse's decoders over text, the JSON
    parsed, ``stream_event``, encoded again). CPU microseconds a chunk, (before, now)."""
    import codecs

    from httpx_sse._decoders import SSEDecoder, SSELineDecoder

    from benchmarks._stream_fake import CHUNK
    from multiplexer.core.call import Item
    from multiplexer.core.json_codec import loads_lenient
    from multiplexer.faces.v1.endpoint import data_event
    from providers.openai import OpenAIProvider
    from providers.sse_relay import events

    chunks = [b"data: " + (CHUNK % i) + b"\n\n" for i in range(n)]
    item = Item(route="chat", method="chat", params={}, operation="chat")
    provider = OpenAIProvider.__new__(OpenAIProvider)
    out: list[bytes] = []

    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def now() -> None:
        async for e in events(source()):
            if e.form == "data" and e.data[:1] == b"{" and e.data[-1:] == b"}" \
                    and provider.passes(item, e):
                out.append(b"%x\r\n%b\r\n" % (len(e.wire), e.wire))

    async def before() -> None:
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        lines, decoder, usage = SSELineDecoder(), SSEDecoder(), {}
        async for chunk in source():
            for line in lines.decode(text.decode(chunk)):
                sse = decoder.decode(line.rstrip("\n"))
                if sse is not None:
                    data = loads_lenient(sse.data)
                    if provider.stream_event(item, sse.event, data, usage):
                        event = data_event(data)
                        out.append(b"%x\r\n%b\r\n" % (len(event), event))

    best = {before: float("inf"), now: float("inf")}
    for _ in range(3):
        for run in (before, now):
            out.clear()
            start = time.process_time()
            asyncio.run(run())
            best[run] = min(best[run], (time.process_time() - start) / n * 1e6)
            assert len(out) == n
    return best[before], best[now]


def path_work(n: int = 20000) -> float:
    """The Python work of a chunk's whole way through this tree's gateway, in this process: the
    upstream connection's read callback (``Conn.data_received``: httptools, the relay, the
    split, ``passes``) to the server's chunked write, into transports that only count (no
    syscall, no loop wake-up, every object warm in the caches). What a relayed chunk costs
    beyond it at N streams is the sockets, the loop and the caches: the bare relay's row and
    the difference. CPU microseconds a chunk, the best of five rounds."""
    from types import SimpleNamespace

    import uvloop

    from benchmarks._stream_fake import CHUNK, HEAD, framed
    from multiplexer.core.call import Item
    from multiplexer.core.sink import ChunkSink
    from multiplexer.faces.server_protocol import JoinedWrites, _chunk_writer
    from multiplexer.faces.v1.sse import _Events
    from multiplexer.transport.connection import Conn
    from providers.openai import OpenAIProvider
    from providers.sse_relay import DATA, Relay, Splitter

    class Counting:
        writes = 0

        def write(self, data: bytes) -> None:
            self.writes += 1

        def is_closing(self) -> bool:
            return False

        def get_extra_info(self, name: str) -> None:
            return None

    async def run() -> float:
        loop = asyncio.get_running_loop()
        conn = Conn(loop)
        conn.connection_made(Counting())  # type: ignore[arg-type]
        conn.data_received(HEAD)
        cycle = SimpleNamespace(response_started=True, chunked_encoding=True, response_complete=False,
                                disconnected=False, flow=SimpleNamespace(write_paused=False),
                                scope={"method": "POST"})
        out = Counting()
        events = _Events(None, None, None, "chat", None, DATA,  # type: ignore[arg-type]
                         _chunk_writer(cycle, JoinedWrites(out, loop)))  # type: ignore[arg-type]
        events.started = True
        sink = ChunkSink(events)
        sink._started()
        item = Item(route="chat", method="chat", params={}, operation="chat")
        provider = OpenAIProvider.__new__(OpenAIProvider)
        conn.relay = Relay(conn, Splitter(), sink, DATA, lambda event: provider.passes(item, event))
        conn.waiter = loop.create_future()
        conn.arm(60)
        reads = [framed(CHUNK % i) for i in range(n)]
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for data in reads:
                conn.data_received(data)
            best = min(best, (time.process_time() - start) / n * 1e6)
        assert out.writes == 5 * n and sink.sent == 5 * n  # every chunk written from the callback
        conn.close()
        return best

    return uvloop.run(run())


@contextlib.contextmanager
def worktree(ref: str, into: Path) -> Iterator[Path]:
    subprocess.run(["git", "worktree", "add", "--detach", str(into), ref], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield into
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(into)], cwd=ROOT, check=False,
                       capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="4e15b15", help="the commit to compare against ('' for none)")
    parser.add_argument("--this", default="", help="measure this commit, not the working tree")
    parser.add_argument("--streams", default="64,256,1000", help="concurrent streams, comma-separated")
    parser.add_argument("--big", action="store_true", help="add 2000, and 10000 with --workers auto")
    parser.add_argument("--arrival", default="burst,ramp",
                        help="how streams arrive: burst, ramp or both, comma-separated")
    parser.add_argument("--ramp-k", type=int, default=100,
                        help="ramp: the chunk periods over which the streams start")
    parser.add_argument("--rounds", type=int, default=2, help="burst: streams each client runs back to back")
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--fake-procs", type=int, default=1)
    parser.add_argument("--no-bare", action="store_true",
                        help="leave out the pass-through relay's row (the host's cost of the hop)")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    plan = [(int(n), None) for n in args.streams.split(",")]
    arrivals = [a for a in args.arrival.split(",") if a]
    if not arrivals or set(arrivals) - {"burst", "ramp"}:
        parser.error("--arrival takes burst, ramp or both")
    if args.big:
        plan += [(2000, None), (10000, "auto")]
    rows: list[list[object]] = []
    data: list[dict[str, object]] = []
    work = relay_work()
    print(f"the relay's Python work per chunk, in process: {work[0]:.2f} us the way before, "
          f"{work[1]:.2f} us now", flush=True)
    whole = path_work()
    print(f"a chunk's whole way through the gateway in process (read callback to the chunk's "
          f"write, no syscall): {whole:.2f} us", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        trees = [("this tree", ROOT)]
        if args.this:  # a commit in place of the working tree (others may be editing it)
            trees = [(f"this tree {args.this}", stack.enter_context(worktree(args.this, tmp / "this")))]
        if args.baseline:
            trees.insert(0, (f"baseline {args.baseline}",
                             stack.enter_context(worktree(args.baseline, tmp / "baseline"))))
        fake = free_port()
        fake_proc = psutil.Process(stack.enter_context(logged_child(
            ["-m", "benchmarks._stream_fake", "--port", str(fake), "--gap-ms", str(args.gap_ms),
             "--chunks", str(CHUNKS), "--procs", str(args.fake_procs)],
            f"http://127.0.0.1:{fake}/", tmp / "fake.log")).pid)
        fakes = [fake_proc, *fake_proc.children(recursive=True)]
        for n, workers in plan:
            for way in arrivals:
                how = arrival(way, args)
                direct, extra = measure(fake, fake, n, args, None, how, fakes)
                first99, gap99 = p99(direct.firsts), p99(direct.gaps)
                results = [("direct", direct, extra)]
                if not args.no_bare and not workers:
                    with bare_relay(fake, tmp) as gw:
                        runs, extra = measure(gw.port, fake, n, args, gw, how, fakes)
                    results.append(("bare relay", runs, extra))
                for name, tree in trees:
                    with gateway(tree, fake, tmp, workers) as gw:
                        runs, extra = measure(gw.port, fake, n, args, gw, how, fakes)
                    results.append((name + (f" --workers {workers}" if workers else ""), runs, extra))
                for name, runs, extra in results:
                    f99, g99 = p99(runs.firsts), p99(runs.gaps)
                    direct_row = name == "direct"
                    row = {"target": name, "streams": n, "arrival": way,
                           "max_open_upstream": extra["max_open"],
                           "whole": runs.whole, "started": runs.streams, "errors": len(runs.errors),
                           "first_p99_ms": f99 * 1000, "gap_p99_ms": g99 * 1000,
                           "added_first_p99_ms": None if direct_row else (f99 - first99) * 1000,
                           "added_gap_p99_ms": None if direct_row else (g99 - gap99) * 1000,
                           "cpu_us_per_chunk": extra.get("cpu_us_per_chunk"),
                           "relay_us_per_chunk": extra.get("relay_us_per_chunk"),
                           "setup_us_per_stream": extra.get("setup_us_per_stream"),
                           "rss_kb_per_stream": extra.get("rss_kb_per_stream"),
                           "target_cores": extra.get("target_cores"),
                           "others_cores": extra.get("others_cores"),
                           "load_average_1m": os.getloadavg()[0],
                           "first_errors": runs.errors[:3]}
                    data.append(row)
                    rows.append([n, way, name, extra["max_open"], f"{runs.whole}/{runs.streams}",
                                 f"{f99 * 1000:.1f}" if direct_row else f"{(f99 - first99) * 1000:+.1f}",
                                 f"{g99 * 1000:.1f}" if direct_row else f"{(g99 - gap99) * 1000:+.1f}",
                                 "" if direct_row else f"{extra['cpu_us_per_chunk']:.0f}",
                                 "" if direct_row else f"{extra['relay_us_per_chunk']:.0f}",
                                 "" if direct_row else f"{extra['setup_us_per_stream']:.0f}",
                                 "" if direct_row else f"{extra['rss_kb_per_stream']:.1f}",
                                 (f"- / {extra['others_cores']:.2f}" if direct_row else
                                  f"{extra['target_cores']:.2f} / {extra['others_cores']:.2f}"),
                                 f"{os.getloadavg()[0]:.1f}"])
                    if runs.errors:
                        print(f"{name} at {n} ({way}): {len(runs.errors)} errors, e.g. "
                              f"{runs.errors[:2]}", file=sys.stderr)
                print(table(HEADS, rows[-len(results):]), flush=True)
    print()
    print(table(HEADS, rows))
    save("streams", {"rows": data, "relay_work_us": {"before": work[0], "now": work[1]},
                     "path_work_us": whole,
                     "argv": sys.argv[1:]})


if __name__ == "__main__":
    main()
