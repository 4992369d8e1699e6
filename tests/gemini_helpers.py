"""Shared pieces for the Gemini tests: the fake on 127.0.0.1 and a gateway config pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.fakes.gemini_fake import FakeGeminiState, create_app
from tests.fakes.serve import serve_app

KEY = "g-test-key"


@asynccontextmanager
async def gemini_fake(**knobs: Any) -> AsyncIterator[tuple[FakeGeminiState, str]]:
    state = FakeGeminiState(**knobs)
    async with serve_app(create_app(state)) as url:
        yield state, url


def gemini_config(url: str, tmp_path: Path, **provider: Any) -> dict[str, Any]:
    """Two providers on one fake: ``gem`` sends small batches inline, ``gemfile`` always uploads a
    file; routes for chat, embeddings and a batch route on each."""
    fast = {"batch_poll_interval_s": 0.01, "retry": {"attempts": 3, "base_wait_ms": 1, "max_wait_ms": 5}}
    base = {"kind": "gemini", "base_url": url, "api_key": KEY, **fast, **provider}
    batch = {"max_items": 1000, "max_wait_ms": 50}
    return {
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"gem": {**base, "batch": {"max_items": 256, "max_wait_ms": 5}},
                      "gemfile": {**base, "batch_inline_max_bytes": 0}},
        "routes": {
            "gchat": {"provider": "gem", "operation": "chat", "params": {"model": "gemini-test"},
                      "models": ["gemini-test"]},
            "gembed": {"provider": "gem", "operation": "embeddings", "params": {"model": "embed-test"},
                       "models": ["embed-test"]},
            "gbatch": {"provider": "gem", "operation": "chat", "mode": "batch",
                       "params": {"model": "gemini-test"}, "batch": batch, "models": ["gemini-batch"]},
            "gbatch_file": {"provider": "gemfile", "operation": "chat", "mode": "batch",
                            "params": {"model": "gemini-test"}, "batch": batch},
        },
    }


def native(text: str, **extra: Any) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], **extra}


def gemini_text(result: Any) -> Any:
    """The answer text of a GenerateContentResponse (or the error itself)."""
    if not isinstance(result, dict):
        return result
    return "".join(p.get("text", "") for p in result["candidates"][0]["content"]["parts"])
