"""What decides a provider's prompt-cache hit reaches the upstream as the caller sent it.

A provider caches a prompt's prefix: OpenAI keys on the tokens of ``tools`` + ``messages`` (or
``instructions`` + ``input``) and routes by ``prompt_cache_key``, keeping entries as long as
``prompt_cache_retention`` says; Anthropic caches up to each ``cache_control`` block, for its
``ttl``. A gateway that reorders, rewrites or drops any of these loses every hit. Each face here
runs one conversation over three turns against real fakes on 127.0.0.1 that keep every raw body
(``tests/recording_upstream.py``), and checks, per turn, that those fields parse equal to what the
caller sent and that the bytes the upstream got for turn n's conversation are a prefix of turn
n+1's.

Where a body is translated (a ``kind: gemini`` route, for OpenAI and Anthropic callers) the
markers have no Gemini equivalent: ``cache_control``, ``prompt_cache_key`` and
``prompt_cache_retention`` are dropped and system blocks become one ``systemInstruction`` text.
Gemini's implicit cache keys on the prefix of ``contents``, which stays byte-stable over the turns,
and that is asserted instead. An Anthropic caller on an OpenAI-shaped route is refused (a 400 in
Anthropic's shape naming the route), never translated, so no marker is silently lost there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.anthropic_fake import FakeAnthropicState
from tests.fakes.anthropic_fake import create_app as anthropic_app
from tests.fakes.gemini_fake import FakeGeminiState
from tests.fakes.gemini_fake import create_app as gemini_app
from tests.fakes.openai_fake import FakeOpenAIState
from tests.fakes.openai_fake import create_app as openai_app
from tests.fakes.serve import serve_app
from tests.recording_upstream import Recording, elements, top_level

pytestmark = pytest.mark.anyio
KEY = "sk-gateway-test"
FAST = {"batch_poll_interval_s": 0.01, "retry": {"attempts": 1}}
TURNS = ("first question", "second question", "third question")
EPHEMERAL_1H = {"type": "ephemeral", "ttl": "1h"}
# The long, stable head a cache is for: the same bytes on every turn.
SYSTEM_TEXT = "You are a careful assistant. " * 40
OPENAI_CACHE = {"prompt_cache_key": "conversation-7f3a", "prompt_cache_retention": "24h"}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
                    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                   "required": ["word"]}}]
ANTHROPIC_TOOLS = [
    {"name": "lookup", "description": "Look a word up.",
     "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}}},
    {"name": "define", "description": "Define a word.",
     "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
     "cache_control": EPHEMERAL_1H},
]
# top-level cache_control (automatic caching) is not sent: compared as absent upstream too
ANTHROPIC_FIELDS = ("system", "tools", "messages", "cache_control")
ANTHROPIC_SYSTEM = [{"type": "text", "text": SYSTEM_TEXT, "cache_control": EPHEMERAL_1H},
                    {"type": "text", "text": "Answer in one line."}]


@dataclass
class Upstreams:
    openai: Recording
    anthropic: Recording
    gemini: Recording
    openai_state: FakeOpenAIState
    anthropic_state: FakeAnthropicState


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[Upstreams, httpx.AsyncClient]]:
    """A gateway with route ``chat`` (OpenAI), ``claude`` (Anthropic) and ``gem`` (Gemini), each on
    a recording fake."""
    ostate, astate = FakeOpenAIState(), FakeAnthropicState()
    ups = Upstreams(Recording(openai_app(ostate)), Recording(anthropic_app(astate)),
                    Recording(gemini_app(FakeGeminiState())), ostate, astate)
    async with serve_app(ups.openai) as o, serve_app(ups.anthropic) as a, serve_app(ups.gemini) as g:
        config = {
            "server": {"api_keys": {"alice": KEY}},
            "store": {"path": str(tmp_path / "jobs.db")},
            "providers": {
                "oai": {"kind": "openai", "base_url": o + "/v1", "api_key": "sk-up", **FAST},
                "anth": {"kind": "anthropic", "base_url": a, "api_key": "up", **FAST},
                "gem": {"kind": "gemini", "base_url": g, "api_key": "g", **FAST},
            },
            "routes": {
                "chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"]},
                "claude": {"provider": "anth", "operation": "messages", "models": ["claude-sonnet-4-5"]},
                "gem": {"provider": "gem", "operation": "chat", "models": ["gemini-test"]},
            },
        }
        async with running(parse_config(config), port=0) as (_, url), \
                httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                                  timeout=30) as client:
            yield ups, client


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(path, content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


def is_prefix(earlier: bytes, later: bytes) -> bool:
    """Whether JSON array ``earlier``'s elements open array ``later``, byte for byte."""
    return earlier.startswith(b"[") and earlier.endswith(b"]") and later.startswith(earlier[:-1])


