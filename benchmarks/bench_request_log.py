"""The request log's cost and its reads, four phases, each printed as a table:

0. ``cost``: in one process, the microseconds a call's end spends queuing its record, and those
   the writer spends per record off the call's path (its row built and inserted in SQLite).
1. ``hot``: what recording every call costs on the call path. Four gateway processes of this
   tree against one fake OpenAI upstream, the default config (SQLite store): the log off twice
   (the A/A control: two copies of the same config land this far apart in this run) and the log
   on twice; sequential calls alternate between all of them in a new order each round
   (``bench_llm.measure``). The figure is the log-on pair's added p50 over the log-off pair's.
2. ``sustain``: the gateway's full call rate (``--clients`` workers for ``--seconds``) with the
   log written to PostgreSQL, and with the log off, in alternating rounds; the records the log
   wrote and dropped, from ``/metrics``, and the rows in the table.
3. ``query``: ``GET /admin/requests`` over HTTP on ``--rows`` records seeded in PostgreSQL (one
   ``INSERT ... SELECT generate_series`` in a schema of its own, dropped after): p50 and p99 per
   filter, first pages and cursor pages, and whether a first page stopped searching before it
   was full (``searched_to``: its filters read ``request_store.SCAN`` rows).

    python3 -m benchmarks.bench_request_log                     # a short run of each phase
    python3 -m benchmarks.bench_request_log --phase sustain --seconds 60
    python3 -m benchmarks.bench_request_log --phase query --rows 10000000
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks._h11 import Conn
from benchmarks._procs import child, free_port, percentile, save, table
from benchmarks.bench_llm import MODEL, Target, measure, openai_call, spread, warm

PG = "postgresql://postgres@127.0.0.1:5432/test"
ADMIN = "bench-admin-key-0123456789"
CONFIG = """
server: {{host: 127.0.0.1, port: {port}, admin_key: {admin}}}
store: {{path: {store}{pg}}}
log: {log}
providers:
  oai: {{kind: openai, base_url: "http://127.0.0.1:{fake}/v1", api_key: sk-bench,
        price: {{input_per_mtok: 2.5, output_per_mtok: 10}}}}
routes:
  chat: {{provider: oai, operation: chat, models: [{model}]}}
"""
CHAT = "/v1/chat/completions"
SEED = """
INSERT INTO {t} (at, request_id, key, team, face, method, route, model_asked, model, status, code,
                 error, attempts, fallbacks, batch_id, mode, input_tokens, output_tokens, cached_tokens, cost,
                 saved, latency_ms, path)
SELECT {now} - (%(rows)s - g) * (30.0 * 86400 / %(rows)s), 'req_' || g, 'key-' || mod(g, 1000),
       'team-' || mod(g, 50), 'v1', 'chat', 'route-' || mod(g, 20), 'model-' || mod(g, 30),
       'model-' || mod(g, 30), CASE WHEN mod(g, 50) = 0 THEN 'error' ELSE 'ok' END,
       CASE WHEN mod(g, 50) = 0 THEN -32003 END,
       CASE WHEN mod(g, 50) <> 0 THEN NULL
            WHEN g <= %(rows)s / 100 THEN 'upstream certificate expired (' || mod(g, 7) || ')'
            ELSE 'upstream answered 503: overloaded (' || mod(g, 7) || ')' END,
       1, 0, CASE WHEN mod(g, 100) = 7 THEN 'batch_' || (g / 100000) END, 'sync', 100, 20, 0, 1500, 0,
       12.5, '{{}}'
