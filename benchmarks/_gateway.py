"""A real gateway child process for the reliability runs: config file, log file, RSS, metrics.

Unlike ``_procs.child`` a child's output goes to a file, never to an unread pipe: a
fuzz run makes the upstream log a traceback per odd input, and a full 64 KiB pipe
froze it mid-run. The gateway's log is read afterwards for tracebacks.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks._procs import free_port, logged_child


@dataclass
class GatewayProc:
    url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tracebacks(self) -> int:
        return self.log().count("Traceback (most recent call last)")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over the series whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@contextlib.contextmanager
def upstream(script: str, *extra: str) -> Iterator[str]:
    """An example upstream (``examples/...py --port``) on a free port; yields its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp, \
            logged_child([script, "--port", str(port), *extra], f"{url}/", Path(tmp) / "upstream.log"):
        yield url


@contextlib.contextmanager
def gateway(config_yaml: str, env: dict[str, str] | None = None) -> Iterator[GatewayProc]:
    """``python -m multiplexer serve`` on a free port; ``{port}`` in the YAML is filled in."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "gateway.yaml"
        conf.write_text(config_yaml.replace("{port}", str(port)))
        with _served(["-m", "multiplexer", "serve", "--config", str(conf)], port, Path(tmp), env) as proc:
            yield proc


@contextlib.contextmanager
def http_floor() -> Iterator[GatewayProc]:
    """The gateway's HTTP server with a trivial app behind it (``benchmarks/_http_floor.py``)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            _served(["-m", "benchmarks._http_floor", str(port)], port, Path(tmp)) as proc:
        yield proc


@contextlib.contextmanager
def _served(args: list[str], port: int, tmp: Path,
            env: dict[str, str] | None = None) -> Iterator[GatewayProc]:
    url = f"http://127.0.0.1:{port}"
    log_path = tmp / "server.log"
    with logged_child(args, f"{url}/healthz", log_path, env) as proc:
        yield GatewayProc(url, proc, log_path)


@dataclass
class RssSampler:
    """Samples a process's RSS on a thread; ``mark`` names phases for per-phase peaks."""

    pid: int
    interval: float = 0.02
    samples: list[tuple[float, str, int]] = field(default_factory=list)
    phase: str = "start"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        proc = psutil.Process(self.pid)

        def loop() -> None:
            while not self._stop.is_set():
                with contextlib.suppress(psutil.Error):
                    self.samples.append((time.monotonic(), self.phase, proc.memory_info().rss))
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mark(self, phase: str) -> None:
        self.phase = phase

    def peak(self, phase: str | None = None) -> int:
        return max((rss for _, p, rss in self.samples if phase is None or p == phase), default=0)

    def series(self, phase: str) -> list[int]:
        return [rss for _, p, rss in self.samples if p == phase]
