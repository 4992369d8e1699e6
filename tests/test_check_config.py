"""``check-config`` checks what a valid config names on this machine: the programs and scripts its
stdio children start, found where the provider would look for them (its ``cwd``, else the config's
folder; a bare command on PATH); and that a route listing ``models:`` answers something ``/v1``
serves. Each problem is one line naming the provider or route, the field and the fix."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import load_config
from multiplexer.gateway.config_checks import problems

FIX_SCRIPT = ("put it there, name it by its full path, or start a module instead "
              "(command: python, args: [-m, package.module])")
FIX_OPERATION = "add operation: chat, operation: embeddings or operation: messages"


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "multiplexer", "check-config", str(path)],
                          capture_output=True, text=True, timeout=120)


def written(folder: Path, data: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gateway.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def problems_of(folder: Path, data: dict[str, Any]) -> list[str]:
    return problems(load_config(written(folder, data)))


def test_a_broken_copy_of_the_default_config_fails_naming_each_provider_field_and_fix(
        tmp_path: Path) -> None:
    """The copy names its upstream as a script beside it (which it is not), and its chat route
    lost its operation: today's ``ok`` for a config whose MCP tools and chat model never answer."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["providers"]["tools"]["args"] = ["demo_tools.py"]
    del data["routes"]["chat"]["operation"]
    folder = tmp_path / "copy"
    done = check_config(written(folder, data))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "invalid config:\n"
        f"  providers.tools.args: no script demo_tools.py in {folder} (the child's folder: its cwd, "
        f"else the config's); {FIX_SCRIPT}\n"
        "  routes.chat: lists models (mock-gpt) but no operation, so /v1 refuses them (the route "
        f"answers call); {FIX_OPERATION}\n")
    (folder / "demo_tools.py").write_text("")  # the script beside the copy: that line goes
    data["routes"]["chat"]["operation"] = "chat"
    done = check_config(written(folder, data))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.endswith(": ok (4 providers, 7 routes)\n")


def mcp(**settings: Any) -> dict[str, Any]:
    return {"providers": {"tools": {"kind": "mcp", **settings}}, "routes": {"t_*": {"provider": "tools"}}}


def test_a_stdio_command_must_be_on_path_or_at_its_path(tmp_path: Path) -> None:
    assert problems_of(tmp_path, mcp(command="no-such-program-3f9a")) == [
        "providers.tools.command: no program 'no-such-program-3f9a' on PATH; install it, or name it "
        "by its path"]
    assert problems_of(tmp_path, mcp(command="./bin/serve")) == [
        f"providers.tools.command: no program {tmp_path / 'bin' / 'serve'} (a relative command is the "
        f"child's folder's: {tmp_path}); fix the path, or name a program on PATH"]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "serve").write_text("#!/bin/sh\n")
    assert problems_of(tmp_path, mcp(command="./bin/serve")) == [
        f"providers.tools.command: {tmp_path / 'bin' / 'serve'} is not executable; chmod +x it"]
    (tmp_path / "bin" / "serve").chmod(0o755)
    assert problems_of(tmp_path, mcp(command="./bin/serve")) == []
    assert problems_of(tmp_path, mcp(command="serve", cwd="bin")) == [  # a bare name is PATH's, not cwd's
        "providers.tools.command: no program 'serve' on PATH; install it, or name it by its path"]
    assert problems_of(tmp_path, mcp(command="serve", env={"PATH": str(tmp_path / "bin")})) == []
    assert problems_of(tmp_path, mcp(command=shutil.which("sh"))) == []
    assert problems_of(tmp_path, mcp(command="python")) == []  # the gateway's own interpreter
    assert problems_of(tmp_path, mcp(command="python3", args=["-m", "mod"])) == []


def test_scripts_are_found_where_the_child_runs(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "server.py").write_text("")
    assert problems_of(tmp_path, mcp(command="python", args=["tools/server.py", "--port", "1"])) == []
    assert problems_of(tmp_path, mcp(command="python", args=["server.py"], cwd="tools")) == []
    assert problems_of(tmp_path, mcp(command="python", args=[str(tmp_path / "tools" / "server.py")])) == []
    # not scripts: options, code after -c, anything not ending in .py
    assert problems_of(tmp_path, mcp(command="python", args=["-c", "open('x.py')", "--log=a.py", "y"])) == []
    assert problems_of(tmp_path, mcp(command="python", args=["-u", "server.py"])) == [
        f"providers.tools.args: no script server.py in {tmp_path} (the child's folder: its cwd, else the "
        f"config's); {FIX_SCRIPT}"]
    assert problems_of(tmp_path, mcp(command="python", args=["server.py"], cwd="nowhere")) == [
        f"providers.tools.cwd: no folder {tmp_path / 'nowhere'}; create it, or name the folder the "
        "child runs in"]


def test_http_upstreams_and_other_kinds_name_nothing_to_find(tmp_path: Path) -> None:
    data = {"providers": {"h": {"kind": "mcp", "url": "http://127.0.0.1:1/mcp"}, "e": {"kind": "echo"}},
            "routes": {"h_*": {"provider": "h"}, "echo": {"provider": "e"}}}
    assert problems_of(tmp_path, data) == []


def test_a_route_with_models_must_answer_what_v1_serves(tmp_path: Path) -> None:
    data = {"providers": {"m": {"kind": "mock"}, "e": {"kind": "echo"}},
            "routes": {"chat": {"provider": "m", "models": ["mock-gpt", "gpt-x"]},
                       "plain": {"provider": "e", "operation": "call", "models": ["plain-1"]},
                       "served": {"provider": "m", "operation": "messages", "models": ["c"]},
                       "echo": {"provider": "e"}}}
    assert problems_of(tmp_path, data) == [
        f"routes.chat: lists models (mock-gpt, gpt-x) but no operation, so /v1 refuses them (the route "
        f"answers call); {FIX_OPERATION}",
        f"routes.plain: lists models (plain-1) but operation call, so /v1 refuses them (the route "
        f"answers call); {FIX_OPERATION}"]


def test_a_local_route_answers_its_models_task_without_an_operation(tmp_path: Path) -> None:
    """The default's ``embed_local`` lists models and no operation: its model's task serves /v1."""
    config = load_config(DEFAULT_CONFIG)
    assert "operation" not in config.routes["embed_local"].model_fields_set
    assert problems(config) == []


def test_check_config_is_ok_on_every_shipped_config() -> None:
    for path in [DEFAULT_CONFIG, *sorted((Path(__file__).parents[1] / "config").glob("*.yaml"))]:
        assert problems(load_config(path)) == [], path
