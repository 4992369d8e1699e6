"""Policy on every path, on the live-call hot path: a chat call with a key, its access rules, a
quota and a budget (every call checked, priced, reserved and settled), through this tree's gateway
and through a baseline commit's, in one run against the same fake upstream.

Each gateway runs twice (two processes of one config: the A/A rows show how far two copies of the
same code land apart in this run), sequential calls alternate between every path in a new order
each round (``bench_llm.latencies``), and the table gives each path's added p50 over a direct call
and this tree's over the baseline's (the mean of each pair). The baseline is checked out as a git
worktree in a temporary folder and removed after.

    python3 -m benchmarks.bench_policy --baseline 5065113 --sequential 3000
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

from benchmarks._procs import ROOT, child, free_port, save, table
from benchmarks.bench_llm import MODEL, Target, measure, openai_call

REST = """
store: {{path: {store}}}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench,
        price: {{input_per_mtok: 2.5, output_per_mtok: 10}}}}
routes:
  chat: {{provider: oai, operation: chat, models: [{model}]}}
"""
CONFIG = """
server: {{host: 127.0.0.1, port: {port}, admin_key: bench-admin-key-0123456789,
         api_keys: {{bench: {{key: sk-bench, models: ["gpt-*"], budget_usd: {{daily: 1000000}}}}}},
         quotas: {{bench: {{rpm: 100000000, concurrency: 1000}}}}}}""" + REST
# ``--keyless``: the admin API on, no key made yet (every caller keyless): what a worker pays to
# make sure the store still holds no key before it serves a caller without one
KEYLESS = """
server: {{host: 127.0.0.1, port: {port}, admin_key: bench-admin-key-0123456789}}""" + REST
SERVE = "import sys; sys.path.insert(0, {tree!r}); from multiplexer.cli import main; sys.exit(main())"


@contextlib.contextmanager
def worktree(ref: str, into: Path) -> Any:
    subprocess.run(["git", "worktree", "add", "--detach", str(into), ref], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield into
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(into)], cwd=ROOT, check=False,
                       capture_output=True)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    chat = "/v1/chat/completions"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        base = stack.enter_context(worktree(args.baseline, Path(tmp) / "baseline"))
        fake_port = free_port()
        fake = f"http://127.0.0.1:{fake_port}"
        stack.enter_context(child(["-m", "tests.fakes.serve", "openai", "--port", str(fake_port),
                                   "--requests-per-window", "1000000000"], f"{fake}/"))
        targets = [Target("direct", fake, openai_call(chat))]
        for name, tree in ((f"baseline {args.baseline}", base), ("this tree", ROOT)):
            for copy in (1, 2):
                port = free_port()
                conf = Path(tmp) / f"{copy}-{port}.yaml"
                shape = KEYLESS if args.keyless else CONFIG
                conf.write_text(shape.format(port=port, fake=fake_port, model=MODEL,
                                             store=Path(tmp) / f"{port}.db"))
                proc = stack.enter_context(child(
                    ["-c", SERVE.format(tree=str(tree)), "serve", "--config", str(conf)],
                    f"http://127.0.0.1:{port}/healthz"))
                targets.append(Target(f"{name} ({copy})", f"http://127.0.0.1:{port}",
                                      openai_call(chat), None, proc.pid))
        rows = await measure(targets, args)
    direct = rows[0]["p50_ms"]
    for r in rows[1:]:
        r["added_p50_ms"] = r["p50_ms"] - direct
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="5065113", help="the commit to compare against")
    parser.add_argument("--sequential", type=int, default=3000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--keyless", action="store_true",
                        help="the admin API on and no key made: keyless callers, not the keyed path")
    args = parser.parse_args()
    rows = anyio.run(run, args)
    print(table(["path", "p50 ms", "added p50 ms", "p99 ms", "calls/s (32 clients)", "gateway CPU ms/call"],
                [[r["name"], f"{r['p50_ms']:.3f}", f"{r.get('added_p50_ms', 0):+.3f}", f"{r['p99_ms']:.3f}",
                  f"{r['calls_per_s']:.0f}", f"{r['proxy_cpu_ms_per_call']:.3f}" if r["proxy_cpu_ms_per_call"]
                  else "-"] for r in rows]))
    b1, b2, t1, t2 = (r["added_p50_ms"] * 1e3 for r in rows[1:5])
    print(f"\nA/A: baseline copies {abs(b1 - b2):.0f} us apart, this tree's {abs(t1 - t2):.0f} us; "
          f"this tree over the baseline: {((t1 + t2) - (b1 + b2)) / 2:+.0f} us of added p50")
    save("policy", {"rows": rows, "baseline": args.baseline, "argv": sys.argv[1:]})


if __name__ == "__main__":
    main()