def assert_kept(sent: list[dict[str, Any]], raw: list[bytes], fields: tuple[str, ...],
                grows: str) -> None:
    """Each upstream body holds the caller's ``fields`` (parsed, equal; none added), and the bytes
    of array ``grows`` on each turn open the next turn's."""
    assert len(raw) == len(sent)
    for body, got in zip(sent, raw, strict=True):
        upstream = json.loads(got)
        assert {k: upstream.get(k) for k in fields} == {k: body.get(k) for k in fields}
    arrays = [top_level(got)[grows] for got in raw]
    for earlier, later in pairwise(arrays):
        assert is_prefix(earlier, later), (earlier[-200:], later[:200])


Turn = Callable[[list[Any], str], dict[str, Any]]


async def converse(build: Turn, grows: str, ask: Callable[[dict[str, Any]], Awaitable[Any]],
                   said: Callable[[Any], list[Any]]) -> list[dict[str, Any]]:
    """Three turns of one conversation: each body is ``build(history, question)``; its array
    ``grows`` and the answer's turn (``said``) are the next turn's history. The bodies sent."""
    history: list[Any] = []
    sent = []
    for question in TURNS:
        body = build(history, question)
        sent.append(body)
        history = [*body[grows], *said(await ask(body))]
    return sent


def answered(text: str) -> dict[str, Any]:
    """An answer's text where ``chat_said`` and ``messages_said`` read it."""
    return {"choices": [{"message": {"content": text}}], "content": [{"text": text}]}


async def canned(body: dict[str, Any]) -> dict[str, Any]:
    """A batch has no live answers: its lines hold a conversation with a fixed answer per turn."""
    return answered("noted")


