"""The official TypeScript MCP SDK (``@modelcontextprotocol/sdk``), installed once with npm into a
cache dir, and a way to run the client scripts in ``tests/ts/`` against it with node.

Issue 54 asks for the relays to be proven with both official SDKs as clients; the Python one is
the gateway's own dependency, the TypeScript one is installed here (``npm install --prefix``) and
reused by every later run. Where node, npm or the registry is missing, the tests that need it skip
with the reason (printed), never fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.legacy_sdk import cache_dir

VERSION = "1.32.2"  # `npm view @modelcontextprotocol/sdk version` when these tests were written
SPEC = f"@modelcontextprotocol/sdk@{VERSION}"
SCRIPTS = Path(__file__).resolve().parent / "ts"
_FAILED: list[str] = []  # why it could not be had, once per process (not an npm try per test)


def sdk_prefix(*, skip: bool = True) -> Path:
    """The npm prefix holding the SDK (``<prefix>/node_modules/@modelcontextprotocol/sdk``), made on
    first use; when it cannot be had, ``pytest.skip`` (or ``RuntimeError`` with ``skip=False``)."""
    home = cache_dir() / "ts-sdk"
    marker = home / ".installed"
    if _FAILED:
        return _unavailable(_FAILED[0], skip)
    try:
        for tool in ("node", "npm"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"{tool} is not on PATH")
        home.parent.mkdir(parents=True, exist_ok=True)
        with (home.parent / "ts-sdk.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # test runs sharing the cache install once, not at once
            installed = home / "node_modules" / "@modelcontextprotocol" / "sdk" / "package.json"
            if not (marker.exists() and marker.read_text() == SPEC and installed.exists()):
                home.mkdir(exist_ok=True)
                subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save",
                                "--fetch-retries", "1", "--prefix", str(home), SPEC],
                               check=True, capture_output=True, timeout=300)
                marker.write_text(SPEC)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _FAILED.append(f"no {SPEC} for the TypeScript client tests: {e} {detail.decode()[-300:]}")
        return _unavailable(_FAILED[0], skip)
    return home


def _unavailable(reason: str, skip: bool) -> Path:
    print(reason)
    if not skip:
        raise RuntimeError(reason)
    pytest.skip(reason)


async def run_script(name: str, config: dict[str, Any], *, timeout: float = 30) -> dict[str, Any]:
    """``node tests/ts/<name>`` with ``config`` as its one argument (JSON); its last stdout line,
    parsed. The script finds the SDK through ``TS_SDK_PREFIX`` (ESM ignores ``NODE_PATH``)."""
    prefix = sdk_prefix()
    env = {**os.environ, "TS_SDK_PREFIX": str(prefix)}
    with anyio.fail_after(timeout):
        done = await anyio.run_process(["node", str(SCRIPTS / name), json.dumps(config)],
                                       env=env, check=False)
    out = done.stdout.decode().strip()
    if done.returncode != 0 or not out:
        raise AssertionError(f"node {name} exited {done.returncode}: {out[-2000:]}\n"
                             f"{done.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result
