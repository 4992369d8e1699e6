"""On ``/v1`` a key learns it may not use a route before it learns what the route serves: a key
without access to the route its model picks gets 403 on every endpoint, whatever the route
answers; a key with access asking a route for what it does not serve still gets the 400 naming
what the route answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running

pytestmark = pytest.mark.anyio

ALICE, AMY, BOB = "alice-key-0123456789abcdef", "amy-key-0123456789abcdef", "bob-key-0123456789abcdef"
ASK = [{"role": "user", "content": "hi"}]
# (endpoint, a body asking a route for what it does not serve): chat (mock-gpt) answers chat, echo
# answers call; echo_chat and echo_claude answer chat and messages on a provider that has no
# Responses API or token counting (the face's second check, V1.require_operation)
WRONG = [
    ("/v1/embeddings", {"model": "mock-gpt", "input": "x"}),
    ("/v1/messages", {"model": "mock-gpt", "max_tokens": 8, "messages": ASK}),
    ("/v1/messages/count_tokens", {"model": "mock-gpt", "messages": ASK}),
    ("/v1/chat/completions", {"model": "echo", "messages": ASK}),
    ("/v1/responses", {"model": "echo", "input": "hi"}),
    ("/v1/completions", {"model": "echo", "prompt": "hi"}),
    ("/v1/responses", {"model": "echo-gpt", "input": "hi"}),
    ("/v1/messages/count_tokens", {"model": "echo-claude", "messages": ASK}),
]
ROUTES = {"mock-gpt": "chat", "echo": "echo", "echo-gpt": "echo_chat", "echo-claude": "echo_claude"}


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "store": {"path": str(tmp_path / "jobs.db")},
        "server": {"api_keys": {"alice": {"key": ALICE, "routes": ["claude"]},
                                "amy": {"key": AMY, "models": ["mock-claude"]},
                                "bob": BOB}},
        "providers": {"mock": {"kind": "mock"}, "builtin": {"kind": "echo"}},
        "routes": {"chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]},
                   "claude": {"provider": "mock", "operation": "messages", "models": ["mock-claude"]},
                   "echo": {"provider": "builtin"},
                   "echo_chat": {"provider": "builtin", "operation": "chat", "models": ["echo-gpt"]},
                   "echo_claude": {"provider": "builtin", "operation": "messages",
                                   "models": ["echo-claude"]}},
    }


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with running(parse_config(config(tmp_path)), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield http


async def test_a_key_without_access_gets_403_before_the_routes_operation_is_checked(tmp_path: Path) -> None:
    async with gateway(tmp_path) as http:
        for path, body in WRONG:
            for stream in (False, True):
                sent = {**body, "stream": True} if stream and "count_tokens" not in path else body
                reply = await http.post(path, json=sent, headers={"authorization": f"Bearer {ALICE}"})
                assert reply.status_code == 403, (path, stream, reply.text)
                error = reply.json()["error"]
                detail = f"this key may not use route {ROUTES[body['model']]!r}"
                assert detail in error["message"], (path, error)
                if path.startswith("/v1/messages"):  # in each API's own shape
                    assert error["type"] == "permission_error"
                else:
                    assert error["code"] == "permission_denied"


async def test_a_key_without_the_model_gets_403_before_the_routes_operation_is_checked(
        tmp_path: Path) -> None:
    async with gateway(tmp_path) as http:
        reply = await http.post("/v1/embeddings", json=WRONG[0][1],
                                headers={"authorization": f"Bearer {AMY}"})
        assert reply.status_code == 403
        assert reply.json()["error"]["code"] == "permission_denied"
        assert "this key may not use model 'mock-gpt'" in reply.json()["error"]["message"]


async def test_a_key_with_access_still_learns_what_the_route_serves(tmp_path: Path) -> None:
    async with gateway(tmp_path) as http:
        for path, body in WRONG:  # bob may use every route
            reply = await http.post(path, json=body, headers={"authorization": f"Bearer {BOB}"})
            assert reply.status_code == 400, (path, reply.text)
            said = reply.json()["error"]["message"]
            route = ROUTES[body["model"]]
            assert f"is served by route {route}" in said and "may not" not in said, (path, said)
        reply = await http.post("/v1/embeddings", json={"model": "mock-claude", "input": "x"},
                                headers={"authorization": f"Bearer {ALICE}"})  # alice may use claude
        assert reply.status_code == 400
        assert "is served by route claude (messages), not embeddings" in reply.json()["error"]["message"]
        answered = await http.post("/v1/messages", json={"model": "mock-claude", "max_tokens": 8,
                                                         "messages": ASK},
                                   headers={"authorization": f"Bearer {ALICE}"})
        assert answered.status_code == 200
