"""Every code block of README.md runs as written, against the config it names.

The blocks are read from README.md when the tests are collected; nothing of them is copied here.

- A block's config is named by a comment on its first line, ``# config: PATH`` (PATH from the
  repository root); without one it is ``DEFAULT_CONFIG``, the config ``multiplexer serve`` uses.
- ``python`` blocks run as scripts, each in a subprocess of this interpreter, against a gateway this
  module starts on the block's config on a free port. ``127.0.0.1:8080`` in the block becomes that
  gateway's address: the only substitution.
- ``bash`` blocks run in bash from the repository root, with ``python3`` and ``python`` this
  interpreter (scripts that exec it: in a virtual environment, a link would start the base
  interpreter, without the environment's packages). A block that names ``127.0.0.1:8080`` gets a
  gateway the same way. The commands in ``NOT_RUN`` are left out (why beside each); everything
  else in the block runs.
- Each module's gateways, and each block, have a data directory of their own (the default store's
  folder), never the user's.
- ``yaml`` blocks that are whole configs (their top-level keys are config sections) must parse
  with the gateway's loader, ``parse_config``, ``${VAR}`` read as set; other YAML must parse.
- Any other language fails: the README shows nothing this test cannot run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.md_helpers import ROOT, Block, check_config, code_blocks, whole_config

README = ROOT / "README.md"
DEFAULT_CONFIG = "multiplexer/defaults/default.yaml"
ADDRESS = "127.0.0.1:8080"
RUN_TIMEOUT_S = 240

# Commands of the README's bash blocks this test does not run (a line's commands joined by && are
# taken one by one). Keep this set tiny: every other command in the README runs.
NOT_RUN = {
    # the venv line: the test runs in the interpreter the suite already runs in, a fresh venv
    # when CI's second step (.ci/run) made one as this line says
    "python3 -m venv": "creates a virtual environment",
    ". .venv/bin/activate": "activates that virtual environment",
    # the suite runs on the installed package; installing from inside a test would change the
    # environment under the tests running beside it (and needs the network)
    "python3 -m pip install": "installs the package",
    # the test command is the suite itself: running it from a test would recurse
    "python3 -m pytest": "runs this suite",
}

BLOCKS = code_blocks(README)


def config_of(block: Block) -> str:
    m = re.match(r"#\s*config:\s*(\S+)", block.first_line)
    return m.group(1) if m else DEFAULT_CONFIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(bin_dir: Path) -> dict[str, str]:
    """This checkout's code first on the path, and ``python3`` / ``python`` this interpreter."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1"}


def python_shims(bin_dir: Path, executable: str) -> None:
    """``python3`` and ``python`` in ``bin_dir``, each a script that execs ``executable``. Not a
    link: a virtual environment's interpreter finds its packages from the path it was started by
    (``pyvenv.cfg`` one folder up), so through a link in another folder it starts as the base
    interpreter, and ``python3 -m multiplexer`` fails with ``No module named 'anyio'``."""
    for name in ("python3", "python"):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(executable)} "$@"\n')
        shim.chmod(0o755)


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bin")
    python_shims(d, sys.executable)
    return d


