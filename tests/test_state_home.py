"""Where keys, spend and jobs live: the default store in the user's data directory (not the folder
``serve`` starts in), what ``serve`` says about it on its first line and ``multiplexer paths``
prints, and a store left in the working folder that changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from pydantic import SecretStr

from multiplexer.access.admin import ENV
from multiplexer.cli import main
from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import load_config, parse_config
from multiplexer.server import running
from multiplexer.state_paths import store_shown
from tests.checkout_helpers import left_behind, untracked
from tests.test_ui_api import ADMIN, AS_ADMIN, echo_config

ROOT = Path(__file__).resolve().parent.parent
ECHO = {"providers": {"e": {"kind": "echo"}}, "routes": {"echo": {"provider": "e"}}}
CALL = {"jsonrpc": "2.0", "id": 1, "method": "echo", "params": {"hi": 1}}


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)


def data_home() -> Path:
    return Path(os.environ["XDG_DATA_HOME"]) / "multiplexer"


def test_the_default_store_is_in_the_users_data_directory(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(DEFAULT_CONFIG).store.path == str(data_home() / "multiplexer.db")
    assert parse_config(ECHO).store.path == str(data_home() / "multiplexer.db")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "elsewhere"))  # read when a config is made
    assert parse_config(ECHO).store.path == str(tmp_path / "elsewhere" / "multiplexer" / "multiplexer.db")
    # a path the config writes keeps its meaning: relative to the config file's folder
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "gw.yaml").write_text(yaml.safe_dump({**ECHO, "store": {"path": "state/jobs.db"}}))
    assert load_config(conf / "gw.yaml").store.path == str(conf / "state" / "jobs.db")


@pytest.mark.anyio
async def test_the_default_store_is_made_on_first_use(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    config = parse_config({**ECHO, "server": {"admin_key": ADMIN}})  # the key store opens the store
    async with running(config, port=0) as (_, url), httpx.AsyncClient(base_url=url) as http:
        made = await http.post("/admin/keys", json={"name": "k"}, headers=AS_ADMIN)
        assert made.status_code == 201, made.text
    assert (tmp_path / "data" / "multiplexer" / "multiplexer.db").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing in the working folder


@pytest.mark.anyio
@pytest.mark.parametrize("config", ["ui_api", "default"])
async def test_a_keyed_store_in_the_working_folder_changes_nothing(
        config: str, tmp_path: Path, monkeypatch: Any) -> None:
    """A ``multiplexer.db`` holding a live key in the working folder, where an operator's earlier
    ``serve`` left it: a gateway that read it would make callers present a key. The dashboard
    tests' configs on the default store serve keyless callers and list no stored key."""
    left = tmp_path / "left"
    left.mkdir()
    async with (running(parse_config({**ECHO, "server": {"admin_key": ADMIN},
                                      "store": {"path": str(left / "multiplexer.db")}}), port=0) as (_, url),
                httpx.AsyncClient(base_url=url) as http):
        assert (await http.post("/admin/keys", json={"name": "left"}, headers=AS_ADMIN)).status_code == 201
    monkeypatch.chdir(left)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    if config == "ui_api":  # the dashboard API tests' echo gateway, on the default store
        gateway = echo_config(None, admin_key=ADMIN)
    else:  # the browser test's
        gateway = load_config(DEFAULT_CONFIG)
        gateway.server.admin_key = SecretStr(ADMIN)
    async with running(gateway, port=0) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as http:
        answer = await http.post("/rpc", json=CALL)
        assert answer.status_code == 200 and answer.json()["result"] == {"hi": 1}, answer.text
        assert (await http.get("/admin/keys", headers=AS_ADMIN)).json()["data"] == []
    assert gateway.store.path == str(tmp_path / "data" / "multiplexer" / "multiplexer.db")


async def first_line(config: Path, cwd: Path) -> str:
    """``multiplexer serve``'s first line on stderr, once it serves; then it is stopped."""
    argv = [sys.executable, "-m", "multiplexer", "serve", "--config", str(config), "--port", "0"]
    async with await anyio.open_process(argv, cwd=cwd) as proc:
        assert proc.stderr is not None
        seen = b""
        try:
            with anyio.fail_after(60):
                async for chunk in proc.stderr:
                    seen += chunk
                    if b"listening on" in seen:
                        break
        finally:
            proc.terminate()
    assert b"listening on" in seen, seen.decode()
    return seen.decode().splitlines()[0]


@pytest.mark.anyio
async def test_serve_says_first_where_keys_spend_and_jobs_live(tmp_path: Path) -> None:
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump({**ECHO, "store": {"path": "jobs.db"}}))
    line = await first_line(tmp_path / "gw.yaml", ROOT)
    assert line.endswith(f"multiplexer.state_paths: keys, spend and jobs in {tmp_path / 'jobs.db'}"), line
    (tmp_path / "default.yaml").write_text(yaml.safe_dump(ECHO))
    line = await first_line(tmp_path / "default.yaml", tmp_path)
    assert line.endswith(f"keys, spend and jobs in {data_home() / 'multiplexer.db'}"), line


def test_a_postgresql_store_is_named_with_its_password_hidden() -> None:
    store = parse_config({**ECHO, "store": {"url": "postgresql://mx:hunter2@db:5432/jobs"}}).store
    assert store_shown(store) == "postgresql://mx:***@db:5432/jobs (schema multiplexer)"


def paths_of(capsys: Any, *argv: str) -> dict[str, str]:
    assert main(["paths", *argv]) == 0
    out = capsys.readouterr().out
    return dict(line.split(None, 1) for line in out.splitlines())


def test_paths_prints_where_a_configs_state_lives(tmp_path: Path, capsys: Any) -> None:
    assert paths_of(capsys) == {
        "config": str(DEFAULT_CONFIG),
        "store": str(data_home() / "multiplexer.db"),
        "uploads": str(data_home() / "multiplexer.db.uploads"),
        "verdicts": str(Path(os.environ["MULTIPLEXER_CACHE_DIR"]) / "local_compile.json"),  # a local model
    }
    (tmp_path / "pg.yaml").write_text(yaml.safe_dump(
        {**ECHO, "store": {"path": "var/jobs.db", "url": "postgresql://mx:hunter2@db:5432/jobs"}}))
    assert paths_of(capsys, "--config", str(tmp_path / "pg.yaml")) == {  # no local model: no verdicts
        "config": str(tmp_path / "pg.yaml"),
        "store": "postgresql://mx:***@db:5432/jobs (schema multiplexer)",
        "uploads": str(tmp_path / "var" / "jobs.db.uploads"),
    }


def test_paths_names_a_config_it_cannot_read(tmp_path: Path, capsys: Any) -> None:
    assert main(["paths", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_the_checkout_check_sees_a_new_store_and_not_the_caches(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())  # the checkout's
    before = untracked(tmp_path)
    assert before == {".gitignore"}
    (tmp_path / "multiplexer.db").write_bytes(b"")
    for cache in ("pkg/__pycache__/m.pyc", ".hypothesis/x", "benchmarks/results/run.json", "x.egg-info/PKG"):
        (tmp_path / cache).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / cache).write_text("")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.txt").write_text("")
    after = untracked(tmp_path)
    assert after is not None and left_behind(before, after) == ["multiplexer.db", "out/"]
    assert untracked(tmp_path / "pkg" / "__pycache__" / "m.pyc") is None  # not a folder git can read
