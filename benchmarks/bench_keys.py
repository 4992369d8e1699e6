"""The key check on the hot path: a chat call with a key from the store vs one from the YAML.

One gateway process (its own), in front of the fake OpenAI API (tests/fakes) in its own: the same
``/v1/chat/completions`` call, sequential, with a config key, with a stored key (created through
``POST /admin/keys``), and with a stored key whose team and own globs restrict its models (the
rules checked at admission). Rows alternate in every round, so a busy moment hits each alike.
The baseline is the config key; the issue's floor: a stored key within +0.05 ms of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks._procs import child, free_port, percentile, save, table
from benchmarks.bench_llm import MODEL, Target, latencies, openai_call, throughput

ADMIN = "bench-admin-key-0123456789"
YAML_KEY = "sk-bench-yaml-0123456789"
CONFIG = """
server: {{host: 127.0.0.1, port: {port}, admin_key: {admin}, api_keys: {{yaml: {key}}}}}
store: {{path: {store}}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench}}
routes:
  chat: {{provider: oai, operation: chat, models: [{model}]}}
"""


def keyed(key: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {key}"}


async def stored_keys(gw: str) -> tuple[str, str]:
    """A plain stored key, and one under a team, both with model globs (checked per call)."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=gw, headers=admin) as http:
        plain = (await http.post("/admin/keys", json={"name": "bench"})).raise_for_status().json()
        (await http.post("/admin/teams", json={"name": "bench", "models": ["gpt-*"]})).raise_for_status()
        ruled = (await http.post("/admin/keys", json={"name": "bench-rules", "team": "bench",
                                                      "models": [MODEL, "other-*"]})).raise_for_status()
    return plain["key"], ruled.json()["key"]


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    fake_port, gw_port = free_port(), free_port()
    fake, gw = f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{gw_port}"
    fake_args = ["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                 "--requests-per-window", "1000000000"]
    chat = "/v1/chat/completions"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        conf = Path(tmp) / "gateway.yaml"
        conf.write_text(CONFIG.format(port=gw_port, fake=fake_port, store=Path(tmp) / "jobs.db",
                                      model=MODEL, admin=ADMIN, key=YAML_KEY))
        stack.enter_context(child(fake_args, f"{fake}/"))
        gateway = stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf)],
                                            f"{gw}/healthz"))
        plain, ruled = await stored_keys(gw)
        paths = [Target("direct", fake, openai_call(chat, headers=keyed("sk-bench"))),
                 Target("config key", gw, openai_call(chat, headers=keyed(YAML_KEY)), pid=gateway.pid),
                 Target("stored key", gw, openai_call(chat, headers=keyed(plain)), pid=gateway.pid),
                 Target("stored key + team and model globs", gw, openai_call(chat, headers=keyed(ruled)),
                        pid=gateway.pid)]
        seq = await latencies(paths, args.sequential)
        rates = [args.calls / await throughput(p.url, p.call, args.clients, args.calls) for p in paths]
    out = [{"name": p.name, "p50_ms": percentile(s, 0.5) * 1e3, "calls_per_s": r}
           for p, s, r in zip(paths, seq, rates, strict=True)]
    for row in out[1:]:
        row["added_p50_ms"] = row["p50_ms"] - out[0]["p50_ms"]
        row["vs_config_key_ms"] = row["p50_ms"] - out[1]["p50_ms"]
    return out


def micro(stored_keys: int) -> list[dict[str, Any]]:
    """The key check alone, in this process (µs per call, the best of 7 repeats: the machine's
    other load shows least): the bearer to an identity, then the admission rules on it."""
    import timeit

    from multiplexer.access.directory import KeyDirectory
    from multiplexer.access.keystore import KeyRow
    from multiplexer.access.rules import Rules
    from multiplexer.access.secrets import digest
    from multiplexer.core.clock import MonotonicClock
    from multiplexer.core.quota import Quotas
    from multiplexer.faces.auth import Authenticator
    from multiplexer.gateway.config import parse_config

    cfg = parse_config({"server": {"api_keys": {"yaml": YAML_KEY}, "key_store": {"enabled": True}}})
    directory = KeyDirectory(cfg.server.api_keys, {}, Quotas(MonotonicClock(), {}), cfg.server.key_store)
    directory.store = object()  # type: ignore[assignment]  # on, without a database: rows installed below
    rows = [KeyRow(f"key_{i:016x}", "k", "mx-", digest(f"mx-stored-{i}").hex(), None,
                   {"models": [MODEL]} if i == 0 else {}, None, 0.0, 0.0) for i in range(stored_keys)]
    directory.install(rows, [])
    auth = Authenticator(cfg.server.api_keys, directory)
    rules = directory.rules_of("key_0000000000000000")
    assert isinstance(rules, Rules)
    params = {"model": MODEL, "messages": []}
    cases = {
        "config key: identify": lambda: auth.identify(f"Bearer {YAML_KEY}"),
        f"stored key (of {stored_keys:,}): identify": lambda: auth.identify("Bearer mx-stored-1"),
        "stored key: identify + model globs": lambda: (auth.identify("Bearer mx-stored-0"),
                                                       rules.refusal("chat", params, "v1")),
    }
    out = []
    for name, fn in cases.items():
        n = 20_000
        best = min(timeit.repeat(fn, number=n, repeat=7)) / n
        out.append({"name": name, "us": best * 1e6})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequential", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--stored", type=int, default=10_000, help="stored keys in the micro phase")
    parser.add_argument("--micro-only", action="store_true", help="only the in-process key check")
    args = parser.parse_args()
    checks = micro(args.stored)
    base = checks[0]["us"]
    print("the key check in process (best of 7 x 20,000 calls)")
    print(table(["check", "µs per call", "vs config key (µs)"],
                [[c["name"], f"{c['us']:.2f}", f"{c['us'] - base:+.2f}"] for c in checks]))
    if args.micro_only:
        save("bench_keys", {"args": vars(args), "micro": checks})
        return
    results = anyio.run(run, args)
    print(f"chat calls via /v1/chat/completions; {args.sequential} sequential per row, interleaved; "
          f"{args.calls:,} by {args.clients} concurrent clients")
    print(table(["path", "p50 (ms)", "added p50 vs direct (ms)", "vs config key (ms)",
                 f"{args.clients} clients calls/s"],
                [[r["name"], f"{r['p50_ms']:.3f}",
                  f"{r['added_p50_ms']:+.3f}" if "added_p50_ms" in r else "",
                  f"{r['vs_config_key_ms']:+.3f}" if "vs_config_key_ms" in r else "",
                  f"{r['calls_per_s']:,.0f}"] for r in results]))
    print("floor: a stored key within +0.05 ms of a config key")
    save("bench_keys", {"args": vars(args), "micro": checks, "results": json.loads(json.dumps(results))})


if __name__ == "__main__":
    main()
