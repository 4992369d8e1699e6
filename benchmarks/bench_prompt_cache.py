"""Prompt-cache affinity: the cache-read share of input tokens through a model group vs direct.

Three fake OpenAI deployments (``benchmarks/_cache_fake.py``, one process each) each cache the
prefixes they served for 5 minutes (tokens = characters / 4; hits only from 1,024 tokens, as
OpenAI). Conversations, each with its own ~3,000-token system prompt and tools, run their turns
in order, ``--concurrency`` conversations at a time, each turn sending the whole history:

- ``direct``: to one deployment (every turn after the first can hit its cache: the ceiling);
- ``affinity prefix``: through ``multiplexer serve`` with a group of 3 routes, one per
  deployment, ``affinity: prefix`` (the default);
- ``affinity off``: the same group with ``affinity: off`` (the strategy's pick per call);
- ``base_urls prefix`` / ``base_urls off``: one provider over the three deployments
  (``base_urls``, ``endpoint_affinity: prefix`` or ``off``) behind one route.

With ``--fail`` (on by default) the gateway runs are repeated with deployment d1 answering
500 from the halfway point (by calls sent). Share = sum(cached_tokens) / sum(prompt_tokens)
from the answers' ``usage``; "moved" counts follow-up turns served by another deployment than
the turn before. Floors: >= 0.95x direct healthy, >= 0.85x with a failing deployment.

Spend: every provider has a price (``PRICE``); "spend Δ" compares what the gateway booked
(``multiplexer_spend_usd_total``) with what the fakes' usage prices to (plain input, cached input
and output at those rates, summed over the answers): the floor is within 1%.

    python -m benchmarks.bench_prompt_cache
    python -m benchmarks.bench_prompt_cache --conversations 20 --turns 5
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks._procs import child, free_port, logged_child, save, table

NAMES = ("d1", "d2", "d3")
MODEL = "gpt-cache"
FLOORS = {False: 0.95, True: 0.85}  # failing deployment -> floor (x direct)
SPEND_FLOOR = 0.01  # booked spend within 1% of what the answers' usage prices to
PRICE = {"input_per_mtok": 2.5, "cached_input_per_mtok": 0.25, "output_per_mtok": 10.0}

CONFIG = """
server: {{host: 127.0.0.1, port: {port}}}
store: {{path: {store}}}
providers:
{providers}
routes:
{routes}
groups:
  {model}: {{routes: [{names}], affinity: "{affinity}"}}
"""
PRICED = ("price: {{input_per_mtok: {input_per_mtok}, cached_input_per_mtok: {cached_input_per_mtok}, "
          "output_per_mtok: {output_per_mtok}}}").format(**PRICE)
PROVIDER = ("  {name}: {{kind: openai, base_url: \"http://127.0.0.1:{port}/v1\", api_key: sk-bench,"
            " retry: {{attempts: 1}}, breaker: {{allowed_fails: 3, window_s: 30, cooldown_s: 60}}, "
            + PRICED.replace("{", "{{").replace("}", "}}") + "}}")
ENDPOINTS = """
server: {{host: 127.0.0.1, port: {port}}}
store: {{path: {store}}}
providers:
  all: {{kind: openai, base_urls: [{bases}], api_key: sk-bench, endpoint_affinity: "{affinity}",
        retry: {{attempts: 1}}, breaker: {{allowed_fails: 3, window_s: 30, cooldown_s: 60}}, {priced}}}
routes:
  r_all: {{provider: all, operation: chat, params: {{model: {model}}}, models: [{model}]}}
"""
ROUTE = "  r_{name}: {{provider: {name}, operation: chat, params: {{model: {model}}}}}"

WORDS = ["cache", "latency", "region", "replica", "token", "budget", "window", "prefix", "stream", "vendor",
         "quota", "route", "ledger", "policy", "tenant", "invoice", "schema", "deploy", "shard", "queue"]


@dataclass
class Conversation:
    """One conversation's fixed prefix (system prompt, tools) and its user turns."""

    system: str
    tools: list[dict[str, Any]]
    users: list[str]


