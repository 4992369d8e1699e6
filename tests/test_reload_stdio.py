"""``serve --stdio`` reloads its config on SIGHUP, and a changed MCP upstream that the gateway
started at start-up is closed (its child process gone) once it has drained, not at exit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import yaml

from tests.mcp_helpers import ROOT, UPSTREAM, live_children

pytestmark = pytest.mark.anyio


def config(tmp_path: Path, *, backoff: int, routes: dict[str, Any]) -> dict[str, Any]:
    return {"providers": {"tools": {"kind": "mcp", "command": "python", "args": [UPSTREAM],
                                    "restart_backoff_ms": backoff},
                          "builtin": {"kind": "echo"}},
            "routes": {"tools_*": {"provider": "tools"}, **routes},
            "store": {"path": str(tmp_path / "store.db")}}


def write(path: Path, data: dict[str, Any]) -> None:
    """Beside the old file, then renamed over it (a reload never reads it half written)."""
    new = path.with_suffix(".new")
    new.write_text(yaml.safe_dump(data))
    new.replace(path)


class Frames:
    """The gateway's stdout, a JSON-RPC frame a line."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin, self.stdout = proc.stdin, proc.stdout

    def send(self, message: dict[str, Any]) -> None:
        self.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        self.stdin.flush()

    async def until(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        with anyio.fail_after(30):
            while True:
                line = await anyio.to_thread.run_sync(self.stdout.readline, abandon_on_cancel=True)
                assert line, "the gateway closed its stdout"
                frame: dict[str, Any] = json.loads(line)
                if wanted(frame):
                    return frame

    async def call(self, n: int, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        self.send({"id": n, "method": "tools/call", "params": {"name": tool, "arguments": arguments}})
        reply = await self.until(lambda f: f.get("id") == n)
        assert "result" in reply, reply
        return reply["result"]  # type: ignore[no-any-return]


async def test_sighup_reloads_serve_stdio_and_closes_the_changed_upstream(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(tmp_path, backoff=20, routes={}))
    proc = subprocess.Popen([sys.executable, "-m", "multiplexer", "serve", "--stdio", "--config", str(path)],
                            cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        io = Frames(proc)
        io.send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}})
        assert (await io.until(lambda f: f.get("id") == 1))["result"]["serverInfo"]["name"] == "multiplexer"
        io.send({"method": "notifications/initialized"})
        first = (await io.call(2, "tools_pid", {}))["structuredContent"]["result"]
        assert {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} == {first}
        old = psutil.Process(first)

        # the upstream's settings change (it is started anew) and a route is added
        write(path, config(tmp_path, backoff=30, routes={"again": {"provider": "builtin"}}))
        proc.send_signal(signal.SIGHUP)
        await io.until(lambda f: f.get("method") == "notifications/tools/list_changed")
        # the old upstream had no call in flight: drained at once, and closed, its child reaped
        gone = await anyio.to_thread.run_sync(lambda: psutil.wait_procs([old], 20)[0])
        assert [p.pid for p in gone] == [first]
        second = (await io.call(3, "tools_pid", {}))["structuredContent"]["result"]
        assert second != first
        assert {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} == {second}
        assert (await io.call(4, "again", {"x": 1}))["structuredContent"] == {"x": 1}

        io.stdin.close()  # and it still stops cleanly, reaping the new upstream
        assert await anyio.to_thread.run_sync(proc.wait, 30) == 0
        assert second not in live_children()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
