"""A ``/v1`` caller's session: the ``x-session-id`` header, as ``Call.session``. Model groups and
a provider's ``base_urls`` keep the calls of one session on one deployment, so its prompt cache is
read, not written again (``core/cache_affinity.py``). The header never goes upstream."""

from __future__ import annotations

from multiplexer.core.errors import invalid_request
from multiplexer.faces.v1.common import HttpError

HEADER = b"x-session-id"
MAX_CHARS = 256


def session_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The caller's session id, or None when it names none (or an empty one). Longer than
    ``MAX_CHARS``: a 400 naming the header."""
    for key, value in headers:
        if key == HEADER:
            text = value.decode("latin-1").strip()
            if len(text) > MAX_CHARS:
                raise HttpError(400, invalid_request(
                    f"x-session-id must be at most {MAX_CHARS} characters; got {len(text)}"),
                    param="x-session-id")
            return text or None
    return None
