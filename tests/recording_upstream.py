"""An upstream that keeps every request body exactly as its bytes arrived.

The fakes parse what they receive, which hides what a provider's prompt cache keys on: the bytes.
``Recording`` wraps any fake's ASGI app (so answers keep the API's shape), reads each request's
whole body first, keeps it, and hands the same bytes on to the fake.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Recording", "elements", "top_level"]


@dataclass
class Recording:
    """``seen``: (method, path, raw body) of every HTTP request, in arrival order."""

    app: ASGIApp
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        body = b"".join(chunks)
        self.seen.append((scope["method"], scope["path"], body))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def bodies(self, path: str) -> list[bytes]:
        """The raw bodies POSTed to ``path`` (exact) or, ending in ``*``, to paths it starts."""
        if path.endswith("*"):
            return [b for m, p, b in self.seen if m == "POST" and p.startswith(path[:-1])]
        return [b for m, p, b in self.seen if m == "POST" and p == path]


_SPACE = re.compile(r"\s*")


def top_level(raw: bytes) -> dict[str, bytes]:
    """Each top-level key of a JSON object mapped to its value's bytes as they were sent, so a
    test compares serialized prefixes, not just parsed values."""
    text, decoder = raw.decode(), json.JSONDecoder()
    found: dict[str, bytes] = {}
    at = _SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if text[at] != "{":
        raise ValueError("not a JSON object")
    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    while text[at] != "}":
        key: Any
        key, at = decoder.raw_decode(text, at)
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if text[at] != ":":
            raise ValueError(f"expected ':' at {at}")
        start = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
        _, end = decoder.raw_decode(text, start)
        found[key] = text[start:end].encode()
        at = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if text[at] == ",":
            at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    return found


def elements(raw: bytes) -> list[bytes]:
    """Each element of a JSON array as its bytes were sent."""
    text, decoder = raw.decode(), json.JSONDecoder()
    at = _SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if text[at] != "[":
        raise ValueError("not a JSON array")
    found = []
    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    while text[at] != "]":
        _, end = decoder.raw_decode(text, at)
        found.append(text[at:end].encode())
        at = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if text[at] == ",":
            at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    return found
