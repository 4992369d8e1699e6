"""A fake OpenAI chat deployment with a prompt cache of its own, run as a child process.

Providers cache a prompt's prefix on the deployment that served it, so whether a gateway keeps
a conversation on one deployment shows up as cached tokens. This fake does the same, per process:

- a prompt is its ``tools`` (as JSON) followed by its messages (each as JSON); a part's tokens
  are its characters / 4, rounded up;
- after each request it remembers every message-boundary prefix of that prompt for ``--ttl``
  seconds (OpenAI: 5 to 10 minutes idle);
- a request's cached tokens are the tokens of the longest remembered prefix, when that is at
  least ``--min-tokens`` (OpenAI: 1,024), else 0, answered as
  ``usage.prompt_tokens_details.cached_tokens`` like the real API.

``POST /control {"fail": true}`` makes it answer every chat call 500 (a failing deployment);
``{"reset": true}`` forgets its cache and counts. ``GET /stats``: its counts.

    python -m benchmarks._cache_fake --port 8101 --name d1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def tokens(text: str) -> int:
    """Tokens as characters / 4: close to a BPE count for English text, and cheap."""
    return math.ceil(len(text) / 4)


def prompt_parts(body: dict[str, Any]) -> list[str]:
    """The prompt in cache order: tools first (providers render them ahead of the messages)."""
    parts = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
    return parts + [json.dumps(m, sort_keys=True) for m in body.get("messages", [])]


@dataclass
class PromptCache:
    """Remembered prefixes (a SHA-256 chained over the parts) -> (tokens, expiry)."""

    ttl_s: float = 300.0
    min_tokens: int = 1024
    clock: Callable[[], float] = time.monotonic
    seen: dict[bytes, tuple[int, float]] = field(default_factory=dict)

    def lookup_and_remember(self, parts: list[str]) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of one request; its prefixes are remembered after."""
        now = self.clock()
        digest, total, cached, prefixes = b"", 0, 0, []
        for part in parts:
            digest = hashlib.sha256(digest + part.encode()).digest()
            total += tokens(part)
            hit = self.seen.get(digest)
            if hit is not None and hit[1] > now:
                cached = hit[0]
            prefixes.append((digest, total))
        for digest, count in prefixes:
            self.seen[digest] = (count, now + self.ttl_s)
        return total, cached if cached >= self.min_tokens else 0


@dataclass
class Deployment:
    name: str
    cache: PromptCache
    failing: bool = False
    calls: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.calls += 1
            if self.failing:
                self.failed += 1
                error = {"message": f"{self.name} is down", "type": "server_error"}
                return JSONResponse({"error": error}, 500)
            prompt, cached = self.cache.lookup_and_remember(prompt_parts(body))
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            answer = {"role": "assistant", "content": f"Noted, turn {len(body['messages'])}."}
            return JSONResponse({
                "id": f"chatcmpl-{self.name}-{self.calls}", "object": "chat.completion", "created": 0,
                "model": body.get("model", "fake"), "system_fingerprint": self.name,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": answer}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5,
                          "prompt_tokens_details": {"cached_tokens": cached}}})

        async def control(request: Request) -> Response:
            body = await request.json()
            if body.get("reset"):
                self.cache.seen.clear()
                self.calls = self.failed = self.prompt_tokens = self.cached_tokens = 0
            if "fail" in body:
                self.failing = bool(body["fail"])
            return await stats(request)

        async def stats(_: Request) -> Response:
            return JSONResponse({"name": self.name, "calls": self.calls, "failed": self.failed,
                                 "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                                 "failing": self.failing})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/control", control, methods=["POST"]),
                                 Route("/stats", stats, methods=["GET"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="d1")
    ap.add_argument("--ttl", type=float, default=300.0, help="seconds a prefix is remembered")
    ap.add_argument("--min-tokens", type=int, default=1024, help="fewest tokens a cache hit counts")
    args = ap.parse_args()
    deployment = Deployment(args.name, PromptCache(args.ttl, args.min_tokens))
    uvicorn.run(deployment.app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
