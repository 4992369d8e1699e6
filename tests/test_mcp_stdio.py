"""``multiplexer serve --stdio`` as a subprocess, driven by the SDK's stdio client, in both eras."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import psutil
import pytest
import yaml
from mcp import Client, StdioServerParameters

from tests.mcp_helpers import MODES, ROOT, UPSTREAM, grow_and_hear_it, live_children

pytestmark = pytest.mark.anyio



@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {
            "tools": {"kind": "mcp", "command": "python", "args": [UPSTREAM]},
            "builtin": {"kind": "echo"},
        },
        "routes": {"tools_*": {"provider": "tools"}, "echo": {"provider": "builtin"}},
        "store": {"path": str(tmp_path / "store.db")},
    }))
    return path


def gateway_params(config: Path) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable,
                                 args=["-m", "multiplexer", "serve", "--stdio", "--config", str(config)],
                                 cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)})


def gateway_tree(before: set[int]) -> set[int]:
    return live_children() - before


@pytest.mark.parametrize("mode", MODES)
async def test_stdio_gateway_serves_tools_and_leaves_no_process_behind(config_file: Path, mode: str) -> None:
    before = live_children()
    problems: list[Any] = []
    changed = anyio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception):  # e.g. a stray non-JSON line on stdout
            problems.append(message)
        elif isinstance(message, types.ToolListChangedNotification):
            changed.set()

    seen: list[float] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append(value)

    async with Client(gateway_params(config_file), mode=mode, message_handler=on_message) as client:
        assert client.protocol_version == MODES[mode]
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"tools_echo", "tools_add", "tools_sleep", "echo"} <= names
        add = await client.call_tool("tools_add", {"a": 2, "b": 40})
        assert add.structured_content == {"result": 42}
        echo = await client.call_tool("echo", {"x": 1})
        assert echo.structured_content == {"x": 1} and json.loads(echo.content[0].text) == {"x": 1}  # type: ignore[union-attr]
        slept = await client.call_tool("tools_sleep", {"seconds": 0.02, "steps": 2},
                                       progress_callback=progress)
        assert slept.structured_content == {"result": "slept"} and seen == [1, 2]
        tree = gateway_tree(before)
        assert len(tree) == 2  # the gateway and its upstream child

        await grow_and_hear_it(client, changed)
        assert "tools_shout" in {t.name for t in (await client.list_tools(cache_mode="bypass")).tools}
    assert problems == []
    assert not (tree & live_children())


@pytest.mark.parametrize("how", ["stdin_closed", "sigterm"])
async def test_stdio_gateway_exits_cleanly_and_reaps_its_upstream(config_file: Path, how: str) -> None:
    params = gateway_params(config_file)
    proc = subprocess.Popen([params.command, *params.args], cwd=params.cwd, env=params.env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        proc.stdin.write(json.dumps(init).encode() + b"\n")
        proc.stdin.flush()
        reply = json.loads(await anyio.to_thread.run_sync(proc.stdout.readline))
        assert reply["id"] == 1 and reply["result"]["serverInfo"]["name"] == "multiplexer"
        children = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(children) == 1  # the upstream, started before the gateway answered
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.stdin.close()
        code = await anyio.to_thread.run_sync(proc.wait, 30)
        assert code == 0
        assert not (children & live_children())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_stdin_lines_drop_a_message_over_the_cap_and_go_on() -> None:
    """An endless line must not grow the buffer without bound; the next message still arrives."""
    from multiplexer.faces.mcp.stdio import Lines

    send, receive = anyio.create_memory_object_stream[bytes](16)
    lines = Lines(receive, max_line=100)
    async with send:
        for chunk in (b'{"a":1}\n{"b"', b":2}\n", b"x" * 80, b"x" * 80, b"y" * 500, b"y\n", b'{"c":3}'):
            await send.send(chunk)
    got = [line async for line in lines]
    assert got == ['{"a":1}', '{"b":2}', '{"c":3}']
    assert len(lines._buffer) == 0
