"""Fault soak: many calls through a real gateway in front of an upstream that fails on purpose.

The gateway is a child process (``python -m multiplexer serve``); the upstream is
``examples/fault_upstream.py`` in this process, so its execution counts are read
directly. About 20% of upstream HTTP requests fail, evenly over: 429 with and
without Retry-After, 500/502/503, hangs past the HTTP timeout, connection resets,
malformed bodies, partial batch failures, replies slower than short call deadlines.

Checked: every call with an id is answered exactly once; an ``ok`` answer carries
the call's own token (no answer under a wrong id) and was really executed; no
non-idempotent call ran twice upstream. A fault-free pass in the same run is the
throughput baseline.

    python -m benchmarks.soak_faults --calls 100000
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import psutil

from benchmarks._gateway import gateway, metric_sum
from benchmarks._h11 import Conn
from benchmarks._procs import save, table
from examples.fault_upstream import FaultState, create_app
from multiplexer.core.json_codec import dumps, loads
from multiplexer.server import bind, serve_asgi

CONFIG = """
server: {host: 127.0.0.1, port: {port}, default_timeout_ms: 4000, max_batch_items: 1000}
providers:
  flaky:
    kind: jsonrpc
    url: http://127.0.0.1:{upstream}/
    timeout_ms: 800
    batch: {max_items: 25, max_wait_ms: 2}
    limits: {concurrency: 32, max_queue: 20000}
    retry: {attempts: 4, base_wait_ms: 5, max_wait_ms: 50}
  flaky1:
    kind: jsonrpc
    url: http://127.0.0.1:{upstream}/
    timeout_ms: 800
    batch: {max_items: 1}
    limits: {concurrency: 32, max_queue: 20000}
    retry: {attempts: 4, base_wait_ms: 5, max_wait_ms: 50}
routes:
  act: {provider: flaky}
  act_idem: {provider: flaky, method: act, dedup: true}
  act_single: {provider: flaky1, method: act}
  act_single_idem: {provider: flaky1, method: act, dedup: true}
