"""``x-session-id`` on ``/v1``: the session keys a model group's affinity (``affinity: session``)
end to end through a running gateway, so one session's calls keep to one route and sessions
spread; an over-long header is a 400 in the face's shape; the body's ``metadata.session_id`` or
``user`` keys a session where no header does."""

from __future__ import annotations

from collections import defaultdict
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from multiplexer.core.cache_affinity import body_session, call_key
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.openai_fake import FakeOpenAIState
from tests.fakes.openai_fake import create_app as openai_app
from tests.fakes.serve import serve_app

pytestmark = pytest.mark.anyio
NAMES = ("r0", "r1", "r2")


def config(urls: dict[str, str]) -> Any:
    return parse_config({
        "providers": {n: {"kind": "openai", "base_url": f"{urls[n]}/v1", "api_key": "sk-test"}
                      for n in NAMES},
        "routes": {n: {"provider": n, "operation": "chat", "params": {"model": f"gpt-{n}"}} for n in NAMES},
        "groups": {"gpt-x": {"routes": list(NAMES), "affinity": "session"}},
    }, env={})


async def test_one_session_keeps_to_one_route_and_sessions_spread() -> None:
    states = {n: FakeOpenAIState() for n in NAMES}
    async with AsyncExitStack() as stack:
        urls = {n: await stack.enter_async_context(serve_app(openai_app(states[n]))) for n in NAMES}
        _, url = await stack.enter_async_context(running(config(urls), port=0))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        served: dict[int, set[str]] = defaultdict(set)
        for turn in range(3):
            for s in range(12):
                body = {"model": "gpt-x", "messages": [{"role": "user", "content": f"turn {turn}"}]}
                reply = await http.post(f"{url}/v1/chat/completions", json=body,
                                        headers={"x-session-id": f"session-{s}"})
                assert reply.status_code == 200, reply.text
                served[s].add(reply.headers["x-multiplexer-route"])
        assert all(len(routes) == 1 for routes in served.values()), served
        assert len({next(iter(r)) for r in served.values()}) == 3
        long = await http.post(f"{url}/v1/chat/completions", headers={"x-session-id": "x" * 300},
                               json={"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]})
        assert long.status_code == 400
        assert "x-session-id" in long.json()["error"]["message"]


def test_the_body_names_a_session_in_session_mode_and_a_header_wins() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert call_key(chat, "session") is None
    assert body_session({**chat, "metadata": {"session_id": "a"}}) == "a"
    assert body_session({**chat, "metadata": {"user_id": "u"}}) == "u"
    assert body_session({**chat, "user": "v"}) == "v"
    named = call_key({**chat, "user": "v"}, "session")
    assert named is not None and named == call_key(chat, "session", "v")
    assert call_key({**chat, "user": "v"}, "prefix") != named  # prefix mode hashes the prompt
    assert call_key(chat, "prefix", "v") == named  # a header keys in every mode
    assert call_key({**chat, "prompt_cache_key": "k"}, "session", "v") != named  # the key wins
