"""Handshake-era MCP sessions on any replica: what does a round-robin balancer over three replicas
cost a ``tools/call``, against the same balancer in front of one replica?

Three ``multiplexer serve`` processes share a Redis of their own (``state.url``); the balancer
(``tests/rr_proxy.py``, a process of its own) sends each request to the next replica, so every
call of a session lands on another replica than the one before. Baseline, in the same run: the
same balancer with one backend (the same extra hop, every request on the replica that opened
the session), one replica without the balancer, and 2026-07-28 calls (no session: nothing is
shared) through both balancers as the control. Calls are sequential (latency, not throughput),
the scenarios taking turns call by call, so that drift of a busy host hits each alike.

The first request of a session on a replica that never saw it rebuilds it from Redis (one round
trip, once per session and replica), each replica touches a session's idle time at most every
``session_idle_s / 10`` (at most every 30 s), and nothing else of a call goes to Redis.

Run: ``python -m benchmarks.bench_mcp_replicas [--calls 2000] [--sessions 4]`` (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx

from benchmarks._gateway import GatewayProc, gateway
from benchmarks._procs import child, free_port, percentile, save, table
from tests.redis_helpers import OwnRedis

CONFIG = """
server: {host: 127.0.0.1, port: {port}, access_log: false}
state: {url: '%(redis)s', prefix: %(prefix)s}
providers:
  e: {kind: echo}
routes:
  echo: {provider: e}
"""
VERSION = "2025-11-25"
ACCEPT = "application/json, text/event-stream"


@contextlib.contextmanager
def balancer(backends: list[str]) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with child(["-m", "tests.rr_proxy", "--port", str(port), *backends], f"{url}/healthz"):
        yield url


class Session:
    """One handshake-era session spoken by hand (the SDK client's own cost would hide the gateway's)."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http, self.url = http, url + "/mcp"
        self.sid = ""
        self.n = 0

    async def open(self) -> None:
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": VERSION, "capabilities": {},
                           "clientInfo": {"name": "bench", "version": "1"}}}
        r = await self.http.post(self.url, json=init, headers={"accept": ACCEPT})
        self.sid = r.headers["mcp-session-id"]
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        await self.http.post(self.url, json=note, headers=self._headers())

    def _headers(self) -> dict[str, str]:
        return {"accept": ACCEPT, "mcp-session-id": self.sid, "mcp-protocol-version": VERSION}

    async def call(self) -> float:
        self.n += 1
        body = {"jsonrpc": "2.0", "id": self.n, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"n": self.n}}}
        start = time.perf_counter()
        r = await self.http.post(self.url, json=body, headers=self._headers())
        elapsed = time.perf_counter() - start
        data = [line[5:] for line in r.text.splitlines() if line.startswith("data:")]
        answer = json.loads(data[-1]) if data else r.json()
        if "result" not in answer or answer["result"].get("isError"):
            raise RuntimeError(f"call failed: {r.status_code} {r.text[:300]}")
        return elapsed

    async def close(self) -> None:
        await self.http.delete(self.url, headers=self._headers())


class Modern(Session):
    """A 2026-07-28 client: no session at all, each request carries its revision (the control: what
    spreading calls over three processes costs where nothing is shared)."""

    MODERN = "2026-07-28"

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _headers(self) -> dict[str, str]:
        return {"accept": ACCEPT, "mcp-protocol-version": self.MODERN, "mcp-method": "tools/call",
                "mcp-name": "echo"}

    async def call(self) -> float:
        self.n += 1
        meta = {"io.modelcontextprotocol/protocolVersion": self.MODERN,
                "io.modelcontextprotocol/clientCapabilities": {}}
        body = {"jsonrpc": "2.0", "id": self.n, "method": "tools/call",
                "params": {"name": "echo", "arguments": {"n": self.n}, "_meta": meta}}
        start = time.perf_counter()
        r = await self.http.post(self.url, json=body, headers=self._headers())
        elapsed = time.perf_counter() - start
        data = [line[5:] for line in r.text.splitlines() if line.startswith("data:")]
        answer = json.loads(data[-1]) if data else r.json()
        if "result" not in answer or answer["result"].get("isError"):
            raise RuntimeError(f"call failed: {r.status_code} {r.text[:300]}")
        return elapsed


