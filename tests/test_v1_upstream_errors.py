"""An upstream's own error body reaches the client through the ``/v1`` surfaces: its message,
``code`` and ``param`` (what the SDKs expose and tools branch on, e.g. OpenAI's
``context_length_exceeded``), not the raw body as text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.fakes.v1_upstream import KEY, gateway_before

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio

PROMPT_TOO_LONG = "prompt is too long: 210000 tokens > 200000 maximum"
TOO_LONG = ("This model's maximum context length is 128000 tokens. However, your messages resulted "
            "in 131072 tokens (130000 in the messages, 1072 in the functions). Please reduce the "
            "length of the messages or functions. " + "x" * 200)


async def openai_refusal(request: Request) -> JSONResponse:
    return JSONResponse({"error": {"message": TOO_LONG, "type": "invalid_request_error",
                                   "param": "messages", "code": "context_length_exceeded"}}, 400)


async def anthropic_refusal(request: Request) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": PROMPT_TOO_LONG}}, 400)


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[str]:
    upstream = Starlette(routes=[Route("/v1/chat/completions", openai_refusal, methods=["POST"]),
                                 Route("/v1/messages", anthropic_refusal, methods=["POST"])])
    async with gateway_before(upstream, tmp_path) as url:
        yield url


async def test_openai_upstream_error_keeps_its_message_code_and_param(tmp_path):
    async with gateway(tmp_path) as url, openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=stream)
            assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
            assert e.value.body["message"] == "Upstream error: " + TOO_LONG


async def test_anthropic_upstream_error_keeps_its_message_and_type(tmp_path):
    async with gateway(tmp_path) as url, anthropic.AsyncAnthropic(
            base_url=url, api_key=KEY, max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="claude-sonnet-4-5", max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"] == {
            "type": "invalid_request_error",
            "message": "Upstream error: " + PROMPT_TOO_LONG}
