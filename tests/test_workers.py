"""``multiplexer serve --workers N``: real worker processes on 127.0.0.1 under their supervisor.

An upstream JSON-RPC server in the test holds every call until the test releases it, so
"calls in flight" is a fact the test waits for (events), not a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from starlette.requests import Request
from starlette.responses import JSONResponse

from multiplexer.cli import main
from multiplexer.core.metrics import Metrics
from multiplexer.core.metrics_sum import sum_expositions
from multiplexer.core.policy import Limits, Quota
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.replicas import share_of_limits, share_of_quota
from tests.fakes.serve import serve_app

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
START_S = 180.0  # the most a set of workers may take to come up on a busy 2-core host (imports)


class Upstream:
    """A JSON-RPC upstream that answers each call with its params once ``release`` is set."""

    def __init__(self) -> None:
        self.changed = anyio.Event()
        self.reset()

    def reset(self) -> None:
        """Hold the next calls again (a module's tests share one upstream)."""
        self.arrived = 0
        self.release = anyio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        body = await request.json()
        release = self.release
        self.arrived += 1
        self.changed.set()
        self.changed = anyio.Event()
        await release.wait()
        await JSONResponse({"jsonrpc": "2.0", "result": body["params"], "id": body["id"]})(
            scope, receive, send)

    async def wait_arrived(self, n: int) -> None:
        with anyio.fail_after(30):
            while self.arrived < n:
                await self.changed.wait()


class Log:
    """The supervisor's stderr (its workers' too), with a wait for a line to appear."""

    def __init__(self) -> None:
        self.text = ""
        self.changed = anyio.Event()

    def add(self, chunk: bytes) -> None:
        self.text += chunk.decode(errors="replace")
        self.changed.set()
        self.changed = anyio.Event()

    def count(self, needle: str) -> int:
        return self.text.count(needle)

    async def wait_for(self, needle: str, count: int = 1, timeout: float = START_S) -> None:
        with anyio.fail_after(timeout):
            while self.text.count(needle) < count:
                await self.changed.wait()


def write_config(tmp_path: Path, upstream_url: str | None, server: dict[str, Any] | None = None,
                 state: dict[str, Any] | None = None) -> Path:
    url = upstream_url or "http://127.0.0.1:9/"
    data: dict[str, Any] = {
        "server": {"port": 0, "grace_period_s": 5, "access_log": False, **(server or {})},
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"up": {"kind": "jsonrpc", "url": url, "batch_arrays": False,
                             "limits": {"concurrency": 128}},
                      "e": {"kind": "echo"}},
        "routes": {"held": {"provider": "up"}, "echo": {"provider": "e"}},
    }
    if state is not None:
        data["state"] = state
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Supervisor:
    """``multiplexer serve --workers 2`` for the tests of a module that share it: started at the
    first ``up()``, started again by the next ``up()`` after a test stopped it (SIGTERM), stopped at
    the module's end. Starting one is most of what these tests cost (three processes' imports)."""

    def __init__(self, tg: anyio.abc.TaskGroup, config: Path, env: dict[str, str] | None = None,
                 workers: str = "2") -> None:
        self.tg, self.config, self.env, self.workers = tg, config, env or {}, workers
        self.process: anyio.abc.Process | None = None
        self.url = ""
        self.log = Log()
        self.starts = 0

    async def up(self) -> Supervisor:
        """Running, every worker serving."""
        if self.process is None or self.process.returncode is not None:
            await self.tg.start(self._run)
        return self

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        cmd = [sys.executable, "-m", "multiplexer", "serve", "--config", str(self.config), "--workers",
               self.workers]
        self.process = process = await anyio.open_process(
            cmd, cwd=str(ROOT), stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT), **self.env})
        self.log = log = Log()
        self.starts += 1
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._drain, process, log)
                await log.wait_for("multiplexer listening on")
                line = next(x for x in log.text.splitlines() if "multiplexer listening on" in x)
                self.url = line.split("listening on ")[1].split()[0]
                task_status.started()
                # waited for, never signalled, while it runs: a signal to a process that just
                # exited would reap it (Popen.poll) before the event loop's own wait sees its code
                await process.wait()
        finally:
            await stop(process)  # the module's end (cancelled): SIGTERM, then wait

    @staticmethod
    async def _drain(process: anyio.abc.Process, log: Log) -> None:
        assert process.stderr is not None
        async for chunk in process.stderr:
            log.add(chunk)


