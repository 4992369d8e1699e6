"""A stored chat answer replayed as the stream a caller asked for: OpenAI
``chat.completion.chunk``s (the face encodes them as SSE and adds ``[DONE]``)."""

from __future__ import annotations

import re
from typing import Any

_PIECE = re.compile(r"\S+\s*|\s+")
PIECES = 16  # chunks the answer's text is cut into at most


def chat_chunks(result: Any, params: Any) -> list[dict[str, Any]] | None:
    """The chunks of a stored ``chat.completion``; None when it is not one (then the call is
    not answered from the cache)."""
    if not isinstance(result, dict) or result.get("object") != "chat.completion":
        return None
    choices = result.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message") or {}
    text = message.get("content")
    if not isinstance(text, str) or message.get("tool_calls"):
        return None
    head = {"id": result.get("id", "chatcmpl-cache"), "object": "chat.completion.chunk",
            "created": result.get("created", 0), "model": result.get("model", "")}
    if result.get("system_fingerprint") is not None:
        head["system_fingerprint"] = result["system_fingerprint"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    words = _PIECE.findall(text)
    step = max(1, -(-len(words) // PIECES))
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": "".join(words[i:i + step])}) for i in range(0, len(words), step)]
    out.append(chunk({}, choices[0].get("finish_reason") or "stop"))
    options = params.get("stream_options") if isinstance(params, dict) else None
    if isinstance(options, dict) and options.get("include_usage") and result.get("usage"):
        out.append({**head, "choices": [], "usage": result["usage"]})
    return out
