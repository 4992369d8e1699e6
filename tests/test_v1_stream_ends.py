"""An upstream stream that stops before its last event (``[DONE]``, ``message_stop``,
``response.completed``) broke off: the client gets an error event, not a stream that looks
complete."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.fakes.v1_upstream import KEY, gateway_before

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio

CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "half"},
                      "finish_reason": None}]}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
           "content": [], "stop_reason": None, "stop_sequence": None,
           "usage": {"input_tokens": 1, "output_tokens": 1}}
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress",
            "model": "gpt-4o-mini", "output": [], "usage": None}

MESSAGE_EVENTS: list[tuple[str | None, dict[str, Any]]] = [
    ("message_start", {"type": "message_start", "message": MESSAGE}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "half"}})]


def cut(events: list[tuple[str | None, dict[str, Any]]]) -> Any:
    """An endpoint streaming ``events``, then ending cleanly without the stream's last event."""
    async def endpoint(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for name, data in events:
                yield (f"event: {name}\n" if name else "").encode() + f"data: {json.dumps(data)}\n\n".encode()
        return StreamingResponse(body(), media_type="text/event-stream")
    return endpoint


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[str]:
    upstream = Starlette(routes=[
        Route("/v1/chat/completions", cut([(None, CHUNK)]), methods=["POST"]),
        Route("/v1/responses", cut([("response.created", {"type": "response.created",
                                                          "sequence_number": 0,
                                                          "response": RESPONSE})]), methods=["POST"]),
        Route("/v1/messages", cut(MESSAGE_EVENTS), methods=["POST"]),
    ])
    async with gateway_before(upstream, tmp_path) as url:
        yield url


async def test_a_chat_stream_cut_short_upstream_ends_in_an_error_event(tmp_path):
    async with gateway(tmp_path) as url, openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True)
        got = []
        with pytest.raises(openai.APIError, match="ended before its last event"):
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)
        assert got == ["half"]


async def test_a_responses_stream_cut_short_upstream_ends_in_an_error_event(tmp_path):
    async with gateway(tmp_path) as url, openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
        stream = await client.responses.create(model="gpt-4o-mini", input="hi", stream=True)
        events = [event async for event in stream]
        assert [e.type for e in events] == ["response.created", "error"]
        assert "ended before its last event" in events[-1].message


async def test_a_message_stream_cut_short_upstream_ends_in_an_error_event(tmp_path):
    async with gateway(tmp_path) as url, anthropic.AsyncAnthropic(
            base_url=url, api_key=KEY, max_retries=0) as client:
        pieces = []
        with pytest.raises(anthropic.APIStatusError, match="ended before its last event"):
            async with client.messages.stream(model="claude-sonnet-4-5", max_tokens=8,
                                              messages=[{"role": "user", "content": "hi"}]) as stream:
                async for text in stream.text_stream:
                    pieces.append(text)
        assert pieces == ["half"]