"""
# route -> idempotent (a dedup route may be retried after a failure that may have run it)
ROUTES = {"act": False, "act_idem": True, "act_single": False, "act_single_idem": True}
MIX = [("act", 30), ("act_idem", 20), ("act_key", 10), ("act_single", 20), ("act_single_idem", 15),
       ("notify", 3), ("dup", 2)]
SHORT_DEADLINE_MS = 300  # below the upstream's slow_s: those calls end by deadline


@dataclass
class Ledger:
    """What was sent and what came back, per call id and per token."""

    token_of: dict[int, str] = field(default_factory=dict)
    idempotent: dict[str, bool] = field(default_factory=dict)
    kinds: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    ok_tokens: set[str] = field(default_factory=set)
    calls: int = 0
    notifications: int = 0
    answered: int = 0
    missing: int = 0
    duplicate_answers: int = 0
    unexpected_answers: int = 0
    wrong_token: int = 0
    http_failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def build_batch(seed: int, b: int, size: int, ledger: Ledger,
                short_share: float) -> tuple[list[dict[str, Any]], list[int]]:
    """Batch ``b``: messages and the ids owed an answer (a token may appear under two ids)."""
    rng = random.Random(f"{seed}:{b}")
    kinds, weights = zip(*MIX, strict=True)
    msgs, owed = [], []
    for k in range(size):
        rid = b * size + k
        token = f"{seed}-{rid}"
        kind = rng.choices(kinds, weights)[0]
        if kind == "dup" and owed:  # the same idempotent call again: shared, same answer
            first = rng.choice(owed)
            token = ledger.token_of[first]
            if not ledger.idempotent[token]:
                kind = "act"
                token = f"{seed}-{rid}"
        route = {"act_key": "act", "notify": "act", "dup": "act_idem"}.get(kind, kind)
        params: dict[str, Any] = {"token": token}
        meta: dict[str, Any] = {}
        if kind == "act_key":
            meta["idempotency_key"] = token
        if rng.random() < short_share:
            meta["timeout_ms"] = SHORT_DEADLINE_MS
        if meta:
            params["_meta"] = meta
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": route, "params": params}
        ledger.kinds[kind] += 1
        if token not in ledger.idempotent:
            ledger.idempotent[token] = kind == "act_key" or ROUTES.get(route, False)
        if kind == "notify":
            ledger.notifications += 1
        else:
            msg["id"] = rid
            ledger.token_of[rid] = token
            owed.append(rid)
            ledger.calls += 1
        msgs.append(msg)
    return msgs, owed


def settle(ledger: Ledger, owed: list[int], reply: Any) -> None:
    replies = reply if isinstance(reply, list) else []
    seen = Counter(r.get("id") for r in replies if isinstance(r, dict))
    want = set(owed)
    for rid in owed:
        if seen[rid] == 0:
            ledger.missing += 1
        elif seen[rid] > 1:
            ledger.duplicate_answers += seen[rid] - 1
    ledger.unexpected_answers += sum(c for rid, c in seen.items() if rid not in want)
    for r in replies:
        if not isinstance(r, dict) or r.get("id") not in want:
            continue
        ledger.answered += 1
        if "error" in r:
            ledger.outcomes[str(r["error"].get("code"))] += 1
            continue
        token = ledger.token_of[r["id"]]
        result = r.get("result")
        if not isinstance(result, dict) or result.get("token") != token:
            ledger.wrong_token += 1
            continue
        ledger.outcomes["ok"] += 1
        ledger.ok_tokens.add(token)


async def drive(url: str, seed: int, calls: int, batch: int, concurrency: int,
                ledger: Ledger, short_share: float = 0.1, first_batch: int = 0) -> None:
    batches = (calls + batch - 1) // batch
    counter = itertools.count(first_batch)
    last = first_batch + batches

    async def worker() -> None:
        conn = Conn.to(url, timeout=120.0)
        try:
            while (b := next(counter)) < last:
                msgs, owed = build_batch(seed, b, batch, ledger, short_share)
                try:
                    r = await conn.request("POST", "/rpc", {"content-type": "application/json"},
                                           dumps(msgs))
                except Exception as e:  # a transport failure: every call in it went unanswered
                    ledger.http_failures[type(e).__name__] += 1
                    ledger.missing += len(owed)
                    continue
                if r.status != 200:
                    ledger.http_failures[f"HTTP {r.status}"] += 1
                    ledger.missing += len(owed)
                    continue
                settle(ledger, owed, loads(r.body))
        finally:
            await conn.aclose()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    ledger.seconds = time.perf_counter() - start


def audit(ledger: Ledger, state: FaultState) -> dict[str, int]:
    """Side effects upstream: no non-idempotent token twice; every ok answer really ran."""
    dup_nonidem = sum(1 for t, n in state.executions.items() if n > 1 and not ledger.idempotent.get(t, True))
    reexec_idem = sum(n - 1 for t, n in state.executions.items() if n > 1 and ledger.idempotent.get(t))
    phantom_ok = sum(1 for t in ledger.ok_tokens if state.executions[t] < 1)
    return {"duplicate_executions_non_idempotent": dup_nonidem,
            "re_executions_idempotent": reexec_idem, "ok_without_execution": phantom_ok}


@dataclass
class SoakResult:
    baseline: Ledger
    faulty: Ledger
    audit: dict[str, int]
    faults: Counter[str]
    upstream_requests: int
    metrics: dict[str, float]
    gateway_alive: bool
    tracebacks: int
    cpu_s: tuple[float, float]  # gateway, this process (client + upstream)


async def soak(url: str, state: FaultState, calls: int, baseline_calls: int, batch: int,
               concurrency: int, seed: int, rate: float = 0.2) -> tuple[Ledger, Ledger, dict[str, int]]:
    """A fault-free pass (the baseline), then the faulty one; then the side-effect audit."""
    baseline, faulty = Ledger(), Ledger()
    state.rate = 0.0
    await drive(url, seed + 1000, baseline_calls, batch, concurrency, baseline, short_share=0.0)
    state.rate = rate
    await drive(url, seed, calls, batch, concurrency, faulty)
    with anyio.fail_after(30):
        await state.quiet()  # hung and slow requests finish their side effects first
    return baseline, faulty, audit(faulty, state)


def run_soak(calls: int, baseline_calls: int = 0, batch: int = 50, concurrency: int = 8,
             seed: int = 7, rate: float = 0.2) -> SoakResult:
    state = FaultState(rate=rate, seed=seed, hang_s=1.5, slow_s=0.5, retry_after="0.02")
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    out: dict[str, Any] = {}

    async def main() -> None:
        async with serve_asgi(create_app(state), sock):
            # The gateway helpers block (start-up poll, /metrics); the upstream in this loop is
            # idle then: the gateway only calls it while ``soak`` runs.
            with gateway(CONFIG.replace("{upstream}", str(port))) as gw:
                before = gw.metrics()
                gw_proc, me = psutil.Process(gw.pid), psutil.Process()
                cpu0 = sum(gw_proc.cpu_times()[:2]), sum(me.cpu_times()[:2])
                out["ledgers"] = await soak(gw.url, state, calls, baseline_calls, batch, concurrency,
                                            seed, rate)
                out["cpu"] = (sum(gw_proc.cpu_times()[:2]) - cpu0[0], sum(me.cpu_times()[:2]) - cpu0[1])
                text = gw.metrics()
                out["metrics"] = {
                    "retries": metric_sum(text, "multiplexer_retries_total")
                    - metric_sum(before, "multiplexer_retries_total"),
                    "upstream_requests": metric_sum(text, "multiplexer_upstream_requests_total"),
                }
                out["alive"] = gw.alive() and gw.healthy()
                out["tracebacks"] = gw.tracebacks()

    try:
        anyio.run(main)
    finally:
        sock.close()
    baseline, faulty, checks = out["ledgers"]
    return SoakResult(baseline, faulty, checks, state.faults, state.http_requests, out["metrics"],
                      out["alive"], out["tracebacks"], out["cpu"])


CODES = {"ok": "ok (result carries its own token)", "-32000": "-32000 upstream error",
         "-32001": "-32001 deadline exceeded", "-32002": "-32002 overloaded",
         "-32007": "-32007 upstream unavailable", "-32050": "-32050 upstream's own error (passed through)"}


def render(r: SoakResult) -> str:
    f, b = r.faulty, r.baseline
    rows: list[list[object]] = [
        ["calls with an id", f"{f.calls:,}", f"{b.calls:,}"],
        ["notifications", f"{f.notifications:,}", f"{b.notifications:,}"],
        ["answered exactly once", f"{f.answered - f.duplicate_answers:,}", f"{b.answered:,}"],
    ]
    for code in sorted(set(f.outcomes) | set(b.outcomes), key=lambda c: (c != "ok", c)):
        rows.append([CODES.get(code, f"{code} error"), f"{f.outcomes[code]:,}", f"{b.outcomes[code]:,}"])
    rows += [
        ["missing answers", f.missing, b.missing],
        ["duplicate answers", f.duplicate_answers, b.duplicate_answers],
        ["answers not owed", f.unexpected_answers, b.unexpected_answers],
        ["answers under a wrong id (token mismatch)", f.wrong_token, b.wrong_token],
        ["gateway HTTP failures", sum(f.http_failures.values()), sum(b.http_failures.values())],
        ["calls/s", f"{f.calls / f.seconds:,.0f}", f"{b.calls / b.seconds:,.0f}"
         if b.seconds else "-"],
        ["upstream HTTP requests (all phases)", f"{r.upstream_requests:,}", ""],
        ["faults injected", ", ".join(f"{k} {v}" for k, v in sorted(r.faults.items())), "0"],
        ["gateway retries (/metrics)", f"{r.metrics['retries']:,.0f}", ""],
        ["duplicate executions, non-idempotent calls", r.audit["duplicate_executions_non_idempotent"], ""],
        ["re-executions, idempotent calls (allowed)", r.audit["re_executions_idempotent"], ""],
        ["ok answers never executed upstream", r.audit["ok_without_execution"], ""],
        ["gateway alive and /healthz 200 after; tracebacks", f"{r.gateway_alive}; {r.tracebacks}", ""],
        ["CPU seconds: gateway / client + upstream", f"{r.cpu_s[0]:.0f} / {r.cpu_s[1]:.0f}", ""],
    ]
    return table(["measure", "20% faults", "no faults (baseline)"], rows)


def invariant_failures(r: SoakResult) -> list[str]:
    bad = []
    for name, ledger in (("faulty", r.faulty), ("baseline", r.baseline)):
        for what in ("missing", "duplicate_answers", "unexpected_answers", "wrong_token"):
            if getattr(ledger, what):
                bad.append(f"{name}: {what} = {getattr(ledger, what)}")
        if ledger.http_failures:
            bad.append(f"{name}: gateway HTTP failures {dict(ledger.http_failures)}")
    for what, n in r.audit.items():
        if n and what != "re_executions_idempotent":
            bad.append(f"{what} = {n}")
    if r.baseline.calls and r.baseline.outcomes["ok"] != r.baseline.calls:
        bad.append(f"baseline: {r.baseline.calls - r.baseline.outcomes['ok']} calls failed without faults")
    if not r.gateway_alive or r.tracebacks:
        bad.append(f"gateway alive={r.gateway_alive} tracebacks={r.tracebacks}")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--baseline", type=int, default=5_000, help="fault-free calls first")
    parser.add_argument("--batch", type=int, default=50, help="calls per HTTP request to /rpc")
    parser.add_argument("--concurrency", type=int, default=8, help="HTTP requests in flight")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    r = run_soak(args.calls, args.baseline, args.batch, args.concurrency, args.seed)
    print(render(r))
    bad = invariant_failures(r)
    for line in bad:
        print("INVARIANT BROKEN:", line)
    save("soak_faults", {
        "calls": r.faulty.calls, "notifications": r.faulty.notifications,
        "outcomes": dict(r.faulty.outcomes), "missing": r.faulty.missing,
        "duplicate_answers": r.faulty.duplicate_answers, "wrong_token": r.faulty.wrong_token,
        "unexpected_answers": r.faulty.unexpected_answers, "kinds": dict(r.faulty.kinds),
        "calls_per_s": r.faulty.calls / r.faulty.seconds,
        "baseline_calls": r.baseline.calls, "baseline_outcomes": dict(r.baseline.outcomes),
        "baseline_calls_per_s": r.baseline.calls / r.baseline.seconds if r.baseline.seconds else None,
        "faults": dict(r.faults), "upstream_requests": r.upstream_requests, **r.metrics, **r.audit,
        "gateway_alive": r.gateway_alive, "tracebacks": r.tracebacks, "invariants_broken": bad,
        "cpu_s_gateway": r.cpu_s[0], "cpu_s_client_upstream": r.cpu_s[1],
    })
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
