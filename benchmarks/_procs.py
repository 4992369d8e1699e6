"""Benchmark plumbing: start servers as child processes on free ports and wait until they answer."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def logged_child(args: list[str], ready_url: str, log_path: Path,
                 env: dict[str, str] | None = None, program: str | None = None,
                 ) -> Iterator[subprocess.Popen]:
    """A Python child (or ``program``) whose output goes to ``log_path``; terminated (then
    killed) on exit."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen([program or sys.executable, *args], cwd=ROOT,
                                env={**os.environ, **(env or {})}, stdout=log, stderr=log)
        try:
            wait_http(ready_url)
            if proc.poll() is not None:  # something else answered on our port (it was taken)
                raise RuntimeError(f"{args[0]} exited at start: {log_path.read_text()[-500:]}")
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def child(args: list[str], ready_url: str, env: dict[str, str] | None = None,
          program: str | None = None) -> Iterator[subprocess.Popen]:
    """A Python child logging to a temporary file (never an unread pipe, which can fill and freeze it)."""
    with tempfile.TemporaryDirectory() as tmp, \
            logged_child(args, ready_url, Path(tmp) / "child.log", env, program) as proc:
        yield proc


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, data: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
