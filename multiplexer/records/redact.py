"""What a record keeps of a body: secrets' values masked, the rest as it was, cut to a size.

The one redaction hook for records written off the hot path (the request log's bodies, audits):
a field whose name says it holds a secret (``api_key``, ``authorization``, ``password``, a
``*_secret``, an OAuth token, a cookie) keeps its name and loses its value, and a string that
looks like a bearer credential (``Bearer ...``, ``sk-...``) is masked wherever it is."""

from __future__ import annotations

import json
import re
from typing import Any

from multiplexer.core.json_codec import dumps, loads

MASK = "[redacted]"
_SECRET_NAME = re.compile(
    r"(^|[_-])(api[_-]?key|apikey|authorization|password|passwd|secret|client[_-]?secret|"
    r"access[_-]?token|refresh[_-]?token|id[_-]?token|token|cookie|set-cookie|x-api-key|private[_-]?key)$",
    re.IGNORECASE)
_SECRET_TEXT = re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}|\b(sk|pk|rk)-[A-Za-z0-9_-]{16,}")
MAX_DEPTH = 32


def secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact(value: Any, depth: int = 0) -> Any:
    """``value`` (JSON-like) with secrets masked; a copy, the input is left as it was."""
    if isinstance(value, str):
        return _SECRET_TEXT.sub(MASK, value) if len(value) >= 8 else value
    if depth >= MAX_DEPTH:
        return MASK
    if isinstance(value, dict):
        return {k: (MASK if isinstance(k, str) and secret_name(k) and v is not None else redact(v, depth + 1))
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, depth + 1) for v in value]
    return value


def redacted_text(value: Any, max_bytes: int) -> str | None:
    """``value`` redacted and written as JSON text of at most ``max_bytes`` (cut with a marker)."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        try:
            value = loads(bytes(value))
        except ValueError:
            value = bytes(value).decode("utf-8", "replace")
    try:
        text = dumps(redact(value)).decode("utf-8", "replace")
    except TypeError:  # a lone surrogate: the stdlib writes it escaped, as JSON allows
        text = json.dumps(redact(value), default=str)
    if len(text) > max_bytes:
        cut = text.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")
        return cut + f"...[cut: {len(text)} characters]"
    return text


def storable(value: Any) -> Any:
    """A caller's text as a store and JSON can keep it: a lone surrogate (a JSON body may carry
    ``\\ud800``) becomes ``?``, where it would fail the write of its record."""
    if not isinstance(value, str) or value.isascii():
        return value
    return value.encode("utf-8", "replace").decode("utf-8")