class Gateways:
    """One ``multiplexer serve`` process per config, started on first use, stopped at the end."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.running: dict[str, tuple[subprocess.Popen[bytes], str, Path]] = {}

    def url(self, config: str) -> str:
        if config not in self.running:
            self.running[config] = self._start(config)
        return self.running[config][1]

    def _start(self, config: str) -> tuple[subprocess.Popen[bytes], str, Path]:
        path = ROOT / config
        assert path.is_file(), f"the README's config {config} does not exist"
        port = free_port()
        log = self.logs / f"gateway-{len(self.running)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "multiplexer", "serve", "--config", str(path), "--port", str(port)],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"multiplexer serve --config {config} exited {proc.returncode}:\n"
                                     + log.read_text()[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return proc, url, log
            time.sleep(0.3)
        self._stop(proc)
        raise AssertionError(f"multiplexer serve --config {config}: no /healthz in 180 s:\n"
                             + log.read_text()[-4000:])

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def stop_all(self) -> None:
        for proc, _, _ in self.running.values():
            self._stop(proc)


@pytest.fixture(scope="module")
def gateways(bin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    env = {**child_env(bin_dir), "XDG_DATA_HOME": str(tmp_path_factory.mktemp("data"))}
    gws = Gateways(env, tmp_path_factory.mktemp("gateways"))
    try:
        yield gws
    finally:
        gws.stop_all()


def runnable_bash(text: str) -> str:
    """The block as a script, the ``NOT_RUN`` commands left out."""
    lines: list[str] = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        commands = [c.strip() for c in line.split(" && ")]
        kept = [c for c in commands if not any(c.startswith(prefix) for prefix in NOT_RUN)]
        if kept:
            lines.append(" && ".join(kept))
    return "\n".join(lines)


def run(argv: list[str], env: dict[str, str], what: str) -> None:
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (f"{what} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                  f"\n--- stderr\n{proc.stderr[-4000:]}")


@pytest.mark.timeout(RUN_TIMEOUT_S + 200)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_readme_block_runs(block: Block, gateways: Gateways, bin_dir: Path) -> None:
    env = child_env(bin_dir)
    if block.lang == "python":
        source = block.text.replace(ADDRESS, gateways.url(config_of(block)).removeprefix("http://"))
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(source)
        try:
            run([sys.executable, f.name], env, f"README block at line {block.line} (python)")
        finally:
            os.unlink(f.name)
    elif block.lang in ("bash", "sh", "shell", "console"):
        script = runnable_bash(block.text)
        if ADDRESS in script:
            script = script.replace(ADDRESS, gateways.url(config_of(block)).removeprefix("http://"))
        if script:
            run(["bash", "-e", "-o", "pipefail", "-c", script], env,
                f"README block at line {block.line} (bash: {shlex.quote(script[:200])})")
    elif block.lang in ("yaml", "yml"):
        if whole_config(block) is not None:
            check_config(block)
        else:
            yaml.safe_load(block.text)
    else:
        pytest.fail(f"README block at line {block.line}: no way to run a {block.lang or 'plain'} block; "
                    "use python, bash or yaml")


def test_quickstart_is_two_commands_and_ci_runs_the_second() -> None:
    """The quickstart block holds exactly the two commands, and .ci/run runs each part of the
    README's test command as written (on one line or one per line; pip's -q aside)."""
    quickstart = next(b for b in BLOCKS if b.lang == "bash" and "multiplexer demo" in b.text)
    commands = [line for line in quickstart.text.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2 and "python3 -m pytest" in commands[1], commands
    ci_commands = {part.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   for part in line.replace(" -q ", " ").split(" && ")}
    missing = [part for part in commands[1].split(" && ") if part.strip() not in ci_commands]
    assert not missing, f".ci/run does not run {missing} as the README writes it"


PREFIX = "import sys; print(sys.prefix)"


def test_python3_in_the_blocks_is_this_interpreter(bin_dir: Path) -> None:
    done = subprocess.run(["python3", "-c", PREFIX], env=child_env(bin_dir), capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == sys.prefix


def test_python3_in_the_blocks_keeps_a_virtual_environments_packages(tmp_path: Path) -> None:
    """The blocks' ``python3`` started from a virtual environment is that environment, not the base
    interpreter it was made from (a link to it was: the README's commands then lacked every package)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (tmp_path / "bin").mkdir()
    python_shims(tmp_path / "bin", str(venv / "bin" / "python3"))
    done = subprocess.run([str(tmp_path / "bin" / "python3"), "-c", PREFIX], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == str(venv)


def test_ci_runs_the_test_command_again_in_a_fresh_virtual_environment() -> None:
    """After the machine's run, .ci/run makes a virtual environment as the README does (no system
    site-packages: only what the install brings), activates it and runs the README's test command
    there, where the quickstart's user runs it."""
    quickstart = next(b for b in BLOCKS if b.lang == "bash" and "multiplexer demo" in b.text)
    test_command = next(line for line in quickstart.text.splitlines() if "python3 -m pytest" in line)
    lines = [line.split("  #")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    lines = [line.replace(" -q ", " ") for line in lines if line and not line.startswith("#")]
    assert "--system-site-packages" not in "\n".join(lines)
    made = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv "))
    venv = lines[made].removeprefix("python3 -m venv ").strip('"')
    assert lines[made + 1].replace('"', "") == f". {venv}/bin/activate", lines[made:made + 2]
    missing = [part for part in test_command.split(" && ") if part.strip() not in lines[made + 2:]]
    assert not missing, f".ci/run does not run {missing} in its virtual environment"
