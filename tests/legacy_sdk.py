"""A Python with the ``mcp`` 1.x SDK, in its own venv in a cache dir, for handshake-era-only servers.

The gateway's own SDK (2.x) serves both eras, so an upstream built on it always
agrees with the gateway; the era matrix needs a server that speaks only the
older protocol, as every server built on an SDK before 2026-07-28 does. The
venv is made once (``pip install "mcp<2"``) and reused; where it cannot be made,
the tests that need it skip with the reason.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

SPEC = "mcp>=1.20,<2"


def cache_dir() -> Path:
    base = os.environ.get("MULTIPLEXER_TEST_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base or Path.home() / ".cache") / "multiplexer-tests"


def legacy_python(*, skip: bool = True) -> str:
    """The venv's interpreter, made on first use; when it cannot be had, ``pytest.skip``
    (or ``RuntimeError`` with ``skip=False``, for benchmarks)."""
    home = cache_dir() / "mcp1-venv"
    python = home / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    marker = home / ".installed"
    try:
        home.parent.mkdir(parents=True, exist_ok=True)
        with (home.parent / "mcp1-venv.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # test runs sharing the cache make it once, not at once
            if not (marker.exists() and marker.read_text() == SPEC and python.exists()):
                venv.EnvBuilder(with_pip=True, clear=True).create(home)
                subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                SPEC], check=True, capture_output=True, timeout=600)
                marker.write_text(SPEC)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        reason = f"no venv with {SPEC} for the handshake-era upstream: {e} {detail.decode()[-300:]}"
        print(reason)
        if not skip:
            raise RuntimeError(reason) from e
        pytest.skip(reason)
    return str(python)
