"""Fallback soak: a model group over two providers that fail on purpose; every call answered once.

Two fake OpenAI chat upstreams run on 127.0.0.1 in this process (real HTTP, the gateway's own
provider and transport); the gateway runs in-process too, so the upstreams' request counts and
the gateway's outcomes are read directly. Scenarios, each in the same run:

- ``clean``: no faults (the baseline).
- ``faults 20%``: each upstream fails about 20% of its requests, evenly over 429, 500, 503,
  a malformed body and a hang past the provider's timeout.
- ``a down``: provider a refuses every request (503); its breaker keeps it from being hammered.

Checked: one outcome per call, each ``ok`` answer carries its own call's token (no answer
under a wrong id), and the errors are printed by status (a call fails only when each route it
tried failed: ``a down`` fails only where b failed too, a timeout on a busy host).

    python -m benchmarks.soak_fallbacks --calls 2000
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from multiplexer.core.call import Call
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import bind, serve_asgi

FAULTS = (429, 500, 503, "malformed", "hang")


@dataclass
class Upstream:
    name: str
    rate: float = 0.0  # share of requests that fail
    down: bool = False  # every request 503
    seed: int = 1
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.name}:{self.seed}")

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            self.requests += 1
            body = await request.json()
            if self.down:
                self.faults["503"] += 1
                return JSONResponse({"error": {"message": "down", "type": "server_error"}}, 503)
            if self.rng.random() < self.rate:
                fault = self.rng.choice(FAULTS)
                self.faults[str(fault)] += 1
                if fault == "malformed":
                    return Response(b"<html>bad gateway</html>", 200, media_type="text/html")
                if fault == "hang":
                    await anyio.sleep(2.0)  # past the provider's 1 s timeout
                    return Response(b"late", 200)
                return JSONResponse({"error": {"message": f"fault {fault}", "type": "error"}}, int(fault),
                                    headers={"retry-after": "0"} if fault == 429 else None)
            token = body["messages"][-1]["content"]
            return JSONResponse({
                "id": "c", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"{self.name}:{token}"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


CONFIG = """
providers:
  a: {kind: openai, base_url: "http://127.0.0.1:%(a)d/v1", api_key: k, timeout_ms: 1000,
      retry: {attempts: 2, base_wait_ms: 5, max_wait_ms: 20}, limits: {concurrency: 64},
      breaker: {allowed_fails: 50, window_s: 2, cooldown_s: 2}}
  b: {kind: openai, base_url: "http://127.0.0.1:%(b)d/v1", api_key: k, timeout_ms: 1000,
      retry: {attempts: 2, base_wait_ms: 5, max_wait_ms: 20}, limits: {concurrency: 64},
      breaker: {allowed_fails: 50, window_s: 2, cooldown_s: 2}}
routes:
  chat_a: {provider: a, operation: chat, params: {model: m-a}}
  chat_b: {provider: b, operation: chat, params: {model: m-b}}
groups:
  gpt-x: {routes: [chat_a, chat_b], strategy: least_busy, max_attempts: 4}
"""


async def scenario(name: str, calls: int, concurrency: int, a: Upstream, b: Upstream) -> dict[str, Any]:
    socks = bind("127.0.0.1", 0), bind("127.0.0.1", 0)
    ports = {"a": socks[0].getsockname()[1], "b": socks[1].getsockname()[1]}
    import yaml

    config = parse_config(yaml.safe_load(CONFIG % ports))
    outcomes: list[Any] = [None] * calls
    routes: list[str | None] = [None] * calls
    answers = [0] * calls
    started = time.perf_counter()
    async with serve_asgi(a.app(), socks[0]), serve_asgi(b.app(), socks[1]), Gateway(config) as gw:
        sem = anyio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                call = Call("gpt-x", {"messages": [{"role": "user", "content": f"t{i}"}]},
                            timeout_ms=10_000)
                outcomes[i] = await gw.submit(call)
                answers[i] += 1
                routes[i] = call.route

        async with anyio.create_task_group() as tg:
            for i in range(calls):
                tg.start_soon(one, i)
        fallbacks = sum(s.value for m in gw.metrics.fallbacks.collect() for s in m.samples
                        if s.name.endswith("_total"))
    seconds = time.perf_counter() - started
    ok = [o for o in outcomes if o is not None and o.ok]
    wrong = sum(1 for i, o in enumerate(outcomes) if o is not None and o.ok
                and o.result["choices"][0]["message"]["content"].split(":", 1)[1] != f"t{i}")
    served = Counter(routes[i] for i, o in enumerate(outcomes) if o is not None and o.ok)
    errors = Counter(_error(o.error) for o in outcomes if o is not None and not o.ok)
    return {"scenario": name, "calls": calls, "answered once": sum(1 for n in answers if n == 1),
            "ok": len(ok), "errors": dict(errors), "wrong answer": wrong,
            "by route": dict(served), "fallbacks": int(fallbacks),
            "upstream a": a.requests, "upstream b": b.requests,
            "faults a": sum(a.faults.values()), "faults b": sum(b.faults.values()),
            "calls/s": round(calls / seconds)}


def _error(error: Any) -> str:
    """An error as its upstream status, or its code and the start of its detail."""
    data = error.data or {}
    if "upstream_status" in data:
        return str(data["upstream_status"])
    return f"{error.code} {str(data.get('detail', ''))[:40]}"


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        out.append("| " + " | ".join(str(r[k]) for k in keys) + " |")
    return "\n".join(out)


async def main(calls: int, concurrency: int, rate: float) -> list[dict[str, Any]]:
    return [
        await scenario("clean", calls, concurrency, Upstream("a"), Upstream("b")),
        await scenario(f"faults {rate:.0%}", calls, concurrency, Upstream("a", rate), Upstream("b", rate)),
        await scenario("a down", calls, concurrency, Upstream("a", down=True), Upstream("b")),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.2)
    args = parser.parse_args()
    rows = anyio.run(main, args.calls, args.concurrency, args.rate)
    print(table(rows))
    for r in rows:
        assert r["answered once"] == r["calls"], r
        assert r["wrong answer"] == 0, r
    assert rows[0]["ok"] == rows[0]["calls"], rows[0]
