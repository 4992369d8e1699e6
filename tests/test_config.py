"""Config validation names the key path; env expansion; the router; the CLI check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from multiplexer.core.router import Router
from multiplexer.gateway.config import ConfigError, load_config, parse_config

CONTRACT = """
server: {host: 127.0.0.1, port: 8080}
providers:
  calc:
    kind: jsonrpc
    url: http://127.0.0.1:9001/
    batch: {max_items: 100, max_wait_ms: 2}
    limits: {rpm: 600000, concurrency: 16}
routes:
  subtract: {provider: calc}
  sum: {provider: calc, dedup: true}
  get_data: {provider: calc}
  notify_hello: {provider: calc}
"""


def test_contract_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CONTRACT)
    config = load_config(path)
    assert config.providers["calc"].batch.max_items == 100
    assert config.routes["sum"].dedup is True
    assert config.providers["calc"].extra == {"url": "http://127.0.0.1:9001/"}


@pytest.mark.parametrize("data,expected", [
    ({"providers": {"p": {"kind": "jsonrpc", "url": "x", "batch": {"max_items": 0}}}},
     "providers.p.batch.max_items: Input should be greater than or equal to 1"),
    ({"providers": {"p": {"kind": "nope"}}}, "providers.p.kind: unknown provider kind 'nope'"),
    ({"providers": {"p": {"kind": "jsonrpc"}}}, "providers.p.url: Field required"),
    ({"providers": {"p": {"kind": "jsonrpc", "url": "u", "typo": 1}}},
     "providers.p.typo: Extra inputs are not permitted"),
    ({"routes": {"r": {"provider": "ghost"}}}, "routes.r.provider: unknown provider 'ghost'"),
    ({"server": {"port": "eighty"}}, "server.port: Input should be a valid integer"),
    ({"server": {"bogus": 1}}, "server.bogus: Extra inputs are not permitted"),
])
def test_invalid_config_names_the_key_path(data: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert expected in str(err.value)


def test_env_expansion_with_defaults_and_missing_vars() -> None:
    data = {"server": {"api_keys": {"alice": "${KEY_A}", "bob": "${KEY_B:-fallback}"}}}
    config = parse_config(data, env={"KEY_A": "secret-a"})
    keys = {k: v.get_secret_value() for k, v in config.server.api_keys.items()}
    assert keys == {"alice": "secret-a", "bob": "fallback"}
    assert "secret-a" not in repr(config)
    with pytest.raises(ConfigError) as err:
        parse_config(data, env={})
    assert "server.api_keys.alice: environment variable KEY_A is not set" in str(err.value)


def test_router_exact_then_longest_wildcard() -> None:
    config = parse_config({
        "providers": {"p": {"kind": "echo"}},
        "routes": {"a_*": {"provider": "p"}, "a_b_*": {"provider": "p", "method": "x."},
                   "a_b_c": {"provider": "p", "method": "real"}},
    })
    router = Router(config.routes)
    assert router.resolve("a_b_c").upstream_method == "real"
    assert router.resolve("a_b_d").upstream_method == "x.d"
    assert router.resolve("a_zz").upstream_method == "zz"
    with pytest.raises(Exception) as err:
        router.resolve("a_")
    assert getattr(err.value, "code", None) == -32601


def test_cli_check_config(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(CONTRACT)
    bad.write_text("providers: {calc: {kind: jsonrpc}}\n")
    ok = subprocess.run([sys.executable, "-m", "multiplexer", "check-config", str(good)],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "1 providers, 4 routes" in ok.stdout
    fail = subprocess.run([sys.executable, "-m", "multiplexer", "check-config", str(bad)],
                          capture_output=True, text=True)
    assert fail.returncode == 2 and "providers.calc.url: Field required" in fail.stderr


def test_default_config_is_valid() -> None:
    config = load_config(Path(__file__).parent.parent / "config" / "default.yaml")
    assert "echo" in config.routes
    # OpenAI(base_url=.../v1).embeddings.create(model="all-MiniLM-L6-v2") works out of the box
    assert config.routes["embed_local"].models == ["all-MiniLM-L6-v2"]


def test_serve_sets_the_collectors_young_threshold_from_config() -> None:
    import gc

    from multiplexer.gateway.heap import tune_gc

    before = gc.get_threshold()
    try:
        config = parse_config({"server": {}, "providers": {}, "routes": {}})
        tune_gc(config.server.gc_young_threshold)
        assert gc.get_threshold() == (10_000, *before[1:])
        gc.set_threshold(*before)
        tune_gc(parse_config({"server": {"gc_young_threshold": None}}).server.gc_young_threshold)
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)
    with pytest.raises(ConfigError, match=r"server\.gc_young_threshold"):
        parse_config({"server": {"gc_young_threshold": 5}})
