"""JSON-RPC batch arrays on /mcp, for the one revision that had them (2025-03-26).

2025-03-26 servers must accept batches; 2025-06-18 removed them, and later
revisions answer an array with Invalid Request. For a 2025-03-26 session each
element is served as its own POST by the SDK's transport (same headers, same
session) and the replies are gathered into one JSON array, in element order.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from multiplexer.core.errors import invalid_request
from multiplexer.core.gather import gather
from multiplexer.core.jsonrpc import error_response

BATCH_REVISIONS = frozenset({"2025-03-26"})


def _sse_messages(body: bytes) -> list[Any]:
    out = []
    for event in body.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[5:].lstrip() for line in event.split("\n") if line.startswith("data:"))
        if data:
            try:
                out.append(json.loads(data))
            except ValueError:
                continue
    return out


async def run_asgi(app: ASGIApp, scope: Scope, body: bytes) -> tuple[int, str, bytes]:
    """One request through an ASGI app in process: status, content type (lower case) and body.

    The request's disconnect comes only once the app has returned, as from a client that
    reads the whole answer.
    """
    finished = anyio.Event()
    delivered = False
    status = 0
    content_type = ""
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, content_type
        if message["type"] == "http.response.start":
            status = message["status"]
            for k, v in message.get("headers", []):
                if k.lower() == b"content-type":
                    content_type = v.decode("latin-1").lower()
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return status, content_type, b"".join(chunks)


async def _serve_one(app: ASGIApp, scope: Scope, item: Any) -> Any:
    """One element through the transport; its JSON-RPC reply, or None for a notification."""
    if not isinstance(item, dict):
        return error_response(None, invalid_request("a batch element must be a JSON object"))
    body = json.dumps(item, separators=(",", ":")).encode()
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    sub = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    status, content_type, raw = await run_asgi(app, sub, body)
    rid = item.get("id")
    if status == 202 or "id" not in item:
        return None
    messages = _sse_messages(raw) if content_type.startswith("text/event-stream") else []
    if content_type.startswith("application/json"):
        try:
            messages = [json.loads(raw)]
        except ValueError:
            messages = []
    for message in messages:
        if isinstance(message, dict) and ("result" in message or "error" in message):
            return {**message, "id": rid}
    return error_response(rid, invalid_request(f"no reply for this element (HTTP {status})"))


async def serve_batch(app: ASGIApp, scope: Scope, items: list[Any], receive: Receive, send: Send) -> None:
    if not items:
        reply: Any = error_response(None, invalid_request("empty batch"))
        await Response(json.dumps(reply), 400, media_type="application/json")(scope, receive, send)
        return
    if any(isinstance(i, dict) and i.get("method") == "initialize" for i in items):
        reply = error_response(None, invalid_request("initialize must not be part of a batch"))
        await Response(json.dumps(reply), 400, media_type="application/json")(scope, receive, send)
        return
    replies = await gather(lambda item: _serve_one(app, scope, item), items)
    gathered = [r for r in replies if r is not None]
    if not gathered:
        await Response(status_code=202)(scope, receive, send)
        return
    await Response(json.dumps(gathered, separators=(",", ":")), 200,
                   media_type="application/json")(scope, receive, send)
