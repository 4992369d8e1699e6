"""The gateway's own fields never go upstream: ``_meta`` is removed from every ``/v1`` body (each
endpoint and batch line) before its provider sees it, against fakes that refuse unknown keys."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import Fakes, fakes

pytestmark = pytest.mark.anyio
KEY = "sk-gateway-test"
META = {"timeout_ms": 5000, "priority": 1, "trace": "x"}
USER = [{"role": "user", "content": "hello there"}]
FAST = {"batch_poll_interval_s": 0.01, "retry": {"attempts": 1}}


def config(f: Fakes, tmp_path: Path) -> dict[str, Any]:
    return {
        "server": {"api_keys": {"alice": KEY}},
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up", **FAST},
                      "claude": {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "up", **FAST}},
        "routes": {"chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"]},
                   "embed": {"provider": "oai", "operation": "embeddings",
                             "models": ["text-embedding-3-small"]},
                   "claude": {"provider": "claude", "operation": "messages",
                              "models": ["claude-sonnet-4-5"]}},
    }


@asynccontextmanager
async def strict_gateway(tmp_path: Path) -> AsyncIterator[tuple[Fakes, httpx.AsyncClient]]:
    async with fakes(strict_keys=True) as f:
        f.anthropic.strict_keys = True
        async with running(parse_config(config(f, tmp_path)), port=0) as (_, url), \
                httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                                  timeout=30) as client:
            yield f, client


def test_the_strict_fakes_refuse_an_unknown_key() -> None:
    """The check the tests below lean on: ``_meta`` straight to a strict fake is a 400."""
    from starlette.testclient import TestClient

    from tests.fakes.openai_fake import FakeOpenAIState, create_app

    with TestClient(create_app(FakeOpenAIState(strict_keys=True))) as up:
        r = up.post("/v1/chat/completions", headers={"authorization": "Bearer k"},
                    json={"model": "gpt-4o-mini", "messages": USER, "_meta": META})
        assert r.status_code == 400 and r.json()["error"]["param"] == "_meta"
        r = up.post("/v1/chat/completions", headers={"authorization": "Bearer k"},
                    json={"model": "gpt-4o-mini", "messages": USER})
        assert r.status_code == 200


LIVE = [
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": USER}, "openai"),
    ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": USER, "stream": True}, "openai"),
    ("/v1/completions", {"model": "gpt-4o-mini", "prompt": "hello there"}, "openai"),
    ("/v1/responses", {"model": "gpt-4o-mini", "input": "hello there"}, "openai"),
    ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "hello there"}, "openai"),
    ("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": USER}, "anthropic"),
    ("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": USER, "stream": True},
     "anthropic"),
    ("/v1/messages/count_tokens", {"model": "claude-sonnet-4-5", "messages": USER}, "anthropic"),
]


@pytest.mark.parametrize(("path", "body", "upstream"), LIVE,
                         ids=[f"{p}{' stream' if b.get('stream') else ''}" for p, b, _ in LIVE])
async def test_meta_is_removed_from_every_live_body(tmp_path: Path, path: str, body: dict[str, Any],
                                                    upstream: str) -> None:
    async with strict_gateway(tmp_path) as (f, client):
        r = await client.post(path, json={**body, "_meta": META})
        assert r.status_code == 200, r.text
        assert "Unrecognized" not in r.text  # a stream would carry the upstream 400 as an event
        fake = getattr(f, upstream)
        assert fake.statuses[400] == 0 and fake.statuses[200] >= 1
        for sent in fake.bodies.get(path, []) if upstream == "openai" else []:
            assert "_meta" not in sent


async def poll(client: httpx.AsyncClient, url: str, done: set[str]) -> dict[str, Any]:
    """The batch at ``url`` once its status is one of ``done`` (polled, within 20 s)."""
    with anyio.fail_after(20):
        while True:
            body = (await client.get(url)).json()
            if body.get("status", body.get("processing_status")) in done:
                return body
            await anyio.sleep(0.02)


async def test_meta_is_removed_from_openai_batch_lines(tmp_path: Path) -> None:
    async with strict_gateway(tmp_path) as (f, client):
        lines = [{"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "gpt-4o-mini", "messages": USER, "_meta": META}}]
        up = await client.post("/v1/files", data={"purpose": "batch"}, files={
            "file": ("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())})
        assert up.status_code == 200, up.text
        r = await client.post("/v1/batches", json={"input_file_id": up.json()["id"],
                                                   "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"})
        assert r.status_code == 200, r.text
        batch = await poll(client, f"/v1/batches/{r.json()['id']}", {"completed", "failed"})
        assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}, batch
        [line] = (await client.get(f"/v1/files/{batch['output_file_id']}/content")).text.splitlines()
        answer = json.loads(line)["response"]
        assert answer["status_code"] == 200
        assert answer["body"]["choices"][0]["message"]["content"] == "echo: hello there"
        [job] = f.openai.batches.values()
        assert [item["body"] for item in job.items] == [{"model": "gpt-4o-mini", "messages": USER}]


async def test_meta_is_removed_from_message_batch_requests(tmp_path: Path) -> None:
    async with strict_gateway(tmp_path) as (f, client):
        params = {"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": USER, "_meta": META}
        r = await client.post("/v1/messages/batches", json={"requests": [
            {"custom_id": "c1", "params": params}]})
        assert r.status_code == 200, r.text
        batch = await poll(client, f"/v1/messages/batches/{r.json()['id']}", {"ended"})
        assert batch["request_counts"]["succeeded"] == 1, batch
        [line] = (await client.get(f"/v1/messages/batches/{batch['id']}/results")).text.splitlines()
        assert json.loads(line)["result"]["type"] == "succeeded"
        [job] = f.anthropic.batches.values()
        assert all("_meta" not in entry["params"] for entry in job.requests)
