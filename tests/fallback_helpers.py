"""Two or three OpenAI-style upstreams behind respx that answer what a test scripts: a status, a
connection failure, a timeout, a context-length refusal or a malformed body, in turn; each
counts the requests it got. Used by the fallback, breaker and group tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import respx

from multiplexer.core.clock import MonotonicClock
from multiplexer.core.provider import Provider
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from providers.openai import OpenAIProvider
from tests.remote_helpers import body, chat_reply, make_provider

CONTEXT_REFUSAL = {"error": {"message": "This model's maximum context length is 8192 tokens.",
                             "type": "invalid_request_error", "param": "messages",
                             "code": "context_length_exceeded"}}


def base(name: str) -> str:
    return f"http://{name}.test/v1"


class Upstream:
    """One fake provider: ``script`` is what its next requests get (then ``ok`` forever)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.script: list[Any] = []
        self.always: Any = "ok"
        self.requests: list[dict[str, Any]] = []

    def answer(self, *steps: Any) -> Upstream:
        self.script = list(steps)
        return self

    def forever(self, step: Any) -> Upstream:
        self.always = step
        return self

    def __call__(self, request: httpx.Request) -> httpx.Response:
        sent = body(request)
        self.requests.append(sent)
        step = self.script.pop(0) if self.script else self.always
        if step == "ok":
            return httpx.Response(200, json=chat_reply(f"from {self.name}"))
        if step == "connect":
            raise httpx.ConnectError("refused", request=request)
        if step == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if step == "malformed":
            return httpx.Response(200, content=b"<html>oops</html>")
        if step == "context":
            return httpx.Response(400, json=CONTEXT_REFUSAL)
        if isinstance(step, int):
            return httpx.Response(step, json={"error": {"message": f"status {step}",
                                                        "type": "error", "code": str(step)}})
        raise AssertionError(step)

    @property
    def count(self) -> int:
        return len(self.requests)


def upstreams(*names: str) -> tuple[respx.MockRouter, dict[str, Upstream]]:
    router = respx.MockRouter(assert_all_called=False)
    ups = {n: Upstream(n) for n in names}
    for n, up in ups.items():
        router.post(f"{base(n)}/chat/completions").mock(side_effect=up)
    return router, ups


def gateway(tmp_path: Path, router: respx.MockRouter, names: Iterable[str], routes: dict[str, Any],
            *, groups: dict[str, Any] | None = None, breaker: dict[str, Any] | None = None,
            attempts: int = 3, clock: Any = None, state: dict[str, Any] | None = None,
            tracer: Any = None, **extra: Any) -> Gateway:
    """A gateway over providers ``names`` (each ``http://NAME.test/v1``); ``routes`` as in a config."""
    names = list(names)
    providers_conf = {n: {"kind": "openai", "base_url": base(n), "batch": {"max_items": 1},
                          **({"breaker": breaker} if breaker else {})} for n in names}
    data: dict[str, Any] = {"providers": providers_conf, "routes": routes, **extra}
    if groups:
        data["groups"] = groups
    if state:
        data["state"] = state
    config = parse_config(data)
    clock = clock or MonotonicClock()  # retries wait 10 to 100 ms
    providers: dict[str, Provider] = {
        n: make_provider(OpenAIProvider, {"base_url": base(n), "api_key": "k"}, tmp_path, clock, name=n,
                         attempts=attempts, transport=httpx.MockTransport(router.async_handler),
                         **({"tracer": tracer} if tracer is not None else {}))
        for n in names}
    return Gateway(config, providers=providers, clock=clock, tracer=tracer)


def chat(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


def answered_by(result: Any) -> str:
    return result["choices"][0]["message"]["content"].removeprefix("from ")
