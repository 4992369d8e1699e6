"""A request's size limits, for every HTTP face: its body within ``server.max_body_bytes``
(an upload's within ``server.max_file_bytes``), its headers within ``server.max_header_bytes``.

A declared ``content-length`` over the cap is refused before a byte is read; an
undeclared or lying one is cut off as soon as the running total passes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from itertools import chain

from starlette.types import Receive


def headers_over(headers: list[tuple[bytes, bytes]], limit: int) -> bool:
    """Whether a request's headers pass ``server.max_header_bytes`` (or 200 lines)."""
    # counted in C (every request pays this): names and values, plus ": " and CRLF per line
    return len(headers) > 200 or sum(map(len, chain.from_iterable(headers))) + 4 * len(headers) > limit


class BodyTooLarge(Exception):
    """The body is over the cap: the face answers 413 in its own error shape."""


class ClientGone(Exception):
    """The client disconnected before the body was complete: nothing is owed."""


async def read_body(content_length: bytes | str | None, receive: Receive, limit: int) -> bytes:
    """The whole body, or BodyTooLarge / ClientGone."""
    return b"".join([chunk async for chunk in body_chunks(content_length, receive, limit)])


async def body_chunks(content_length: bytes | str | None, receive: Receive,
                      limit: int) -> AsyncIterator[bytes]:
    """The body as it arrives, a chunk at a time (for one too large to hold: an upload), or
    BodyTooLarge / ClientGone as soon as either is known."""
    if content_length and content_length.isdigit() and int(content_length) > limit:
        raise BodyTooLarge
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        more = message.get("more_body", False)
        if chunk:
            yield chunk
