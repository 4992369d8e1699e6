"""Kinds whose own request body is neither OpenAI's nor Anthropic's (Gemini's ``generateContent``)
still serve ``/v1`` callers: the provider hands the face a ``Translation`` per endpoint, and the
face sends the translated body as the call's params and the result (or each stream chunk) back
in the caller's API. ``/rpc`` and ``/mcp`` keep the provider's own body untouched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# One streamed call's converter: an upstream chunk in, the caller's API's events out (none, one or
# several). A chunk with an ``error`` key is the face's own error event and passes through as is.
ChunkConverter = Callable[[dict[str, Any]], list[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Translation:
    """Both directions for one ``/v1`` endpoint. ``params`` raises ``RpcError`` (invalid params,
    naming the param) for what the provider's API cannot express. ``operation`` is what the route
    must answer (``chat``, ``embeddings``) to serve the endpoint."""

    operation: str
    params: Callable[[dict[str, Any]], dict[str, Any]]
    result: Callable[[Any, dict[str, Any]], Any]  # (the provider's result, the caller's body)
    stream: Callable[[dict[str, Any]], ChunkConverter] | None = None  # given the caller's body


@runtime_checkable
class Translates(Protocol):
    """The capability: a ``Translation`` for ``/v1/chat/completions``, ``/v1/messages`` or
    ``/v1/embeddings``, or None where the kind takes that endpoint's body as it is."""

    def translation(self, endpoint: str) -> Translation | None: ...