FROM generate_series(1, %(rows)s) AS g
"""


def gateway(stack: contextlib.ExitStack, tmp: str, fake: int, log: str, pg: str = "") -> str:
    port = free_port()
    conf = Path(tmp) / f"{port}.yaml"
    conf.write_text(CONFIG.format(port=port, admin=ADMIN, store=Path(tmp) / f"{port}.db", pg=pg,
                                  log=log, fake=fake, model=MODEL))
    url = f"http://127.0.0.1:{port}"
    stack.enter_context(child(["-m", "multiplexer", "serve", "--config", str(conf)], f"{url}/healthz"))
    return url


def fake_upstream(stack: contextlib.ExitStack) -> int:
    port = free_port()
    stack.enter_context(child(["-m", "tests.fakes.serve", "openai", "--port", str(port),
                               "--requests-per-window", "1000000000"], f"http://127.0.0.1:{port}/"))
    return port


def pid_of(url: str) -> int | None:
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN":
            return conn.pid
    return None


async def hot(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        fake = fake_upstream(stack)
        targets = [Target("direct", f"http://127.0.0.1:{fake}", openai_call(CHAT))]
        for name, log in (("log off", "{enabled: false}"), ("log on", "{}")):
            for copy in (1, 2):
                url = gateway(stack, tmp, fake, log)
                targets.append(Target(f"{name} ({copy})", url, openai_call(CHAT), None, pid_of(url)))
        rows = await measure(targets, args)
    direct = rows[0]["p50_ms"]
    for r in rows[1:]:
        r["added_p50_ms"] = r["p50_ms"] - direct
    return rows


def cost(n: int) -> dict[str, float]:
    """In one process, no network: the call path's part (``RequestLog.ended``: a queued tuple) and
    the writer's (a row built and inserted into SQLite) per call, in microseconds."""
    from multiplexer.core.call import Call, Item, Outcome
    from multiplexer.gateway.admission import Plan
    from multiplexer.records.requests import RequestLog
    from multiplexer.records.settings import RequestLogConfig

    with tempfile.TemporaryDirectory() as tmp:
        log = RequestLog(RequestLogConfig(queue=n + 1, batch=2000), store_path=Path(tmp) / "r.db",
                         store_url=None, store_schema="", registry=None, wall=time.time,
                         team_of=lambda _: None)
        call = Call("chat", {"model": MODEL, "messages": []}, identity="bench")
        plan = Plan(call, "chat", time.monotonic() + 60, started=time.monotonic())
        plan.item = Item(route="chat", operation="chat", method="chat", params=call.params,
                         options={"mode": "sync"})
        answer = Outcome({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}})
        answer.cost_pico = 12_345_000
        ended = log.ended
        t = time.perf_counter()
        for _ in range(n):
            ended(plan, answer, answer, "oai", None, 0.001)
        put = time.perf_counter() - t
        queued = list(log.sink._queue)
        t = time.perf_counter()
        for i in range(0, n, 2000):
            log._write(queued[i:i + 2000])
        wrote = time.perf_counter() - t
        assert log._writer is not None and log._writer.count() == n
        log._writer.close()
    return {"call_path_us": put / n * 1e6, "writer_us": wrote / n * 1e6}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and 'sink="requests"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _drive(url: str, clients: int, seconds: float) -> tuple[int, float]:
    """Calls by ``clients`` workers for ``seconds``: (calls, seconds taken)."""
    call = openai_call(CHAT)
    conns = [Conn.to(url) for _ in range(clients)]
    try:
        await warm(conns, call)
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await spread(conns, call, 1000)
            calls += 1000
        return calls + clients, time.perf_counter() - t0
    finally:
        for conn in conns:
            await conn.aclose()


