"""Every ``/v1`` endpoint against every shipped route kind, through the official SDKs: a route
that answers the endpoint answers it, any other is refused with a 400 in that API's error shape
naming the route and what it answers (never a 500, never a body it cannot answer sent on).

One gateway per config, shared by the module: the remote kinds (echo, jsonrpc, an MCP tool,
openai and anthropic on the fakes, mock), and the local ones (embed, generate, classify) on
models built in the test run."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import stdio_upstream
from tests.remote_helpers import fakes
from tests.sdk_helpers import Clients, sdk_clients

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio

FAST = {"retry": {"attempts": 2, "base_wait_ms": 1, "max_wait_ms": 5}, "batch_poll_interval_s": 0.01}
ENDPOINTS = ["chat", "completions", "responses", "embeddings", "messages", "count_tokens"]
# route -> what it answers (Provider.answers), as the refusal names it
REMOTE = {"echo": "call", "calc": "call", "tool": "call", "oai_chat": "chat",
          "oai_embed": "embeddings", "anth": "messages", "mock_chat": "chat",
          "mock_claude": "messages", "mock_embed": "embeddings"}
LOCAL = {"embed_local": "embed", "writer": "generate", "classify": "classify"}
# endpoint -> what a route must answer to serve it
SERVED_BY = {"chat": {"chat", "generate"}, "completions": {"chat", "generate"},
             "responses": {"chat", "generate"}, "embeddings": {"embeddings", "embed"},
             "messages": {"messages"}, "count_tokens": {"messages"}}
WHAT = {"chat": "chat completions", "completions": "completions", "responses": "responses",
        "embeddings": "embeddings", "messages": "messages", "count_tokens": "messages"}


def remote_config(f: Any, store: Path) -> dict[str, Any]:
    return {
        "store": {"path": str(store)},
        "providers": {
            "builtin": {"kind": "echo"},
            "calc": {"kind": "jsonrpc", "url": "http://127.0.0.1:9/"},  # never reached: all refused
            "tools": stdio_upstream(),
            "oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up", **FAST},
            "anth": {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "up", **FAST},
            "mock": {"kind": "mock"},
        },
        "routes": {
            "echo": {"provider": "builtin"},
            "calc": {"provider": "calc"},
            "tool": {"provider": "tools", "method": "add"},
            "oai_chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"]},
            "oai_embed": {"provider": "oai", "operation": "embeddings",
                          "models": ["text-embedding-3-small"]},
            "anth": {"provider": "anth", "operation": "messages", "models": ["claude-sonnet-4-5"]},
            "mock_chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]},
            "mock_claude": {"provider": "mock", "operation": "messages", "models": ["mock-claude"]},
            "mock_embed": {"provider": "mock", "operation": "embeddings", "models": ["mock-embedding"]},
        },
    }


def local_config(models_dir: Path, store: Path) -> dict[str, Any]:
    from tests.local_helpers import MINILM, tiny_causal_lm, tiny_classifier

    lm = tiny_causal_lm(models_dir / "lm")
    classifier = tiny_classifier(models_dir / "cls")
    cpu = {"device": "cpu", "dtype": "float32", "compile": False}
    return {
        "store": {"path": str(store)},
        "providers": {"local": {"kind": "local", "models": {
            "minilm": {"source": MINILM, "task": "embed", **cpu},
            "lm": {"source": str(lm), "task": "generate", "max_new_tokens": 4, **cpu},
            "cls": {"source": str(classifier), "task": "classify", **cpu},
        }}},
        "routes": {"embed_local": {"provider": "local", "model": "minilm"},
                   "writer": {"provider": "local", "model": "lm"},
                   "classify": {"provider": "local", "model": "cls"}},
    }


@pytest.fixture(scope="module")
async def remote(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Clients]:
    store = tmp_path_factory.mktemp("remote") / "jobs.db"
    async with (fakes() as f, running(parse_config(remote_config(f, store)), port=0) as (_, url),
                sdk_clients(url) as clients):
        yield clients


@pytest.fixture(scope="module")
async def local(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Clients]:
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("local")
    async with (running(parse_config(local_config(base, base / "jobs.db")), port=0) as (_, url),
                sdk_clients(url) as clients):
        yield clients


ASK = [{"role": "user", "content": "the cat"}]


async def call(clients: Clients, endpoint: str, model: str) -> str:
    """One request to ``endpoint``; the text (or a summary) it answered with."""
    o, a = clients.openai, clients.anthropic
    if endpoint == "chat":
        chat = await o.chat.completions.create(model=model, messages=ASK, max_tokens=4)  # type: ignore[arg-type]
        return chat.choices[0].message.content or ""
    if endpoint == "completions":
        return (await o.completions.create(model=model, prompt="the cat", max_tokens=4)).choices[0].text
    if endpoint == "responses":
        return (await o.responses.create(model=model, input="the cat", max_output_tokens=4)).output_text
    if endpoint == "embeddings":
        return f"{len((await o.embeddings.create(model=model, input='the cat')).data)} vector"
    if endpoint == "messages":
        message = await a.messages.create(model=model, max_tokens=4, messages=ASK)  # type: ignore[arg-type]
        return message.content[0].text  # type: ignore[union-attr]
    counted = await a.messages.count_tokens(model=model, messages=ASK)  # type: ignore[arg-type]
    return f"{counted.input_tokens} tokens"


async def check(clients: Clients, endpoint: str, route: str, answers: str) -> None:
    anthropic_face = endpoint in ("messages", "count_tokens")
    if answers in SERVED_BY[endpoint]:
        assert await call(clients, endpoint, route)
        return
    error_class = anthropic.BadRequestError if anthropic_face else openai.BadRequestError
    with pytest.raises(error_class) as refused:
        await call(clients, endpoint, route)
    error = refused.value
    assert error.status_code == 400
    message = (f"Invalid params: model '{route}' is served by route {route} ({answers}), "
               f"not {WHAT[endpoint]}")
    if anthropic_face:
        assert error.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": message}}
    else:  # the SDK keeps the ``error`` object as the body
        assert error.body == {"message": message, "type": "invalid_request_error", "param": "model",
                              "code": None}


@pytest.mark.parametrize("route", REMOTE)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_remote_route_kinds(remote: Clients, endpoint: str, route: str) -> None:
    await check(remote, endpoint, route, REMOTE[route])


@pytest.mark.parametrize("route", LOCAL)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_local_route_kinds(local: Clients, endpoint: str, route: str) -> None:
    await check(local, endpoint, route, LOCAL[route])


# -- the batch endpoints: each line names its route -----------------------------------------------
async def until_ended(get: Any, batch_id: str, ended: Any) -> Any:
    with anyio.fail_after(20):
        while not ended(batch := await get(batch_id)):
            await anyio.sleep(0.02)  # polled as an SDK user does; the end is asserted, not timed
    return batch


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/embeddings", "/v1/responses"])
async def test_openai_batch_lines_for_routes_that_do_not_answer_are_refused(
        remote: Clients, endpoint: str) -> None:
    answers = {"/v1/chat/completions": "chat", "/v1/embeddings": "embeddings",
               "/v1/responses": "chat"}[endpoint]
    body = {"input": "the cat"} if endpoint != "/v1/chat/completions" else {"messages": ASK}
    lines = [{"custom_id": route, "method": "POST", "url": endpoint, "body": {"model": route, **body}}
             for route in REMOTE]
    o = remote.openai
    upload = await o.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                                  purpose="batch")
    batch = await o.batches.create(input_file_id=upload.id, endpoint=endpoint,  # type: ignore[arg-type]
                                   completion_window="24h")
    done = await until_ended(o.batches.retrieve, batch.id, lambda b: b.status in (
        "completed", "failed", "cancelled", "expired"))
    assert done.status == "completed"
    errors = {}
    if done.error_file_id is not None:
        content = (await o.files.content(done.error_file_id)).content
        errors = {r["custom_id"]: r["response"] for r in map(json.loads, content.splitlines())}
    served = {route for route, kind in REMOTE.items() if kind == answers}
    assert set(errors) == set(REMOTE) - served
    what = endpoint.removeprefix("/v1/").replace("/", " ")
    for route, response in errors.items():
        assert response["status_code"] == 400
        assert response["body"] == {"error": {
            "message": f"Invalid params: model '{route}' is served by route {route} "
                       f"({REMOTE[route]}), not {what}",
            "type": "invalid_request_error", "param": "model", "code": None}}


async def test_message_batch_requests_for_routes_that_do_not_answer_are_errored(remote: Clients) -> None:
    a = remote.anthropic
    batch = await a.messages.batches.create(requests=[  # type: ignore[misc]
        {"custom_id": route, "params": {"model": route, "max_tokens": 4, "messages": ASK}}
        for route in REMOTE])
    await until_ended(a.messages.batches.retrieve, batch.id, lambda b: b.processing_status == "ended")
    results = {r.custom_id: r.result async for r in await a.messages.batches.results(batch.id)}
    served = {"anth", "mock_claude"}
    assert {cid for cid, r in results.items() if r.type == "succeeded"} == served
    for route in set(REMOTE) - served:
        result = results[route]
        assert result.type == "errored"
        assert result.error.error.type == "invalid_request_error"  # type: ignore[union-attr]
        assert result.error.error.message == (  # type: ignore[union-attr]
            f"Invalid params: model '{route}' is served by route {route} ({REMOTE[route]}), not messages")
