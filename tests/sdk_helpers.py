"""The official OpenAI and Anthropic SDKs pointed at a gateway, closed with it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Clients:
    url: str
    openai: Any  # openai.AsyncOpenAI on <url>/v1
    anthropic: Any  # anthropic.AsyncAnthropic on <url>


@asynccontextmanager
async def sdk_clients(url: str) -> AsyncIterator[Clients]:
    """No retries: a test sees the first answer."""
    import anthropic
    import openai

    async with (
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as o,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as a,
    ):
        yield Clients(url, o, a)
