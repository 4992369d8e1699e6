"""``multiplexer serve --workers N``: N gateway processes on one port, and the parent that keeps them.

One gateway process is one event loop, so one core. Here the parent starts N workers, each a
whole gateway (``multiplexer serve`` with ``MULTIPLEXER_WORKER`` naming its place,
``faces/siblings.py``), and they share the port: each binds its own socket with
``SO_REUSEPORT`` and the kernel spreads connections over them. Where the kernel lacks it (or
``MULTIPLEXER_WORKERS_REUSEPORT=0``), the parent binds and listens once and the workers
inherit that socket. The parent holds the port from the start either way, so a worker that
restarts finds it, and nobody else takes it.

The parent serves nothing. It waits for every worker to say it listens (a byte on a pipe),
then logs ``multiplexer listening on ...``; a worker that dies is started again after a
backoff (0.5 s doubling to 30 s, back to 0.5 s once a worker has run a minute); SIGTERM or
SIGINT is passed to every worker, each drains within its own ``server.grace_period_s``, and
the parent exits 0 when all stopped cleanly, 1 when one had to be killed or failed, or when a
worker could not start at all (its error is in the log above). Its folder (the workers'
sockets for ``/metrics`` and ``/readyz``) is removed at exit. SIGHUP is passed to every worker
that serves: each reads the config file again (``gateway/reload.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import anyio.abc

from multiplexer.faces.siblings import WORKER_ENV, Slot
from multiplexer.server import bind

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a worker that ran this long restarts after the first backoff again
KILL_MARGIN_S = 15.0  # past a worker's grace period (uvicorn's 5 s, then the gateway's drain)
REUSEPORT_ENV = "MULTIPLEXER_WORKERS_REUSEPORT"


@dataclass
class Plan:
    """What every worker runs: ``multiplexer serve`` with these arguments."""

    config: str
    host: str
    port: int
    count: int
    grace_s: float
    verbose: bool = False

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "multiplexer", *(["-v"] if self.verbose else []), "serve",
                "--config", self.config, "--host", self.host, "--port", str(port)]


def reuse_port_available() -> bool:
    """Whether workers can each bind the port (SO_REUSEPORT), unless the environment says no."""
    if os.environ.get(REUSEPORT_ENV, "1") == "0" or not hasattr(socket, "SO_REUSEPORT"):
        return False
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        return False
    return True


class Supervisor:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.reuse_port = reuse_port_available()
        # held for the parent's life: the port stays ours while workers come and go
        self.sock = bind(plan.host, plan.port, reuse_port=self.reuse_port)
        if not self.reuse_port:
            self.sock.listen(2048)
        self.port = self.sock.getsockname()[1]
        self.folder = tempfile.mkdtemp(prefix="multiplexer-workers-")
        self.live: dict[int, anyio.abc.Process] = {}
        self.stop = anyio.Event()
        self.stopping = False
        self.failed: str | None = None
        self._starting: anyio.CancelScope | None = None  # the start of the workers, while on
        self.codes: dict[int, int] = {}
        self.serving: set[int] = set()  # workers that said they serve (and so handle SIGHUP)

    def url(self) -> str:
        host = self.plan.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            self.sock.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    async def _run(self) -> int:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as self._starting:  # a signal now stops the start
                    tg.start_soon(self._on_signal, signals)
                    async with anyio.create_task_group() as starting:
                        for index in range(self.plan.count):
                            starting.start_soon(tg.start, self._keep, index)
                if not self.stop.is_set():
                    pids = ", ".join(str(self.live[i].pid) for i in sorted(self.live))
                    log.info("multiplexer listening on %s (%d workers, pids %s)", self.url(),
                             self.plan.count, pids)
                await self.stop.wait()
                await self._drain()
                tg.cancel_scope.cancel()
        if self.failed is not None:
            log.error("%s", self.failed)
            return 1
        # -SIGTERM: a worker stopped before it could serve (so before it had anything to drain)
        unclean = {i: c for i, c in sorted(self.codes.items()) if c not in (0, -signal.SIGTERM)}
        if unclean:
            log.error("workers that did not stop cleanly (index: exit code): %s", unclean)
            return 1
        log.info("every worker drained; stopped")
        return 0

    async def _on_signal(self, signals: AsyncIterator[int]) -> None:
        async for sig in signals:
            if sig == signal.SIGHUP:
                self._relay_hangup()
                continue
            log.info("received %s: draining %d workers", signal.Signals(sig).name, len(self.live))
            self.stop.set()
            if self._starting is not None:  # workers still starting are stopped with the others
                self._starting.cancel()
            return

    def _relay_hangup(self) -> None:
        """SIGHUP: every worker that serves reads the config file again (``gateway/reload.py``);
        one still starting reads it as it starts, and is not signalled (it may not handle it yet)."""
        ready = [p for i, p in sorted(self.live.items()) if i in self.serving and p.returncode is None]
        log.info("received SIGHUP: %d of %d workers reload the config", len(ready), self.plan.count)
        for process in ready:
            process.send_signal(signal.SIGHUP)

    async def _drain(self) -> None:
        """SIGTERM to every worker; each drains in its own grace period, then is killed."""
        self.stopping = True
        for process in list(self.live.values()):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(self.plan.grace_s + KILL_MARGIN_S):
            for index, process in list(self.live.items()):
                self.codes[index] = await process.wait()
            return
        for index, process in list(self.live.items()):
            if process.returncode is None:
                log.error("worker %d (pid %d) did not stop in time: killed", index, process.pid)
                process.kill()
            self.codes[index] = await process.wait()

    async def _start(self, index: int) -> tuple[anyio.abc.Process, bool]:
        """Start worker ``index``; (its process, whether it said it serves before exiting)."""
        read_fd, write_fd = os.pipe()
        fds = [write_fd] if self.reuse_port else [write_fd, self.sock.fileno()]
        slot = Slot(index, self.plan.count, self.folder,
                    fd=None if self.reuse_port else self.sock.fileno(), ready_fd=write_fd)
        try:
            process = await anyio.open_process(
                self.plan.command(self.port), stdin=subprocess.DEVNULL, stdout=None, stderr=None,
                env={**os.environ, WORKER_ENV: slot.to_env()}, pass_fds=fds)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.live[index] = process  # from now on a drain signals it, ready or not
        self.serving.discard(index)
        try:
            await anyio.wait_readable(read_fd)
            said = os.read(read_fd, 1) == b"r"  # b"": it exited (the pipe closed) first
            if said:
                self.serving.add(index)
        finally:
            os.close(read_fd)
        return process, said

    async def _keep(self, index: int, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run worker ``index`` until the parent stops; started again each time it dies."""
        process, ready = await self._start(index)
        if not ready:
            code = await process.wait()
            self.failed = f"worker {index} exited with code {code} before serving: stopping"
            self.stop.set()
            task_status.started()
            return
        task_status.started()
        failures = 0
        while True:
            started = time.monotonic()
            code = await process.wait()
            if self.stopping:
                return
            failures = 0 if time.monotonic() - started >= STABLE_S else failures + 1
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, failures - 1))
            log.warning("worker %d (pid %d) exited with code %s: starting it again in %.1f s",
                        index, process.pid, code, delay)
            with anyio.move_on_after(delay):
                await self.stop.wait()
            if self.stopping or self.stop.is_set():
                return
            process, ready = await self._start(index)
            if ready:
                log.info("worker %d serves again (pid %d)", index, process.pid)


def supervise(plan: Plan) -> int:
    """Run ``plan.count`` workers until SIGTERM/SIGINT; the parent's exit status."""
    return anyio.run(Supervisor(plan).run)
