"""Junk bodies on every /v1 endpoint: each gets a clear 4xx in its surface's shape (never a 500,
never a hang), and the gateway still answers a good call afterwards."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, v1_config

pytestmark = pytest.mark.anyio

ENDPOINTS = ["/v1/chat/completions", "/v1/embeddings", "/v1/messages", "/v1/batches"]
ATOMS: list[Any] = [None, True, 0, -1, 1.5, 10**30, "", "x", "gpt-4o-mini", "claude-sonnet-4-5",
                    "text-embedding-3-small", "\ud800", "chat", "claude", "*", [], {}, [1, "a"],
                    {"role": "user"}, {"role": "user", "content": 5}]
KEYS = ["model", "messages", "input", "stream", "max_tokens", "encoding_format", "stream_options",
        "input_file_id", "endpoint", "completion_window", "metadata", "n", "temperature"]


def junk(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return rng.choice(ATOMS)
    if roll < 0.75:
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): junk(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def body(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.1:
        return rng.choice([b"", b"{", b"null", b"[]", b"\xff\xfe", b'{"model": NaN}', b"1e999"])
    value = {k: junk(rng) for k in rng.sample(KEYS, rng.randint(0, 6))}
    if rng.random() < 0.5:
        value["model"] = rng.choice(["gpt-4o-mini", "claude-sonnet-4-5", "text-embedding-3-small"])
    return json.dumps(value).encode()


def well_formed(endpoint: str, response: httpx.Response) -> bool:
    data = response.json()
    if endpoint == "/v1/messages":
        return data["type"] == "error" and isinstance(data["error"]["message"], str)
    return isinstance(data["error"]["message"], str) and "type" in data["error"]


async def test_junk_bodies_get_clear_4xx_answers(tmp_path):
    rng = random.Random(12)
    statuses: dict[int, int] = {}
    async with (
        fakes() as f,
        running(parse_config(v1_config(f, tmp_path)), port=0) as (_, url),
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                          timeout=10) as http,
    ):
        for _ in range(400):
            endpoint = rng.choice(ENDPOINTS)
            r = await http.post(endpoint, content=body(rng))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 200:
                continue  # junk that happens to be a valid request
            assert 400 <= r.status_code < 500, (endpoint, r.status_code, r.text)
            assert well_formed(endpoint, r), (endpoint, r.text)
            assert r.headers.get("request-id" if endpoint == "/v1/messages" else "x-request-id")
        good = await http.post("/v1/chat/completions", json={
            "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "still here"}]})
        assert good.json()["choices"][0]["message"]["content"] == "echo: still here"
    assert statuses.get(400, 0) > 200
