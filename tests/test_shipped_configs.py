"""The configs a newcomer starts from: each loads, each route a ``/v1`` endpoint can reach lists
the ``models:`` the SDKs ask for, the default one answers the OpenAI and Anthropic SDKs offline
(on the mock), and the remote example runs against the fakes its header names, started with
the one command it documents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import load_config, parse_config
from multiplexer.gateway.registry import provider_class
from multiplexer.server import running
from tests.fakes.serve import fakes_for
from tests.mcp_helpers import free_port
from tests.remote_helpers import fakes
from tests.sdk_helpers import sdk_clients

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

ROOT = Path(__file__).parents[1]
CONFIGS = [DEFAULT_CONFIG, *sorted((ROOT / "config").glob("*.yaml"))]
V1_ANSWERS = {"chat", "generate", "embeddings", "embed", "messages"}  # what some /v1 endpoint serves
ASK = [{"role": "user", "content": "hello there"}]


def test_the_shipped_configs_are_all_here() -> None:
    assert {p.name for p in CONFIGS} >= {"default.yaml", "remote.example.yaml", "local.example.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_route_a_v1_endpoint_can_reach_lists_its_models(path: Path) -> None:
    config = load_config(path)
    reachable = set()
    for name, route in config.routes.items():
        if name.endswith("*"):
            continue  # a wildcard is many tools, never a /v1 model
        pconf = config.providers[route.provider]
        kind = provider_class(pconf.kind)
        if kind.answers(route, kind.Settings.model_validate(pconf.extra)) in V1_ANSWERS:
            reachable.add(name)
            assert route.models, f"{path.name}: route {name} serves /v1 but lists no models"
    assert reachable  # every shipped config serves the SDKs something
    listed = [m for route in config.routes.values() for m in route.models]
    assert len(listed) == len(set(listed))  # a model name reaches one route


def default_offline() -> dict[str, Any]:
    """The default config without its MCP child and local models (the mock needs neither)."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    keep = {"builtin", "mock"}
    data["providers"] = {k: v for k, v in data["providers"].items() if k in keep}
    data["routes"] = {k: v for k, v in data["routes"].items() if v["provider"] in keep}
    return data


@pytest.mark.anyio
async def test_the_default_config_answers_the_sdks_offline(tmp_path: Path) -> None:
    data = default_offline()
    assert {"chat", "claude", "embed_mock"} <= set(data["routes"])
    data["store"] = {"path": str(tmp_path / "jobs.db")}
    async with running(parse_config(data), port=0) as (gw, url), sdk_clients(url) as c:
        client, claude = c.openai, c.anthropic
        listed = {m.id async for m in client.models.list()}
        assert listed == {"mock-gpt", "mock-claude", "mock-embedding"}
        chat = await client.chat.completions.create(model="mock-gpt", messages=ASK)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == "This is a mock response to: hello there"
        message = await claude.messages.create(model="mock-claude", max_tokens=64, messages=ASK)  # type: ignore[arg-type]
        assert message.content[0].text == "This is a mock response to: hello there"  # type: ignore[union-attr]
        vectors = await client.embeddings.create(model="mock-embedding", input=["a", "b"])
        assert [len(d.embedding) for d in vectors.data] == [384, 384]
        # the first mile's 500s: the echo route now says what it is instead
        with pytest.raises(openai.BadRequestError, match=r"served by route echo \(call\), not chat"):
            await client.chat.completions.create(model="echo", messages=ASK)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match=r"served by route echo \(call\), not embeddings"):
            await client.embeddings.create(model="echo", input="x")
        ok = gw.metrics.registry.get_sample_value("multiplexer_calls_total",
                                                  {"route": "echo", "outcome": "ok"})
        assert ok is None  # refused at the face: never counted as answered