def conversations(count: int, turns: int, system_tokens: int, seed: int = 7) -> list[Conversation]:
    """Distinct per conversation, the same in every scenario (seeded)."""
    out = []
    for c in range(count):
        rng = random.Random(f"{seed}:{c}")
        words: list[str] = [f"Conversation {c}. You are the assistant for account {c}."]
        while sum(len(w) + 1 for w in words) < system_tokens * 4:
            words.append(rng.choice(WORDS))
        tools = [{"type": "function", "function": {
            "name": f"lookup_{c}_{t}", "description": f"Look up {rng.choice(WORDS)} records for account {c}.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}
            for t in range(3)]
        users = [" ".join(rng.choice(WORDS) for _ in range(40)) + f" (turn {t})" for t in range(turns)]
        out.append(Conversation(" ".join(words), tools, users))
    return out


@dataclass
class Tally:
    calls: int = 0
    errors: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    follow_ups: int = 0
    moved: int = 0
    served: dict[str, int] = field(default_factory=dict)


async def drive(url: str, convs: list[Conversation], concurrency: int,
                fail_at: int | None, fail_url: str | None) -> tuple[Tally, float]:
    """Run every conversation; at ``fail_at`` calls sent, tell ``fail_url`` to fail."""
    tally = Tally()
    sent = 0
    queue = list(reversed(range(len(convs))))
    headers = {"authorization": "Bearer sk-bench"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:

        async def turn(conv: Conversation, messages: list[dict[str, Any]]) -> tuple[str | None, str]:
            nonlocal sent
            sent += 1
            if fail_at is not None and fail_url is not None and sent == fail_at:
                await http.post(f"{fail_url}/control", json={"fail": True})
            r = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "tools": conv.tools})
            tally.calls += 1
            if r.status_code != 200:
                tally.errors += 1
                return None, ""
            body = r.json()
            usage = body["usage"]
            tally.prompt += usage["prompt_tokens"]
            tally.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            tally.completion += usage.get("completion_tokens", 0)
            where = body.get("system_fingerprint") or r.headers.get("x-multiplexer-route", "")
            tally.served[where] = tally.served.get(where, 0) + 1
            return where, body["choices"][0]["message"]["content"]

        async def worker() -> None:
            while queue:
                conv = convs[queue.pop()]
                messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}]
                last: str | None = None
                for user in conv.users:
                    messages.append({"role": "user", "content": user})
                    where, answer = await turn(conv, messages)
                    if last is not None and where is not None:
                        tally.follow_ups += 1
                        tally.moved += where != last
                    last = where or last
                    messages.append({"role": "assistant", "content": answer})

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
    return tally, time.perf_counter() - started


