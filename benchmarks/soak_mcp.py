"""Crash soak for upstream MCP servers: calls through a real gateway while its stdio child is killed.

The gateway runs here on 127.0.0.1 (``/rpc``) in front of ``multiplexer/defaults/demo_tools.py``
as a stdio child; every ``--kill-every`` answered calls the child gets SIGKILL and the
provider restarts it. Calls mix ``echo`` (read-only: may be repeated after a crash) and
``record`` (appends its token to a file: a side effect that must never run twice).

Checked: every call with an id is answered exactly once; an ``ok`` echo carries its
own token; an ``ok`` record ran exactly once; no record ran twice; every error is a
documented one (-32007 upstream unavailable, -32001 deadline). A pass without kills
in the same run is the throughput baseline.

    python -m benchmarks.soak_mcp --calls 20000 --kill-every 2000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

from benchmarks._procs import save, table
from multiplexer.gateway.config import parse_config
from multiplexer.server import running

UPSTREAM = str(Path(__file__).resolve().parent.parent / "multiplexer" / "defaults" / "demo_tools.py")
ALLOWED_ERRORS = {-32007, -32001}


def config(timeout_ms: float) -> Any:
    return parse_config({
        "server": {"host": "127.0.0.1", "port": 0, "default_timeout_ms": timeout_ms},
        "providers": {"tools": {"kind": "mcp", "command": sys.executable, "args": [UPSTREAM],
                                "restart_backoff_ms": 20, "limits": {"concurrency": 64}}},
        "routes": {"tools_*": {"provider": "tools"}},
    })


def upstream_children() -> list[psutil.Process]:
    me = psutil.Process()
    found = []
    for p in me.children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(UPSTREAM in part for part in p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


@dataclass
class Ledger:
    sent: dict[int, tuple[str, str]] = field(default_factory=dict)  # id -> (tool, token)
    answers: Counter[int] = field(default_factory=Counter)
    unknown: int = 0
    ok: Counter[str] = field(default_factory=Counter)
    ok_ids: set[int] = field(default_factory=set)
    errors: Counter[int] = field(default_factory=Counter)
    wrong_token: int = 0
    kills: int = 0
    answered: int = 0

    def take(self, reply: dict[str, Any]) -> None:
        rid = reply.get("id")
        if rid not in self.sent:
            self.unknown += 1
            return
        self.answers[rid] += 1
        self.answered += 1
        tool, token = self.sent[rid]
        if "result" in reply:
            self.ok[tool] += 1
            self.ok_ids.add(rid)
            if reply["result"].get("structuredContent", {}).get("result") != token:
                self.wrong_token += 1
        else:
            self.errors[reply["error"]["code"]] += 1


async def soak(calls: int, kill_every: int, batch: int = 25, workers: int = 8,
               timeout_ms: float = 10_000) -> dict[str, Any]:
    """One pass; ``kill_every`` 0 means no kills. Returns the ledger's figures and the checks."""
    ledger = Ledger()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "records.txt")
        Path(path).touch()
        async with running(config(timeout_ms), port=0) as (gw, url), httpx.AsyncClient(timeout=60) as http:
            next_id = iter(range(calls))
            next_kill = kill_every
            start = time.perf_counter()

            async def worker() -> None:
                nonlocal next_kill
                while True:
                    body = []
                    for rid in next_id:
                        tool = "record" if rid % 2 else "echo"
                        token = f"t{rid}"
                        ledger.sent[rid] = (tool, token)
                        params = {"token": token, "path": path} if tool == "record" else {"text": token}
                        body.append({"jsonrpc": "2.0", "id": rid, "method": f"tools_{tool}",
                                     "params": params})
                        if len(body) == batch:
                            break
                    if not body:
                        return
                    replies = (await http.post(f"{url}/rpc", json=body)).json()
                    for reply in replies:
                        ledger.take(reply)
                    if kill_every and ledger.answered >= next_kill:
                        next_kill += kill_every
                        for child in upstream_children():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(child.pid, signal.SIGKILL)
                                ledger.kills += 1

            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(worker)
            wall = time.perf_counter() - start
            connects = gw.providers["tools"].session.connects
        executed = Counter(Path(path).read_text().split())
    ok_record_not_once = sum(1 for rid in ledger.ok_ids
                             if ledger.sent[rid][0] == "record" and executed[ledger.sent[rid][1]] != 1)
    return {
        "calls": calls, "calls_per_s": calls / wall, "kills": ledger.kills, "connects": connects,
        "answered_once": sum(1 for n in ledger.answers.values() if n == 1),
        "missing": calls - len(ledger.answers),
        "duplicates": sum(1 for n in ledger.answers.values() if n > 1),
        "unknown_ids": ledger.unknown, "wrong_token": ledger.wrong_token,
        "ok": dict(ledger.ok), "errors": {str(k): v for k, v in sorted(ledger.errors.items())},
        "undocumented_errors": sum(v for k, v in ledger.errors.items() if k not in ALLOWED_ERRORS),
        "records_run_twice": sum(1 for n in executed.values() if n > 1),
        "ok_records_not_run_once": ok_record_not_once,
        "records_run": sum(executed.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--kill-every", type=int, default=2_000)
    args = parser.parse_args()
    crash = anyio.run(soak, args.calls, args.kill_every)
    base = anyio.run(soak, max(args.calls // 4, 1000), 0)
    keys = ["calls", "kills", "connects", "answered_once", "missing", "duplicates", "unknown_ids",
            "wrong_token", "ok", "errors", "undocumented_errors", "records_run", "records_run_twice",
            "ok_records_not_run_once", "calls_per_s"]
    rows = [[k, _fmt(crash[k]), _fmt(base[k])] for k in keys]
    print(table(["measure", f"SIGKILL every {args.kill_every} answers", "no kills (baseline)"], rows))
    save("soak_mcp", {"crash": crash, "baseline": base, "params": vars(args)})


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n:,}" for k, n in v.items()) or "none"
    return f"{v:,}" if isinstance(v, int) else str(v)


if __name__ == "__main__":
    main()
