"""One whole HTTP reply, as the faces build them: status, headers and a body known in full.

The gateway's own server (``faces/server_protocol.py``) writes it to the socket in one send
for endpoints it calls directly; under any ASGI server it is an ASGI app of its own (start
and body messages), so a face returns the same object on either path.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Headers = list[tuple[bytes, bytes]]
JSON_HEADERS: Headers = [(b"content-type", b"application/json")]


class Reply:
    """``headers`` are the reply's own, lower case and valid; ``content-length`` is added."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes = b"", headers: Headers | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else []

    def head(self) -> Headers:
        """The headers to send, content length included (none for a 204)."""
        if self.status == 204:
            return self.headers
        return [*self.headers, (b"content-length", str(len(self.body)).encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.head()})
        await send({"type": "http.response.body", "body": self.body})


@runtime_checkable
class DirectEndpoint(Protocol):
    """An endpoint the gateway's own server calls without ASGI, for a request whose body has
    arrived whole, with a declared length within ``limit``: one call in, one ``Reply`` out. The
    server cancels the call if the client goes away first; anything else (a longer body, a
    chunked one, ``Expect: 100-continue``, another server) goes through the endpoint's ASGI app,
    and so does a request for which ``direct`` returns None (a stream), its body already read."""

    limit: int

    async def direct(self, scope: Scope, body: bytes) -> Reply | None: ...


async def whole_reply(app: ASGIApp, scope: Scope, body: bytes) -> Reply:
    """An ASGI endpoint that answers in one piece, run as a direct one: its ``receive`` gives
    the whole body, then waits as ASGI's does until the server cancels the request."""
    given = False
    status, headers, parts = 500, [], []

    async def receive() -> Message:
        nonlocal given
        if given:
            await anyio.sleep_forever()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
        elif message.get("more_body"):
            raise RuntimeError("a direct endpoint answers in one piece")
        else:
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    if not parts:
        raise RuntimeError("the endpoint returned without answering")
    return Reply(status, b"".join(parts), headers)
