"""The cache-read share per route, live: ``/metrics`` counts each route's input tokens and the
prompt-cache reads among them, and the dashboard's spend panel shows their share per route, from
a fake deployment with a prompt cache of its own (``benchmarks/_cache_fake.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks._cache_fake import Deployment, PromptCache
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.serve import serve_app

pytestmark = pytest.mark.anyio
ADMIN = "adm-share-" + "y" * 24
SYSTEM = "You are the release assistant; answer from the notes. " * 120  # about 1,600 tokens


def metric(text: str, name: str, route: str) -> float:
    line = f'{name}{{route="{route}"}} '
    return sum(float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(line))


async def test_the_spend_panel_shows_each_routes_cache_read_share(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("MULTIPLEXER_MASTER_KEY", raising=False)
    fake = Deployment("d1", PromptCache())
    async with serve_app(fake.app()) as upstream:
        config = parse_config({
            "server": {"admin_key": ADMIN}, "store": {"path": str(tmp_path / "multiplexer.db")},
            "providers": {"d": {"kind": "openai", "base_url": upstream + "/v1", "api_key": "sk-x",
                                "price": {"input_per_mtok": 1, "cached_input_per_mtok": 0.1,
                                          "output_per_mtok": 2}}},
            "routes": {"chat": {"provider": "d", "operation": "chat", "models": ["gpt-fake"]}}}, env={})
        async with running(config, port=0) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as http:
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"question {turn}"})
                r = await http.post("/v1/chat/completions", json={"model": "gpt-fake", "messages": messages})
                assert r.status_code == 200, r.text
                messages.append(r.json()["choices"][0]["message"])
            text = (await http.get("/metrics")).text
            state = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {ADMIN}"})).json()
    sent = metric(text, "multiplexer_input_tokens_total", "chat")
    read = metric(text, "multiplexer_cache_read_tokens_total", "chat")
    assert (sent, read) == (fake.prompt_tokens, fake.cached_tokens) and 0 < read < sent
    [row] = [r for r in state["panels"]["spend"]["routes"] if r["route"] == "chat"]
    assert (row["input_tokens"], row["cache_read_tokens"]) == (sent, read)
    assert row["cache_read_share"] == round(read / sent, 4)