@pytest.mark.anyio
async def test_the_default_configs_mock_models_carry_an_example_price(tmp_path: Path) -> None:
    """$1 and $2 per million input and output tokens, so spend, budgets and the dashboard's money
    panel count something on the default config (a mock token is a word)."""
    data = default_offline()
    assert data["providers"]["mock"]["price"] == {"input_per_mtok": 1, "output_per_mtok": 2}
    data["store"] = {"path": str(tmp_path / "jobs.db")}
    async with running(parse_config(data), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        chat = await http.post("/v1/chat/completions", json={"model": "mock-gpt", "messages": ASK})
        assert chat.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
        assert chat.headers["x-multiplexer-cost-usd"] == "0.000018"  # 2 x $1 + 8 x $2, per million
        message = await http.post("/v1/messages", json={"model": "mock-claude", "max_tokens": 64,
                                                        "messages": ASK})
        assert message.headers["x-multiplexer-cost-usd"] == "0.000018"
        vectors = await http.post("/v1/embeddings", json={"model": "mock-embedding", "input": "a b c"})
        assert vectors.headers["x-multiplexer-cost-usd"] == "0.000003"
        sample = gw.metrics.registry.get_sample_value
        assert sample("multiplexer_unknown_cost_calls_total", {"route": "chat"}) is None
        spent = sample("multiplexer_spend_usd_total", {"provider": "mock", "route": "chat"})
        assert spent == pytest.approx(18e-6)


def test_the_remote_example_names_one_command_for_its_fakes() -> None:
    path = ROOT / "config" / "remote.example.yaml"
    assert "python -m tests.fakes.serve --config config/remote.example.yaml" in path.read_text()
    assert fakes_for(load_config(path)) == [("openai", "127.0.0.1", 9003), ("anthropic", "127.0.0.1", 9004)]


@pytest.mark.anyio
async def test_the_remote_example_serves_the_sdks_on_the_fakes(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "config" / "remote.example.yaml").read_text())
    async with fakes() as f:
        data["providers"]["oai"]["base_url"] = f.openai_url + "/v1"
        data["providers"]["claude"]["base_url"] = f.anthropic_url
        data["store"] = {"path": str(tmp_path / "jobs.db")}
        data["server"]["port"] = 0
        async with running(parse_config(data), port=0) as (_, url), sdk_clients(url) as c:
            client, claude = c.openai, c.anthropic
            listed = {m.id async for m in client.models.list()}
            assert {"gpt-4o-mini", "text-embedding-3-small", "claude-sonnet-4-5", "chat_batch"} <= listed
            for model in ("gpt-4o-mini", "chat"):  # a listed model, or the route's own name
                chat = await client.chat.completions.create(model=model, messages=ASK)  # type: ignore[arg-type]
                assert chat.choices[0].message.content == "echo: hello there"
                assert chat.model == "gpt-4o-mini"
            vectors = await client.embeddings.create(model="text-embedding-3-small", input="x")
            assert len(vectors.data) == 1
            message = await claude.messages.create(model="claude-sonnet-4-5", max_tokens=64,
                                                   messages=ASK)  # type: ignore[arg-type]
            assert message.content[0].text == "echo: hello there"  # type: ignore[union-attr]
    assert [f.openai.bodies["/v1/chat/completions"][i]["model"] for i in (0, 1)] == ["gpt-4o-mini"] * 2


def test_one_command_starts_every_fake_a_config_points_at(tmp_path: Path) -> None:
    ports = free_port(), free_port()
    config = tmp_path / "remote.yaml"
    config.write_text(yaml.safe_dump({"providers": {
        "oai": {"kind": "openai", "base_url": f"http://127.0.0.1:{ports[0]}/v1"},
        "claude": {"kind": "anthropic", "base_url": f"http://localhost:{ports[1]}"},
        "elsewhere": {"kind": "openai", "base_url": "https://api.openai.com/v1"}}}, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.serve", "--config", str(config)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        banners = [proc.stdout.readline().strip() for _ in range(2)]  # each once it accepts connections
        assert banners == [f"fake openai API on http://127.0.0.1:{ports[0]}",
                           f"fake anthropic API on http://127.0.0.1:{ports[1]}"]
        up = httpx.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions",
                        headers={"authorization": "Bearer k"},
                        json={"model": "m", "messages": ASK})
        assert up.json()["choices"][0]["message"]["content"] == "echo: hello there"
        up = httpx.post(f"http://127.0.0.1:{ports[1]}/v1/messages",
                        headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
                        json={"model": "m", "max_tokens": 8, "messages": ASK})
        assert up.json()["content"][0]["text"] == "echo: hello there"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
