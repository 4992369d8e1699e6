"""Config validation names the key path; env expansion; the router; the CLI check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from multiplexer.core.router import Router
from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import ConfigError, load_config, parse_config
from multiplexer.gateway.registry import KINDS

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


JSONRPC_KEYS = ("batch, batch_arrays, batch_arrays_reprobe_s, batch_discount, breaker, headers, kind, "
                "limits, price, retry, timeout_ms, transport, url")


@pytest.mark.parametrize("data,expected", [
    ({"providers": {"p": {"kind": "jsonrpc", "url": "x", "batch": {"max_items": 0}}}},
     ["providers.p.batch.max_items: Input should be greater than or equal to 1"]),
    ({"providers": {"p": {"kind": "nope"}}},
     [f"providers.p.kind: unknown provider kind 'nope' (known: {', '.join(sorted(KINDS))})"]),
    ({"providers": {"p": {"kind": "jsonrpc"}}}, ["providers.p.url: Field required"]),
    ({"providers": {"p": {"kind": "jsonrpc", "url": "u", "typo": 1}}},
     [f"providers.p.typo: unknown key (known: {JSONRPC_KEYS})"]),
    ({"routes": {"r": {"provider": "ghost"}}}, ["routes.r.provider: unknown provider 'ghost' (known: none)"]),
    ({"server": {"port": "eighty"}}, ["server.port: Input should be a valid integer, unable to parse string "
                                      "as an integer"]),
    ({"server": {"prot": 1}}, ["server.prot: unknown key (did you mean 'port'?)"]),
    ({"store": {"url": "mysql://db/x"}}, ["store.url: expected postgresql://..., got 'mysql://db/x'"]),
    ({"store": {"shema": "jobs"}}, ["store.shema: unknown key (did you mean 'schema'?)"]),
    ({"store": {"schema": "mx-jobs"}}, ["store.schema: 'mx-jobs' is not a plain PostgreSQL name (letters, "
                                        "digits and _, not starting with a digit, at most 63)"]),
])
def test_invalid_config_names_the_key_path(data: dict, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).splitlines() == ["invalid config:", *(f"  {line}" for line in expected)]


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid config:"
    return [line.strip() for line in lines[1:]]


ECHO = {"e": {"kind": "echo"}}


def test_route_typos_are_refused_with_the_key_they_resemble() -> None:
    """The issue's route-level typos passed check-config and were ignored at run time."""
    data = {"providers": ECHO, "routes": {"embed": {
        "provider": "e", "dedupe": True, "cache_ttl": 30, "modles": ["m"]}}}
    assert problems_of(data) == [
        "routes.embed.dedupe: unknown key (did you mean 'dedup'?)",
        "routes.embed.cache_ttl: unknown key (did you mean 'cache_ttl_s'?)",
        "routes.embed.modles: unknown key (did you mean 'models'?)",
    ]


def test_a_misspelt_required_key_is_named_not_reported_missing() -> None:
    assert problems_of({"providers": ECHO, "routes": {"x": {"provder": "e"}}}) == [
        "routes.x.provder: unknown key (did you mean 'provider'?)"]
    assert problems_of({"providers": {"p": {"knd": "echo"}}}) == [
        "providers.p.knd: unknown key (did you mean 'kind'?)"]
    assert problems_of({"providers": {"p": {"kind": "jsonrpc", "ulr": "http://x/"}}}) == [
        "providers.p.ulr: unknown key (did you mean 'url'?)"]


def test_a_route_takes_the_keys_its_provider_kind_declares() -> None:
    local = {"kind": "local", "models": {"m": {"source": "package:x", "task": "embed"}}}
    config = parse_config({"providers": {"l": local, **ECHO},
                           "routes": {"a": {"provider": "l", "model": "m"}}})
    assert config.routes["a"].extra == {"model": "m"}  # reaches the provider in item.options
    # model: is a local route's key, not an echo route's
    assert problems_of({"providers": {"l": local, **ECHO}, "routes": {
        "a": {"provider": "l", "model": "m", "modle": "m"}, "b": {"provider": "e", "model": "m"}}}) == [
        "routes.a.modle: unknown key (did you mean 'mode'?)",
        "routes.b.model: unknown key (did you mean 'models'?)",
    ]
    assert problems_of({"providers": {"l": local}, "routes": {"a": {"provider": "l", "model": 3}}}) == [
        "routes.a.model: Input should be a valid string"]


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    """Unknown keys of the kinds come with the common models' problems, each on its own line."""
    data = {"server": {"mcp": {"paht": "/x"}}, "cache": {"max_entires": 5},
            "providers": {"p": {"kind": "jsonrpc", "url": "u", "limts": {}},
                          "l": {"kind": "local", "models": {"m": {"sorce": "x", "task": "embed"}}}},
            "routes": {"r": {"provider": "pp"}, "s": {"provider": "p", "dedupe": True}}}
    assert problems_of(data) == [
        "server.mcp.paht: unknown key (did you mean 'path'?)",
        "cache.max_entires: unknown key (did you mean 'max_entries'?)",
        "providers.p.limts: unknown key (did you mean 'limits'?)",
        "providers.l.models.m.sorce: unknown key (did you mean 'source'?)",
        "routes.s.dedupe: unknown key (did you mean 'dedup'?)",
    ]
    del data["server"], data["cache"], data["providers"]["l"], data["providers"]["p"]["limts"]
    del data["routes"]["s"]
    assert problems_of(data) == ["routes.r.provider: unknown provider 'pp' (did you mean 'p'?)"]


SHIPPED = [*sorted((Path(__file__).parent.parent / "config").glob("*.yaml")), DEFAULT_CONFIG]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.routes and config.providers


def test_the_configs_the_tests_build_load(tmp_path: Path) -> None:
    """The helpers' configs use route keys of their kinds (a local route's ``model``) only."""
    from tests.local_helpers import local_config
    from tests.mcp_helpers import http_upstream, stdio_upstream
    from tests.remote_helpers import remote_config_data

    local = local_config({"m": {"source": "package:x", "task": "embed"}})
    assert local.routes["m"].extra == {"model": "m"}
    mcp = parse_config({"providers": {"t": stdio_upstream(), "h": http_upstream("http://127.0.0.1:1/mcp")},
                        "routes": {"t_*": {"provider": "t"}, "h_*": {"provider": "h", "dedup": True}}})
    assert set(mcp.providers) == {"t", "h"}

    class Fakes:  # remote_config_data reads only the fakes' base URLs
        openai_url = anthropic_url = "http://127.0.0.1:1"

    remote = parse_config(remote_config_data(Fakes(), tmp_path))  # type: ignore[arg-type]
    assert remote.routes


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
    assert fail.returncode == 2 and fail.stderr == "invalid config:\n  providers.calc.url: Field required\n"


def test_default_config_is_valid() -> None:
    config = load_config(DEFAULT_CONFIG)
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