async def sustain(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The log on (PostgreSQL) and off, in alternating rounds of at most 10 s, ``--seconds`` each."""
    import psycopg

    schema = "mxbench_" + secrets.token_hex(4)
    pg = f", url: {PG!r}, schema: {schema}"
    out: list[dict[str, Any]] = [{"name": "log off", "calls": 0, "seconds": 0.0},
                                 {"name": "log on (PostgreSQL)", "calls": 0, "seconds": 0.0}]
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            fake = fake_upstream(stack)
            urls = [gateway(stack, tmp, fake, "{enabled: false}", pg), gateway(stack, tmp, fake, "{}", pg)]
            pids = [pid_of(url) for url in urls]
            rounds = max(1, round(args.seconds / 10))
            for _ in range(rounds):
                for row, url, pid in zip(out, urls, pids, strict=True):
                    before = cpu_of(pid), database_cpu()
                    calls, took = await _drive(url, args.clients, args.seconds / rounds)
                    row["calls"] += calls
                    row["seconds"] += took
                    row["gateway_cpu"] = row.get("gateway_cpu", 0.0) + cpu_of(pid) - before[0]
                    row["database_cpu"] = row.get("database_cpu", 0.0) + database_cpu() - before[1]
            await anyio.sleep(2.5)  # the writer's last batch (log.flush_interval_s: 1 s)
            text = httpx.get(f"{urls[1]}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
            on = out[1]
            on["written"] = metric(text, "multiplexer_records_written_total")
            on["dropped"] = metric(text, "multiplexer_records_dropped_total")
            on["failed"] = metric(text, "multiplexer_records_failed_total")
        with psycopg.connect(PG, autocommit=True) as conn:
            on["rows"] = conn.execute(f"SELECT COUNT(*) FROM {schema}.requests").fetchone()[0]  # type: ignore[index]
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    for row in out:
        row["calls_per_s"] = row["calls"] / row["seconds"]
        row["gateway_cpu_us"] = row["gateway_cpu"] / row["calls"] * 1e6
        row["database_cpu_us"] = row["database_cpu"] / row["calls"] * 1e6
    return out


def cpu_of(pid: int | None) -> float:
    import psutil

    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def database_cpu() -> float:
    """CPU seconds of this machine's PostgreSQL processes so far (the database shares the cores)."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if proc.info["name"] and proc.info["name"].startswith("postgres") and proc.info["cpu_times"]:
            total += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return total


def queries(now: float) -> list[tuple[str, dict[str, str]]]:
    """The listings timed: each filter alone, and the combinations that read the most (filters
    whose calls never meet, texts that no recent error or no error at all holds). In the seed
    every 50th call failed, the oldest 1% with another text; key-50's calls all failed."""
    day = 86400.0
    return [("newest, no filter", {}), ("key", {"key": "key-17"}), ("team", {"team": "team-3"}),
            ("route", {"route": "route-5"}), ("model", {"model": "model-11"}),
            ("status=error", {"status": "error"}), ("batch_id", {"batch_id": "batch_7"}),
            ("a day, 2 weeks ago", {"since": str(now - 15 * day), "until": str(now - 14 * day)}),
            ("key + a day", {"key": "key-17", "since": str(now - 15 * day), "until": str(now - 14 * day)}),
            ("key + error text", {"key": "key-50", "error": "overloaded (1)"}),
            ("key + a text only its oldest errors hold", {"key": "key-50", "error": "certificate expired"}),
            ("text no recent error holds", {"error": "certificate expired (3)"}),
            ("text no error holds", {"error": "no such words anywhere"}),
            ("2-letter text no error holds (scan)", {"error": "zq"}),
            ("status=error + route", {"status": "error", "route": "route-10"}),
            ("status=error + team, none match", {"status": "error", "team": "team-3"}),
            ("key + team", {"key": "key-17", "team": "team-17"}),
            ("key + team, never meet", {"key": "key-17", "team": "team-3"}),
            ("route + model, never meet", {"route": "route-5", "model": "model-11"}),
            ("team + code, never meet", {"team": "team-3", "status": "-32003"})]


async def query(args: argparse.Namespace) -> list[dict[str, Any]]:
    import psycopg

    from multiplexer.records.request_store import PgRequestStore

    schema = "mxbench_" + secrets.token_hex(4)
    now = time.time()
    out: list[dict[str, Any]] = []
    try:
        PgRequestStore(PG, schema).close()  # the table, as a gateway makes it
        t = time.perf_counter()
        with psycopg.connect(PG, autocommit=True) as conn:  # seeded first, indexed after (faster)
            indexes = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = %s AND indexname "
                                   "LIKE 'requests\\_%%' AND indexname <> 'requests_pkey'",
                                   (schema,)).fetchall()
            for (name,) in indexes:
                conn.execute(f"DROP INDEX {schema}.{name}")
            conn.execute(SEED.format(t=f"{schema}.requests", now=now), {"rows": args.rows})  # type: ignore[arg-type]
            conn.execute("SET maintenance_work_mem = '256MB'")
        PgRequestStore(PG, schema).close()  # its indexes made again, as a gateway makes them
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"ANALYZE {schema}.requests")
        seeded = time.perf_counter() - t
        print(f"seeded {args.rows:,} rows in {seeded:.0f} s", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            fake = fake_upstream(stack)
            url = gateway(stack, tmp, fake, "{max_rows: null, retention_days: null}",
                          f", url: {PG!r}, schema: {schema}")
            headers = {"authorization": f"Bearer {ADMIN}"}
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
                for name, params in queries(now):
                    first: list[float] = []
                    paged: list[float] = []
                    found, stopped = 0, False
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        r = await http.get("/admin/requests", params=params)
                        first.append(time.perf_counter() - t)
                        body = r.json()
                        assert r.status_code == 200, r.text
                        found = len(body["requests"])
                        stopped = body.get("searched_to") is not None
                        if body["next_cursor"]:
                            t = time.perf_counter()
                            more = {**params, "cursor": body["next_cursor"]}
                            r = await http.get("/admin/requests", params=more)
                            paged.append(time.perf_counter() - t)
                    out.append({"query": name, "rows": found, "stopped": stopped,
                                "p50_ms": percentile(first, 0.5) * 1e3,
                                "p99_ms": percentile(first, 0.99) * 1e3,
                                "next_p99_ms": percentile(paged, 0.99) * 1e3 if paged else None})
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=["cost", "hot", "sustain", "query", "all"], default="all")
    parser.add_argument("--sequential", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--records", type=int, default=100_000, help="calls timed in the cost phase")
    args = parser.parse_args()
    saved: dict[str, Any] = {"argv": sys.argv[1:]}
    if args.phase in ("cost", "all"):
        c = cost(args.records)
        print(table(["per call, in process", "us"],
                    [["the call's path: RequestLog.ended (floor: 20 us)", f"{c['call_path_us']:.2f}"],
                     ["the writer, off the path: row built and inserted (SQLite)", f"{c['writer_us']:.2f}"]])
              + "\n")
        saved["cost"] = c
    if args.phase in ("hot", "all"):
        rows = anyio.run(hot, args)
        print(table(["path", "p50 ms", "added p50 ms", "p99 ms", "calls/s", "gateway CPU ms/call"],
                    [[r["name"], f"{r['p50_ms']:.3f}", f"{r.get('added_p50_ms', 0):+.3f}",
                      f"{r['p99_ms']:.3f}", f"{r['calls_per_s']:.0f}",
                      f"{r['proxy_cpu_ms_per_call']:.3f}" if r["proxy_cpu_ms_per_call"] else "-"]
                     for r in rows]))
        off1, off2, on1, on2 = (r["added_p50_ms"] * 1e3 for r in rows[1:5])
        cpu = [r["proxy_cpu_ms_per_call"] or 0.0 for r in rows[1:5]]
        print(f"\nA/A: the log-off copies {abs(off1 - off2):.0f} us apart, the log-on copies "
              f"{abs(on1 - on2):.0f} us; log on over off: {((on1 + on2) - (off1 + off2)) / 2:+.0f} us of "
              "added p50 (floor: 20 us), "
              f"{((cpu[2] + cpu[3]) - (cpu[0] + cpu[1])) / 2 * 1e3:+.0f} us of the gateway's CPU per call "
              f"(the writer's, off the call's path; the A/A copies {abs(cpu[0] - cpu[1]) * 1e3:.0f} us "
              "apart)\n")
        saved["hot"] = rows
    if args.phase in ("sustain", "all"):
        s = anyio.run(sustain, args)
        print(table(["gateway", "seconds", "calls", "calls/s", "gateway CPU us/call",
                     "PostgreSQL CPU us/call", "records written", "rows in PostgreSQL", "dropped", "failed"],
                    [[r["name"], f"{r['seconds']:.0f}", r["calls"], f"{r['calls_per_s']:.0f}",
                      f"{r['gateway_cpu_us']:.0f}", f"{r['database_cpu_us']:.0f}",
                      f"{r['written']:.0f}" if "written" in r else "-", r.get("rows", "-"),
                      f"{r['dropped']:.0f}" if "dropped" in r else "-",
                      f"{r['failed']:.0f}" if "failed" in r else "-"] for r in s]) + "\n")
        saved["sustain"] = s
    if args.phase in ("query", "all"):
        q = anyio.run(query, args)
        print(table([f"GET /admin/requests on {args.rows:,} rows", "rows", "searched to", "p50 ms",
                     "p99 ms", "next page p99 ms"],
                    [[r["query"], r["rows"], "stopped" if r["stopped"] else "all",
                      f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                      "-" if r["next_p99_ms"] is None else f"{r['next_p99_ms']:.2f}"] for r in q]))
        saved["query"] = q
    save("request_log", saved)


if __name__ == "__main__":
    main()