async def measure(urls: dict[str, tuple[type[Session], str]], calls: int,
                  sessions: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=30) as http:
        opened = {name: [kind(http, url) for _ in range(sessions)] for name, (kind, url) in urls.items()}
        for group in opened.values():
            for s in group:
                await s.open()
                for _ in range(20):  # warm: each replica rebuilds the session once
                    await s.call()
        for _ in range(max(1, calls // sessions)):  # scenarios call by call: drift hits each alike
            for name, group in opened.items():
                for s in group:
                    times[name].append(await s.call())
        for group in opened.values():
            for s in group:
                await s.close()
    return times


class Rotating(Session):
    """One session whose every call goes to the next replica (the balancer's spreading, without
    the balancer's hop)."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str]) -> None:
        super().__init__(http, urls[0])
        self.urls = [url + "/mcp" for url in urls]

    async def call(self) -> float:
        self.url = self.urls[self.n % len(self.urls)]
        return await super().call()


async def in_one_loop(redis_url: str, calls: int) -> dict[str, list[float]]:
    """Three gateways and the client in this one event loop, sharing the Redis: a session always
    on one replica against one rotating over the three, call by call. No process is scheduled
    apart from another, so what differs is the gateway's own work for a session it did not open."""
    from multiplexer.gateway.config import parse_config
    from multiplexer.server import running

    data = {"server": {"host": "127.0.0.1", "port": 0, "access_log": False},
            "state": {"url": redis_url, "prefix": f"mxbench-{secrets.token_hex(3)}"},
            "providers": {"e": {"kind": "echo"}}, "routes": {"echo": {"provider": "e"}}}
    times: dict[str, list[float]] = {"one replica": [], "rotating over 3": []}
    async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient(timeout=30) as http:
        urls = [(await stack.enter_async_context(running(parse_config(data))))[1] for _ in range(3)]
        one, rotating = Session(http, urls[0]), Rotating(http, urls)
        for s in (one, rotating):
            await s.open()
            for _ in range(30):
                await s.call()
        for _ in range(calls):
            times["one replica"].append(await one.call())
            times["rotating over 3"].append(await rotating.call())
        for s in (one, rotating):
            await s.close()
    return times


def rows_of(times: dict[str, list[float]], base_of: Any) -> list[list[Any]]:
    ms = {name: (percentile(t, 0.5) * 1000, percentile(t, 0.99) * 1000) for name, t in times.items()}
    rows: list[list[Any]] = []
    for name, (p50, p99) in ms.items():
        base = ms[base_of(name)]
        rows.append([name, len(times[name]), f"{p50:.3f}", f"{p99:.3f}", f"{p50 - base[0]:+.3f}",
                     f"{p99 - base[1]:+.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per scenario")
    parser.add_argument("--sessions", type=int, default=4)
    args = parser.parse_args()
    redis = OwnRedis()
    redis.start()
    try:
        yaml = CONFIG % {"redis": redis.url, "prefix": f"mxbench-{secrets.token_hex(3)}"}
        with contextlib.ExitStack() as stack:
            replicas: list[GatewayProc] = [stack.enter_context(gateway(yaml)) for _ in range(3)]
            one = stack.enter_context(balancer([replicas[0].url]))
            three = stack.enter_context(balancer([r.url for r in replicas]))
            urls: dict[str, tuple[type[Session], str]] = {
                "one replica, direct": (Session, replicas[0].url),
                "balancer, 1 replica": (Session, one),
                "balancer, round-robin over 3": (Session, three),
                "2026-07-28 (no session), balancer, 1 replica": (Modern, one),
                "2026-07-28 (no session), round-robin over 3": (Modern, three),
            }
            times = anyio.run(measure, urls, args.calls, args.sessions)
        looped = anyio.run(in_one_loop, redis.url, args.calls)
    finally:
        redis.stop()
    headers = ["tools/call (handshake era unless said)", "calls", "p50 ms", "p99 ms", "added p50 ms",
               "added p99 ms"]
    print("Processes: three replicas and the balancer, each a process (added: against the same "
          "balancer with one replica)")
    print(table(headers, rows_of(times, lambda name: "2026-07-28 (no session), balancer, 1 replica"
                                 if name.startswith("2026") else "balancer, 1 replica")))
    print("\nOne event loop: three in-process replicas and the client (added: against one replica)")
    print(table(headers, rows_of(looped, lambda name: "one replica")))
    save("mcp_replicas", {name: {"calls": len(t), "p50_ms": percentile(t, 0.5) * 1000,
                                 "p99_ms": percentile(t, 0.99) * 1000}
                          for name, t in {**times, **{f"loop: {k}": v for k, v in looped.items()}}.items()})


if __name__ == "__main__":
    main()
