"""Shared pieces for the remote provider and batch job tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

from multiplexer.core.call import Item
from multiplexer.core.limiter import RateLimiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.provider import Provider, ProviderContext
from multiplexer.core.tracing import NOOP
from multiplexer.gateway.config import ProviderConfig, RouteConfig


class InstantClock:
    """Sleeps return at once but move time forward, and are recorded: tests assert the waits."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_700_000_000.0 + self.t

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
                  transport: httpx.AsyncBaseTransport | None = None, tracer: Any = NOOP,
                  ) -> Provider:
    """``transport``: httpx's own by default, which ``respx.mock`` patches; or a respx router
    handed in (``httpx.MockTransport(router.async_handler)``)."""
    clock = clock or InstantClock()
    conf = ProviderConfig.model_validate({
        "kind": "x", **settings,
        "limits": {"rpm": rpm, "tpm": tpm, "concurrency": concurrency},
        "retry": {"attempts": attempts, "base_wait_ms": 10, "max_wait_ms": 100},
    })
    ctx = ProviderContext(
        name=name, config=conf, settings=cls.Settings.model_validate(conf.extra), clock=clock,
        limiter=RateLimiter(clock, rpm, tpm), metrics=Metrics(),
        store_path=tmp_path / "jobs.db", transport=transport or httpx.AsyncHTTPTransport(),
        tracer=tracer,
    )
    return cls(ctx)


@asynccontextmanager
async def started(provider: Provider) -> AsyncIterator[Provider]:
    await provider.start()
    try:
        yield provider
    finally:
        await provider.aclose()


async def die_after_create(api: Any, provider: Any, items: list[Item]) -> None:
    """Run a batch job until the remote batch is created, then stop as a killed process would:
    the reply with its id is never read. ``api`` is a respx fake with ``create`` / ``create_route``;
    creating works normally again afterwards."""
    created = anyio.Event()

    async def create_then_hang(request: httpx.Request) -> Any:
        api.create(request)
        created.set()
        await anyio.sleep_forever()

    api.create_route.mock(side_effect=create_then_hang)
    async with started(provider), anyio.create_task_group() as tg:
        tg.start_soon(provider.jobs.run_items, items)
        await created.wait()
        tg.cancel_scope.cancel()
    api.create_route.mock(side_effect=api.create)


async def restart_until_done(provider: Any) -> tuple[Any, list[Any]]:
    """Start ``provider`` on the store a dead one left; (its open part as found, the job's rows once done)."""
    store = provider.jobs.store()
    part = (await store.run(store.open_parts, "p"))[0]
    done = provider.jobs.watch(part.job_id)
    async with started(provider):
        await done.wait()
        rows = await store.run(store.page, part.job_id, 0, 10)
    return part, rows


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


# -- end-to-end against the fake servers ------------------------------------------

class Fakes:
    def __init__(self, openai: Any, anthropic: Any, openai_url: str, anthropic_url: str) -> None:
        self.openai, self.anthropic = openai, anthropic
        self.openai_url, self.anthropic_url = openai_url, anthropic_url


@asynccontextmanager
async def fakes(**openai_knobs: Any) -> AsyncIterator[Fakes]:
    from tests.fakes.anthropic_fake import FakeAnthropicState
    from tests.fakes.anthropic_fake import create_app as anthropic_app
    from tests.fakes.openai_fake import FakeOpenAIState
    from tests.fakes.openai_fake import create_app as openai_app
    from tests.fakes.serve import serve_app

    ostate, astate = FakeOpenAIState(**openai_knobs), FakeAnthropicState()
    async with serve_app(openai_app(ostate)) as ourl, serve_app(anthropic_app(astate)) as aurl:
        yield Fakes(ostate, astate, ourl, aurl)


def remote_config_data(f: Fakes, tmp_path: Path) -> dict[str, Any]:
    """The issue's contract config, pointed at the fakes, with fast polling."""
    fast = {"batch_poll_interval_s": 0.01, "retry": {"attempts": 3, "base_wait_ms": 1, "max_wait_ms": 5}}
    return {
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {
            "oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-test",
                    "batch": {"max_items": 256, "max_wait_ms": 5}, **fast},
            "claude": {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "test", **fast},
        },
        "routes": {
            "embed": {"provider": "oai", "operation": "embeddings",
                      "params": {"model": "text-embedding-3-small"}},
            "chat": {"provider": "oai", "operation": "chat"},
            "chat_batch": {"provider": "oai", "operation": "chat", "mode": "batch",
                           "params": {"model": "gpt-test"},
                           "batch": {"max_items": 50000, "max_wait_ms": 50}},
            "claude": {"provider": "claude", "operation": "messages",
                       "params": {"model": "claude-test", "max_tokens": 32}},
            "claude_batch": {"provider": "claude", "operation": "messages", "mode": "batch",
                             "params": {"model": "claude-test", "max_tokens": 32},
                             "batch": {"max_items": 1000, "max_wait_ms": 50}},
        },
    }


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


def reply_text(result: Any) -> Any:
    """The assistant text of an OpenAI or Anthropic reply (or the error itself)."""
    if not isinstance(result, dict):
        return result
    if "choices" in result:
        return result["choices"][0]["message"]["content"]
    return result["content"][0]["text"]


class Events:
    """Collects gateway notifications; a test waits for one instead of sleeping."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self._waiters: list[tuple[str, anyio.Event]] = []

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        self.seen.append((event, data))
        for name, ev in self._waiters:
            if name == event:
                ev.set()

    async def wait(self, event: str, count: int = 1, timeout: float = 90) -> None:
        """Until ``event`` was seen ``count`` times; a hang fails naming what was seen instead."""
        try:
            with anyio.fail_after(timeout):
                while sum(1 for name, _ in self.seen if name == event) < count:
                    ev = anyio.Event()
                    self._waiters.append((event, ev))
                    await ev.wait()
                    self._waiters.remove((event, ev))
        except TimeoutError:
            raise AssertionError(f"no {event!r} x{count} within {timeout} s; seen: {self.seen}") from None