@asynccontextmanager
async def supervised(config: Path, workers: str = "2", env: dict[str, str] | None = None,
                     ) -> AsyncIterator[tuple[anyio.abc.Process, str, Log]]:
    """A supervisor of a test's own; yields (parent process, base URL, its log) once every
    worker serves."""
    async with anyio.create_task_group() as tg:
        own = await Supervisor(tg, config, env, workers).up()
        assert own.process is not None
        yield own.process, own.url, own.log
        tg.cancel_scope.cancel()


async def stop(process: anyio.abc.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(30, shield=True):
            await process.wait()
    if process.returncode is None:
        process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()


@pytest.fixture(scope="module")
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    held = Upstream()
    async with serve_app(held) as url:
        yield held, url


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory,
                upstream: tuple[Upstream, str]) -> AsyncIterator[Supervisor]:
    """Two workers without shared state: the held upstream, echo, key ``k`` (rpm 4 for both
    workers together) and key ``open`` (no quota)."""
    config = write_config(tmp_path_factory.mktemp("fleet"), upstream[1], {
        "api_keys": {"k": "secret-key", "open": OPEN_KEY}, "quotas": {"k": {"rpm": 4}}})
    async with anyio.create_task_group() as tg:
        yield Supervisor(tg, config)
        tg.cancel_scope.cancel()  # each start's own finally stops its supervisor


@pytest.fixture(scope="module")
async def replicas(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Supervisor]:
    """Two workers as replicas of one shared state (state.url), on the parent's one socket
    (``MULTIPLEXER_WORKERS_REUSEPORT=0``); key ``k`` has rpm 4 for both together."""
    from tests.redis_helpers import drop_keys, prefix, redis_url

    config = write_config(tmp_path_factory.mktemp("replicas"), None,
                          {"api_keys": {"k": "secret-key", "open": OPEN_KEY}, "quotas": {"k": {"rpm": 4}}},
                          state={"url": redis_url(), "prefix": (keys := prefix())})
    async with anyio.create_task_group() as tg:
        yield Supervisor(tg, config, env={"MULTIPLEXER_WORKERS_REUSEPORT": "0"})
        tg.cancel_scope.cancel()
    drop_keys([keys])  # the workers have stopped writing (a test's own drop covers only its test)


OPEN_KEY = "open-key-0123456789"
AS_OPEN = {"authorization": f"Bearer {OPEN_KEY}"}