@contextlib.contextmanager
def deployments() -> Iterator[dict[str, str]]:
    """The three fake deployments; yields name -> base URL."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for name in NAMES:
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            stack.enter_context(child(["-m", "benchmarks._cache_fake", "--port", str(port), "--name", name],
                                      f"{urls[name]}/stats"))
        yield urls


@contextlib.contextmanager
def gateway(urls: dict[str, str], affinity: str, log: Path | None = None,
            endpoints: bool = False) -> Iterator[str]:
    """``multiplexer serve`` with one group over the three deployments (``endpoints``: one
    provider over them as ``base_urls``); yields its URL."""
    port = free_port()
    ports = {n: int(u.rsplit(":", 1)[1]) for n, u in urls.items()}
    with tempfile.TemporaryDirectory() as tmp:
        if endpoints:
            config = ENDPOINTS.format(
                port=port, store=Path(tmp) / "gateway.db", model=MODEL, affinity=affinity, priced=PRICED,
                bases=", ".join(f'"{urls[n]}/v1"' for n in NAMES))
        else:
            config = CONFIG.format(
                port=port, store=Path(tmp) / "gateway.db", model=MODEL, affinity=affinity,
                names=", ".join(f"r_{n}" for n in NAMES),
                providers="\n".join(PROVIDER.format(name=n, port=ports[n]) for n in NAMES),
                routes="\n".join(ROUTE.format(name=n, model=MODEL) for n in NAMES))
        path = Path(tmp) / "gateway.yaml"
        path.write_text(config)
        url = f"http://127.0.0.1:{port}"
        with logged_child(["-m", "multiplexer", "serve", "--config", str(path)], f"{url}/healthz",
                          log or Path(tmp) / "gateway.log"):
            yield url


def cache_moves(metrics: str) -> str:
    """``multiplexer_cache_moves_total`` by reason, e.g. ``overloaded:12 fallback:3``."""
    moves: dict[str, float] = {}
    for labels, value in re.findall(r"^multiplexer_cache_moves_total\{([^}]*)\} (\S+)$", metrics, re.M):
        reason = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("reason", "?")
        moves[reason] = moves.get(reason, 0) + float(value)
    return " ".join(f"{k}:{int(v)}" for k, v in sorted(moves.items())) or "0"


def booked(metrics: str) -> float:
    """What the gateway booked: the sum of ``multiplexer_spend_usd_total``."""
    return sum(float(v) for v in re.findall(r"^multiplexer_spend_usd_total\{[^}]*\} (\S+)$", metrics, re.M))


def billed(tally: Tally) -> float:
    """What the answers' usage prices to at ``PRICE`` (the fake provider's bill)."""
    plain = tally.prompt - tally.cached
    return (plain * PRICE["input_per_mtok"] + tally.cached * PRICE["cached_input_per_mtok"]
            + tally.completion * PRICE["output_per_mtok"]) / 1e6


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    convs = conversations(args.conversations, args.turns, args.system_tokens)
    total = args.conversations * args.turns
    scenarios = [("direct", None, False, False), ("affinity prefix", "prefix", False, False),
                 ("affinity off", "off", False, False), ("base_urls prefix", "prefix", False, True),
                 ("base_urls off", "off", False, True)]
    if args.fail:
        scenarios += [("affinity prefix, d1 fails", "prefix", True, False),
                      ("affinity off, d1 fails", "off", True, False),
                      ("base_urls prefix, d1 fails", "prefix", True, True),
                      ("base_urls off, d1 fails", "off", True, True)]
    if args.only:
        scenarios = [s for s in scenarios if s[0] == "direct" or any(w in s[0] for w in args.only)]
    rows: list[dict[str, Any]] = []
    direct_share = 0.0
    with deployments() as urls:
        for name, affinity, fail, endpoints in scenarios:
            for u in urls.values():
                httpx.post(f"{u}/control", json={"reset": True, "fail": False})
            fail_at, fail_url = (total // 2, urls["d1"]) if fail else (None, None)
            with contextlib.ExitStack() as stack:
                url = (urls["d1"] if affinity is None
                       else stack.enter_context(gateway(urls, affinity, args.gateway_log, endpoints)))
                tally, seconds = await drive(url, convs, args.concurrency, fail_at, fail_url)
                metrics = "" if affinity is None else httpx.get(f"{url}/metrics").text
                why = "-" if affinity is None else cache_moves(metrics)
                spend = None if affinity is None else booked(metrics)
            bill = billed(tally)
            spend_delta = None if spend is None or not bill else abs(spend - bill) / bill
            share = tally.cached / tally.prompt if tally.prompt else 0.0
            if affinity is None:
                direct_share = share
            ratio = share / direct_share if direct_share else 0.0
            floor = None if affinity is None else FLOORS[fail]
            rows.append({
                "scenario": name, "calls": tally.calls, "errors": tally.errors,
                "prompt tokens": tally.prompt, "cached tokens": tally.cached,
                "cache-read share": round(share, 3), "x direct": round(ratio, 3),
                "follow-ups moved": f"{tally.moved}/{tally.follow_ups}",
                "gateway moves": why,
                "served": " ".join(f"{k}:{v}" for k, v in sorted(tally.served.items())),
                "floor": "-" if floor is None else f">= {floor}",
                "meets": "-" if floor is None else ("yes" if ratio >= floor else "no"),
                "booked $": "-" if spend is None else f"{spend:.6f}", "billed $": f"{bill:.6f}",
                "spend Δ": "-" if spend_delta is None else f"{100 * spend_delta:.3f}%"
                + ("" if spend_delta <= SPEND_FLOOR else " (> 1%)"),
                "seconds": round(seconds, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--fail", action=argparse.BooleanOptionalAction, default=True,
                    help="also run with d1 answering 500 from the halfway point")
    ap.add_argument("--only", nargs="*", help="run only the scenarios whose name has one of these "
                    "words (e.g. base_urls); direct always runs")
    ap.add_argument("--gateway-log", type=Path,
                    help="keep the gateway's log here (default: a temporary file)")
    args = ap.parse_args()
    rows = anyio.run(run, args)
    print(f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at a time, "
          f"~{args.system_tokens}-token system prompt + tools each; tokens = chars / 4")
    print(table(list(rows[0]), [list(r.values()) for r in rows]))
    save("prompt_cache", {"args": {k: v for k, v in vars(args).items() if k != "gateway_log"}, "rows": rows})


if __name__ == "__main__":
    main()
