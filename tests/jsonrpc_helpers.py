"""Shared helpers for end-to-end tests against a real JSON-RPC upstream."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx

from examples.jsonrpc_upstream import UpstreamState, create_app
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.serve import serve_app


def calc_config(url: str, **overrides: Any) -> dict[str, Any]:
    provider = {"kind": "jsonrpc", "url": url, "batch": {"max_items": 100, "max_wait_ms": 2},
                "limits": {"rpm": 600000, "concurrency": 16},
                "retry": {"attempts": 3, "base_wait_ms": 1, "max_wait_ms": 5}}
    provider.update(overrides.pop("provider", {}))
    conf: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, **overrides.pop("server", {})},
        "providers": {"calc": provider},
        "routes": {
            "subtract": {"provider": "calc"},
            "sum": {"provider": "calc", "dedup": True},
            "get_data": {"provider": "calc"},
            "notify_hello": {"provider": "calc"},
            "echo": {"provider": "calc"},
            "sleep": {"provider": "calc"},
            "wait": {"provider": "calc"},
            "fail": {"provider": "calc"},
            "minus": {"provider": "calc", "method": "subtract"},
            "calc_*": {"provider": "calc"},
        },
    }
    conf["routes"].update(overrides.pop("routes", {}))
    conf.update(overrides)
    return conf


@asynccontextmanager
async def gateway_with_upstream(
    state: UpstreamState | None = None, **overrides: Any
) -> AsyncIterator[tuple[str, UpstreamState, Any]]:
    """Upstream + gateway on ephemeral ports; yields (gateway url, upstream state, gateway)."""
    state = state or UpstreamState()
    async with serve_app(create_app(state)) as upstream_url:
        config = parse_config(calc_config(upstream_url + "/", **overrides))
        async with running(config, port=0) as (gateway, url):
            yield url, state, gateway


async def post(url: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        content = body if isinstance(body, bytes) else None
        return await client.post(f"{url}/rpc", content=content,
                                 json=None if content is not None else body, **kwargs)


@contextmanager
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections: bound (so nothing else takes it), never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