def one_connection(headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """One keep-alive connection, so every request on it lands on the worker it landed on first."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                             timeout=30, headers=AS_OPEN if headers is None else headers)


async def worker_pid(client: httpx.AsyncClient, url: str) -> int:
    return int((await client.get(f"{url}/healthz")).json()["worker"]["pid"])


async def connections_to_both(url: str, n: int = 24, headers: dict[str, str] | None = None,
                              ) -> list[tuple[httpx.AsyncClient, int]]:
    """At least ``n`` connections and the worker each landed on, opened ``n`` at a time (at once:
    one after another, the worker that won the last ``accept`` on a shared socket tends to win
    them all) until both workers have some; fails if ten rounds never reach both."""
    out: list[tuple[httpx.AsyncClient, int]] = []
    for _ in range(10):
        clients = [one_connection(headers) for _ in range(n)]
        pids = [0] * n

        async def land(i: int, client: httpx.AsyncClient, pids: list[int] = pids) -> None:
            pids[i] = await worker_pid(client, url)

        async with anyio.create_task_group() as tg:
            for i, client in enumerate(clients):
                tg.start_soon(land, i, client)
        out += zip(clients, pids, strict=True)
        if len({pid for _, pid in out}) == 2:
            return out
    for client, _ in out:
        await client.aclose()
    raise AssertionError(f"every connection landed on one worker: {[pid for _, pid in out]}")


def rpc(method: str, params: Any, id_: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params, "id": id_}


async def metric_lines(url: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """``/metrics`` summed over the workers, as ``{series: value}`` (``headers``: a key, where
    callers need keys and so does a scrape)."""
    async with one_connection() as client:
        r = await client.get(f"{url}/metrics", headers=headers)
        assert r.status_code == 200, r.text
        text = r.text
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


# -- config and the CLI ---------------------------------------------------------------------

def test_server_workers_config() -> None:
    assert parse_config({}).server.workers == 1
    assert parse_config({"server": {"workers": 3}}).server.worker_count() == 3
    assert parse_config({"server": {"workers": "auto"}}).server.worker_count() == len(os.sched_getaffinity(0))
    for bad in (0, -2, "many", 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"server\.workers: expected a whole number of processes"):
            parse_config({"server": {"workers": bad}})


def test_cli_refuses_a_bad_workers_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, None)
    assert main(["serve", "--config", str(config), "--workers", "zero"]) == 1
    assert "--workers: expected a whole number >= 1, or auto; got 'zero'" in capsys.readouterr().err


# -- each worker's share of the limits without state.url --------------------------------------

def test_a_share_of_limits_and_quotas_never_the_whole() -> None:
    limits = share_of_limits(Limits(rpm=600, tpm=90_000, concurrency=16), 4)
    assert (limits.rpm, limits.tpm, limits.concurrency) == (150, 22_500, 4)
    assert share_of_limits(Limits(concurrency=5), 2).concurrency == 2  # 2 + 2 <= 5
    assert share_of_limits(Limits(concurrency=1), 3).concurrency == 1  # each keeps one slot
    quota = share_of_quota(Quota(rpm=60, concurrency=4, batch_calls_per_day=1000), 3)
    # the daily batch allowance stays whole: the workers decide it in the store they share
    assert (quota.rpm, quota.concurrency, quota.batch_calls_per_day) == (20, 1, 1000)
    assert share_of_quota(Quota(rpm=60), 1) == Quota(rpm=60)


async def test_a_worker_gateway_builds_its_share() -> None:
    config = parse_config({"server": {"workers": 2, "quotas": {"k": {"rpm": 10}}},
                           "providers": {"p": {"kind": "echo", "limits": {"rpm": 100, "concurrency": 8}}},
                           "routes": {"echo": {"provider": "p"}}})
    async with Gateway(config) as gw:
        limiter: Any = gw.limiters["p"]
        assert (limiter.requests.capacity, limiter.concurrency) == (50, 4)
        assert gw.quotas.quotas["k"].rpm == 5


async def test_two_workers_admit_the_quota_once_not_twice(fleet: Supervisor) -> None:
    """rpm 4 for the key over 2 workers: 2 each, so 4 calls of 40 pass (each alone: 8)."""
    url = (await fleet.up()).url
    conns = await connections_to_both(url, 40)
    ok = 0
    for i, (client, _pid) in enumerate(conns):
        reply = (await client.post(f"{url}/rpc", json=rpc("echo", {"i": i}, i),
                                   headers={"authorization": "Bearer secret-key"})).json()
        if "result" in reply:
            ok += 1
        else:
            assert reply["error"]["code"] == -32003, reply
    for client, _ in conns:
        await client.aclose()
    assert ok == 4


# -- the workers serve, are restarted, drain -------------------------------------------------

async def test_two_workers_answer_and_metrics_sum_them(fleet: Supervisor) -> None:
    url = (await fleet.up()).url
    before = await metric_lines(url)  # the module's other tests' calls: counted apart
    conns = await connections_to_both(url)
    for i, (client, _) in enumerate(conns):
        reply = (await client.post(f"{url}/rpc", json=rpc("echo", {"i": i}, i))).json()
        assert reply == {"jsonrpc": "2.0", "result": {"i": i}, "id": i}
    async with one_connection() as client:
        ready = await client.get(f"{url}/readyz")
        assert ready.status_code == 200
        assert ready.json()["workers"] == {"0": "ready", "1": "ready"}
    lines = await metric_lines(url)
    for client, _ in conns:
        await client.aclose()

    def added(series: str) -> float:
        return float(lines[series]) - float(before.get(series, 0))

    assert added('multiplexer_calls_total{outcome="ok",route="echo"}') == len(conns)
    assert added('multiplexer_http_requests_total{route="/rpc",status="200"}') == len(conns)
    assert added('multiplexer_http_requests_total{route="/healthz",status="200"}') == len(conns)
    assert added('multiplexer_call_duration_seconds_count{route="echo"}') == len(conns)
    assert (lines["multiplexer_workers_answering"], lines["multiplexer_workers"]) == ("2", "2")


async def test_a_killed_worker_is_restarted_and_the_other_answers_all_it_holds(
        fleet: Supervisor, upstream: tuple[Upstream, str]) -> None:
    held = upstream[0]
    held.reset()
    url = (await fleet.up()).url
    log = fleet.log
    restarted, serves = log.count("exited with code -9: starting it again"), log.count("serves again")
    conns = await connections_to_both(url)
    victim = conns[0][1]
    replies: dict[int, Any] = {}

    async def call(i: int, client: httpx.AsyncClient) -> None:
        try:
            replies[i] = (await client.post(f"{url}/rpc", json=rpc("held", {"i": i}, i))).json()
        except httpx.TransportError as e:
            replies[i] = e

    async with anyio.create_task_group() as tg:
        for i, (client, _) in enumerate(conns):
            tg.start_soon(call, i, client)
        await held.wait_arrived(len(conns))  # every call is held upstream, in both workers
        os.kill(victim, signal.SIGKILL)
        await log.wait_for("exited with code -9: starting it again", restarted + 1)
        held.release.set()
    for i, (_, pid) in enumerate(conns):
        if pid == victim:
            assert isinstance(replies[i], httpx.TransportError)  # its connections dropped
        else:
            assert replies[i] == {"jsonrpc": "2.0", "result": {"i": i}, "id": i}
    await log.wait_for("serves again", serves + 1)
    async with one_connection() as client:
        ready = await client.get(f"{url}/readyz")
    assert (ready.status_code, ready.json()["workers"]) == (200, {"0": "ready", "1": "ready"})
    fresh = await connections_to_both(url)
    assert victim not in {pid for _, pid in fresh}
    for client, _ in conns + fresh:
        await client.aclose()


async def test_sigterm_drains_every_worker(fleet: Supervisor, upstream: tuple[Upstream, str]) -> None:
    """The last of the module's tests on ``fleet``: it stops it (a later one would start it again)."""
    held = upstream[0]
    held.reset()
    await fleet.up()
    process, url, log = fleet.process, fleet.url, fleet.log
    assert process is not None
    conns = await connections_to_both(url, 8)
    replies: dict[int, Any] = {}

    async def call(i: int, client: httpx.AsyncClient) -> None:
        replies[i] = (await client.post(f"{url}/rpc", json=rpc("held", {"i": i}, i))).json()

    async with anyio.create_task_group() as tg:
        for i, (client, _) in enumerate(conns):
            tg.start_soon(call, i, client)
        await held.wait_arrived(len(conns))
        process.send_signal(signal.SIGTERM)
        await log.wait_for("received SIGTERM: draining", count=3)  # the parent and both workers
        held.release.set()
    with anyio.fail_after(30):
        code = await process.wait()
    await log.wait_for("every worker drained; stopped", timeout=5)
    for client, _ in conns:
        await client.aclose()
    assert code == 0
    assert replies == {i: {"jsonrpc": "2.0", "result": {"i": i}, "id": i} for i in range(len(conns))}


async def test_without_reuseport_the_workers_share_the_parents_socket(replicas: Supervisor) -> None:
    url = (await replicas.up()).url
    conns = await connections_to_both(url)
    for client, _ in conns:
        assert (await client.post(f"{url}/rpc", json=rpc("echo", [1]))).json()["result"] == [1]
        await client.aclose()


async def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path: Path) -> None:
    # nothing listens at the state's address: each worker fails (the supervisor run on its own:
    # `serve --workers 2` checks the state before it starts one, tests/test_startup_checks.py)
    config = write_config(tmp_path, None, state={"url": "redis://127.0.0.1:9/0"})
    cmd = [sys.executable, "-c", "from multiplexer.workers import Plan, supervise; "
           f"raise SystemExit(supervise(Plan({str(config)!r}, '127.0.0.1', 0, 2, 5.0)))"]
    done = await anyio.run_process(cmd, cwd=str(ROOT), check=False,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "state.url" in err and "before serving: stopping" in err


# -- the job store under several processes --------------------------------------------------

WRITER = """
import sys
from multiplexer.jobs.store import JobStore
store = JobStore(sys.argv[1])
for i in range(int(sys.argv[3])):
    store.create_job(f"{sys.argv[2]}-{i}", None, "test", "open")
print(store._x("PRAGMA journal_mode").fetchone()[0])
"""


async def test_the_sqlite_store_takes_writes_from_several_processes(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results: list[Any] = []

    async def writer(name: str) -> None:
        results.append(await anyio.run_process([sys.executable, "-c", WRITER, str(db), name, "300"],
                                               env=env, check=False))

    async with anyio.create_task_group() as tg:
        for name in ("a", "b", "c"):
            tg.start_soon(writer, name)
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr.decode() for r in results]
    assert {r.stdout.decode().strip() for r in results} == {"wal"}
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 900


def test_summed_metrics_keep_the_job_stores_gauges_once() -> None:
    a, b = Metrics(), Metrics()
    a.call_answered("r", "ok", 0.002)
    b.call_answered("r", "ok", 0.3)
    a.batch_counts(3, {"queued": 2})
    b.batch_counts(3, {"queued": 2})
    a.calls_in_flight.of("r").n, b.calls_in_flight.of("r").n = 2, 1
    lines = dict(line.rsplit(" ", 1) for line in sum_expositions([a.render(), b.render()]).decode()
                 .splitlines() if line and not line.startswith("#"))
    assert lines['multiplexer_calls_total{outcome="ok",route="r"}'] == "2.0"
    assert lines['multiplexer_call_duration_seconds_bucket{le="0.0025",route="r"}'] == "1.0"
    assert lines['multiplexer_call_duration_seconds_bucket{le="0.5",route="r"}'] == "2.0"
    assert float(lines['multiplexer_call_duration_seconds_sum{route="r"}']) == pytest.approx(0.302)
    assert lines['multiplexer_calls_in_flight{route="r"}'] == "3.0"
    assert lines["multiplexer_batch_jobs_open"] == "3.0"
    assert lines['multiplexer_batch_items{state="pending"}'] == "2.0"


def test_the_worker_environment_round_trips() -> None:
    from multiplexer.faces.siblings import Slot

    slot = Slot(1, 4, "/tmp/x", fd=None, ready_fd=7)
    assert Slot(**json.loads(slot.to_env())) == slot


async def test_with_shared_state_the_workers_hold_the_whole_quota_together(replicas: Supervisor) -> None:
    """state.url: the workers are replicas on one port; the key's rpm 4 holds for both together
    (4 of 40 pass, spread over both workers), not a share each."""
    url = (await replicas.up()).url
    conns = await connections_to_both(url, 40)
    passed: list[int] = []
    for i, (client, pid) in enumerate(conns):
        reply = (await client.post(f"{url}/rpc", json=rpc("echo", {"i": i}, i),
                                   headers={"authorization": "Bearer secret-key"})).json()
        if "result" in reply:
            passed.append(pid)
        else:
            assert reply["error"]["code"] == -32003, reply
    for client, _ in conns:
        await client.aclose()
    assert len(passed) == 4
