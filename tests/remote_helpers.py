"""Shared pieces for the remote provider and batch job tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

from multiplexer.call import Item
from multiplexer.config import ProviderConfig, RouteConfig
from multiplexer.limiter import RateLimiter
from multiplexer.metrics import Metrics
from multiplexer.provider import Provider, ProviderContext


class InstantClock:
    """Sleeps return at once but move time forward, and are recorded: tests assert the waits."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep_until(self, deadline: float) -> None:
        self.sleeps.append(round(max(0.0, deadline - self.t), 6))
        self.t = max(self.t, deadline)
        await anyio.lowlevel.checkpoint()

    async def wait_event(self, event: anyio.Event, deadline: float | None) -> bool:
        await event.wait()
        return True


def make_provider(cls: type[Provider], settings: dict[str, Any], tmp_path: Path,
                  clock: Any = None, *, name: str = "p", rpm: float | None = None,
                  tpm: float | None = None, attempts: int = 3, concurrency: int = 4,
                  ) -> Provider:
    clock = clock or InstantClock()
    conf = ProviderConfig.model_validate({
        "kind": "x", **settings,
        "limits": {"rpm": rpm, "tpm": tpm, "concurrency": concurrency},
        "retry": {"attempts": attempts, "base_wait_ms": 10, "max_wait_ms": 100},
    })
    ctx = ProviderContext(
        name=name, config=conf, settings=cls.Settings.model_validate(conf.extra), clock=clock,
        limiter=RateLimiter(clock, rpm, tpm), metrics=Metrics(),
        store_path=tmp_path / "jobs.db",
    )
    return cls(ctx)


@asynccontextmanager
async def started(provider: Provider) -> AsyncIterator[Provider]:
    await provider.start()
    try:
        yield provider
    finally:
        await provider.aclose()


def item(provider: Provider, operation: str, params: dict[str, Any], *, mode: str = "sync",
         deadline: float | None = None) -> Item:
    it = Item(route="r", operation=operation, method="m", params=params, deadline=deadline,
              options={"mode": mode})
    provider.prepare(RouteConfig(provider="p", operation=operation, mode=mode), it)  # type: ignore[arg-type]
    return it


def body(request: httpx.Request) -> Any:
    return json.loads(request.content)


def embedding_reply(inputs: list[Any], model: str = "m", shuffle: bool = False,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An embeddings body whose vector encodes the input, so a test can check who got what."""
    data = [{"object": "embedding", "index": i, "embedding": [float(len(str(x))), float(i)],
             "text": x} for i, x in enumerate(inputs)]
    if shuffle:
        data.reverse()
    tokens = sum(len(str(x).split()) for x in inputs)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, **(extra or {})}


def chat_reply(text: str, prompt_tokens: int = 5, completion_tokens: int = 2) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