async def streamed(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed call (for chat completions the ASGI path, not the direct one): the text of its
    SSE deltas."""
    pieces = []
    async with client.stream("POST", path, content=json.dumps({**body, "stream": True}).encode(),
                             headers={"content-type": "application/json"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("choices"):
                pieces.append(event["choices"][0]["delta"].get("content") or "")
            elif event.get("type") == "content_block_delta":
                pieces.append(event["delta"].get("text", ""))
    return answered("".join(pieces))


def asker(client: httpx.AsyncClient, path: str, stream: bool) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    return (lambda b: streamed(client, path, b)) if stream else (lambda b: post(client, path, b))


def chat_turn(history: list[Any], question: str) -> dict[str, Any]:
    head = [] if history else [{"role": "system", "content": [
        {"type": "text", "text": SYSTEM_TEXT, "cache_control": {"type": "ephemeral"}}]}]
    return {"model": "gpt-4o-mini", "tools": CHAT_TOOLS, **OPENAI_CACHE,
            "messages": [*head, *history, {"role": "user", "content": question}]}


def chat_said(answer: dict[str, Any]) -> list[Any]:
    return [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]


def responses_turn(history: list[Any], question: str) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "instructions": SYSTEM_TEXT, "tools": RESPONSES_TOOLS,
            **OPENAI_CACHE, "input": [*history, {"role": "user", "content": question}]}


def responses_said(answer: dict[str, Any]) -> list[Any]:
    text = answer["output"][0]["content"][0]["text"]
    return [{"role": "assistant", "content": text}]


def messages_turn(history: list[Any], question: str) -> dict[str, Any]:
    # a third breakpoint on the opening question, kept there on every turn (at most four a request)
    marker = {} if history else {"cache_control": {"type": "ephemeral"}}
    ask = {"role": "user", "content": [{"type": "text", "text": question, **marker}]}
    return {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": ANTHROPIC_SYSTEM,
            "tools": ANTHROPIC_TOOLS, "messages": [*history, ask]}


def messages_said(answer: dict[str, Any]) -> list[Any]:
    return [{"role": "assistant", "content": [{"type": "text", "text": answer["content"][0]["text"]}]}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_completions_keep_messages_tools_and_cache_key(tmp_path: Path, stream: bool) -> None:
    async with gateway(tmp_path) as (ups, client):
        ask = asker(client, "/v1/chat/completions", stream)
        sent = await converse(chat_turn, "messages", ask, chat_said)
    assert sent[1]["messages"][-2] == {"role": "assistant", "content": "echo: first question"}
    raw = ups.openai.bodies("/v1/chat/completions")
    assert_kept(sent, raw, ("messages", "tools", "prompt_cache_key", "prompt_cache_retention"),
                grows="messages")
    assert json.loads(raw[0])["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral"}


async def test_responses_keep_instructions_input_tools_and_cache_key(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (ups, client):
        ask = asker(client, "/v1/responses", stream=False)
        sent = await converse(responses_turn, "input", ask, responses_said)
    assert_kept(sent, ups.openai.bodies("/v1/responses"),
                ("instructions", "input", "tools", "prompt_cache_key", "prompt_cache_retention"),
                grows="input")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_messages_keep_system_tools_and_cache_control_with_ttl(tmp_path: Path, stream: bool) -> None:
    async with gateway(tmp_path) as (ups, client):
        ask = asker(client, "/v1/messages", stream)
        sent = await converse(messages_turn, "messages", ask, messages_said)
    assert sent[1]["messages"][-2]["content"][0]["text"].endswith("first question")
    raw = ups.anthropic.bodies("/v1/messages")
    assert_kept(sent, raw, ANTHROPIC_FIELDS, grows="messages")
    for got in raw:
        upstream = json.loads(got)
        assert upstream["system"][0]["cache_control"] == EPHEMERAL_1H
        assert upstream["tools"][-1]["cache_control"] == EPHEMERAL_1H
        # system and tools are the cached head: the same bytes on every turn
        assert top_level(got)["system"] == top_level(raw[0])["system"]
        assert top_level(got)["tools"] == top_level(raw[0])["tools"]


async def test_jsonrpc_chat_route_keeps_the_fields(tmp_path: Path) -> None:
    """``/rpc`` method ``chat`` with the OpenAI body as params: the body goes up as sent."""
    async with gateway(tmp_path) as (ups, client):
        async def ask(body: dict[str, Any]) -> Any:
            reply = await post(client, "/rpc", {"jsonrpc": "2.0", "method": "chat", "params": body, "id": 1})
            return reply["result"]

        sent = await converse(chat_turn, "messages", ask, chat_said)
    assert_kept(sent, ups.openai.bodies("/v1/chat/completions"),
                ("messages", "tools", "prompt_cache_key", "prompt_cache_retention"), grows="messages")


def in_order(lines: list[tuple[str, Any]]) -> list[Any]:
    """A remote batch's lines by the caller's line order: the gateway names each ``<job>-<index>``."""
    by_index = {int(cid.rsplit("-", 1)[1]): line for cid, line in lines}
    assert sorted(by_index) == list(range(len(TURNS)))
    return [by_index[i] for i in range(len(TURNS))]


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    with anyio.fail_after(15):
        while not await check():
            await anyio.sleep(0.02)  # polling as a batch client does; the end is asserted, not timed

async def run_batch(client: httpx.AsyncClient, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``rows`` uploaded as a ``/v1/batches`` file of chat lines, run to its end: the batch."""
    upload = await client.post("/v1/files", data={"purpose": "batch"}, files={
        "file": ("in.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows))})
    assert upload.status_code == 200, upload.text
    batch = await post(client, "/v1/batches", {"input_file_id": upload.json()["id"],
                                              "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})

    async def ended() -> bool:
        got = (await client.get(f"/v1/batches/{batch['id']}")).json()
        return got["status"] in ("completed", "failed", "cancelled", "expired")

    await until(ended)
    got: dict[str, Any] = (await client.get(f"/v1/batches/{batch['id']}")).json()
    return got



async def test_openai_batch_lines_keep_the_fields_in_the_uploaded_file(tmp_path: Path) -> None:
    sent = await converse(chat_turn, "messages", canned, chat_said)
    rows = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            for i, body in enumerate(sent)]
    async with gateway(tmp_path) as (ups, client):
        await run_batch(client, rows)
    inputs = [f for f in ups.openai_state.files.values() if f.purpose == "batch"]
    assert len(inputs) == 1
    lines = in_order([(json.loads(x)["custom_id"], x) for x in inputs[0].content.splitlines()])
    raw = [top_level(line)["body"] for line in lines]
    assert_kept(sent, raw, ("messages", "tools", "prompt_cache_key", "prompt_cache_retention"),
                grows="messages")


async def test_message_batch_requests_keep_system_tools_and_cache_control(tmp_path: Path) -> None:
    sent = await converse(messages_turn, "messages", canned, messages_said)
    async with gateway(tmp_path) as (ups, client):
        created = await post(client, "/v1/messages/batches", {"requests": [
            {"custom_id": f"t{i}", "params": body} for i, body in enumerate(sent)]})

        async def ended() -> bool:
            got = (await client.get(f"/v1/messages/batches/{created['id']}")).json()
            return got["processing_status"] == "ended"

        await until(ended)
    [raw_batch] = ups.anthropic.bodies("/v1/messages/batches")
    requests = [top_level(r) for r in elements(top_level(raw_batch)["requests"])]
    params = in_order([(json.loads(r["custom_id"]), r["params"]) for r in requests])
    assert_kept(sent, params, ANTHROPIC_FIELDS, grows="messages")


async def test_gemini_routes_drop_the_markers_and_keep_a_stable_contents_prefix(tmp_path: Path) -> None:
    """A translated body: no ``cache_control`` or ``prompt_cache_*`` reaches Gemini (it has no
    such field); the system text is kept whole and ``contents`` grows by appending only."""
    def gemini_chat(history: list[Any], question: str) -> dict[str, Any]:
        return {**chat_turn(history, question), "model": "gemini-test"}

    def gemini_messages(history: list[Any], question: str) -> dict[str, Any]:
        return {**messages_turn(history, question), "model": "gemini-test"}

    async with gateway(tmp_path) as (ups, client):
        await converse(gemini_chat, "messages", lambda b: post(client, "/v1/chat/completions", b), chat_said)
        await converse(gemini_messages, "messages", lambda b: post(client, "/v1/messages", b), messages_said)
    raw = ups.gemini.bodies("/v1beta/models/*")
    assert len(raw) == 6
    for got in raw:
        assert b"cache_control" not in got and b"prompt_cache" not in got and b"ttl" not in got
    for turns in (raw[:3], raw[3:]):
        assert json.loads(turns[0])["systemInstruction"]["parts"][0]["text"].startswith(SYSTEM_TEXT)
        heads = [top_level(got)["contents"] for got in turns]
        assert all(is_prefix(a, b) for a, b in pairwise(heads))
        assert len({top_level(got)["systemInstruction"] for got in turns}) == 1
        assert len({top_level(got)["tools"] for got in turns}) == 1


async def test_an_anthropic_caller_on_an_openai_route_is_refused_not_translated(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (ups, client):
        r = await client.post("/v1/messages", json={**messages_turn([], TURNS[0]), "model": "gpt-4o-mini"})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "chat" in r.json()["error"]["message"]
    assert ups.openai.seen == [] and ups.anthropic.seen == []
