"""A gateway in front of one fake app that plays both an OpenAI and an Anthropic upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.serve import serve_app

KEY = "sk-gateway-test"  # the gateway's own key for its clients


@asynccontextmanager
async def gateway_before(upstream: Starlette, tmp_path: Path) -> AsyncIterator[str]:
    """The gateway's URL: route ``chat`` (OpenAI, model gpt-4o-mini) to ``upstream``'s ``/v1``,
    route ``claude`` (Anthropic, model claude-sonnet-4-5) to its root."""
    async with serve_app(upstream) as up:
        config = {
            "server": {"api_keys": {"alice": KEY}},
            "store": {"path": str(tmp_path / "jobs.db")},
            "providers": {"oai": {"kind": "openai", "base_url": up + "/v1", "api_key": "sk-up"},
                          "claude": {"kind": "anthropic", "base_url": up, "api_key": "up"}},
            "routes": {"chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"]},
                       "claude": {"provider": "claude", "operation": "messages",
                                  "models": ["claude-sonnet-4-5"]}},
        }
        async with running(parse_config(config), port=0) as (_, url):
            yield url
