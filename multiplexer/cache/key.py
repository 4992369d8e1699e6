"""What a call is compared by: its last user turn, embedded, inside a neighbourhood that must
match exactly (route, model, system prompt, earlier turns, tools, and every parameter that
changes the answer), or why it is not cached at all."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from multiplexer.core.dedup import canonical

# parameters that change how an answer is delivered, never what it says
_DELIVERY = frozenset({"stream", "stream_options", "user", "metadata", "store", "service_tier",
                       "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
                       "x-multiplexer-cache"})
OPERATIONS = frozenset({"chat", "messages", "call"})


@dataclass(frozen=True, slots=True)
class Ask:
    """A cacheable call: the text compared, the neighbourhood it may match in, and the exact key
    of the whole request (checked before anything is embedded)."""

    text: str
    neighbourhood: str
    exact: str  # a digest of the neighbourhood and the text, whitespace aside
    streamed: bool


def _text_of(content: Any) -> str | None:
    """A turn's text: a string, or a list of text parts (None: an image, audio or a file)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                return None
            parts.append(part["text"])
        return "\n".join(parts)
    return None


def ask_of(params: Any, *, route: str, scope: str, max_messages: int) -> Ask | str:
    """The call's ``Ask``, or why it is not cached: ``shape`` (no messages), ``long`` (more turns
    than ``max_messages``), ``tools`` (tool calls or results in the conversation), ``n`` (more
    than one choice asked), ``not_text`` (the last turn is not the user's text)."""
    if not isinstance(params, dict):
        return "shape"
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages:
        return "shape"
    if len(messages) > max_messages:
        return "long"
    n = params.get("n")
    if n is not None and n != 1:
        return "n"
    for m in messages:
        if not isinstance(m, dict):
            return "shape"
        if m.get("role") in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            return "tools"
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in
                                             ("tool_use", "tool_result") for p in content):
            return "tools"
    last = messages[-1]
    text = _text_of(last.get("content")) if last.get("role") == "user" else None
    if text is None or not text.strip():
        return "not_text"
    rest = {k: v for k, v in params.items() if k not in _DELIVERY and k != "messages"}
    rest["messages"] = messages[:-1]
    neighbourhood = f"{route}|{scope}|{canonical(rest)}"
    whole = f"{neighbourhood}|{canonical(' '.join(text.split()))}"
    exact = hashlib.blake2b(whole.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return Ask(text.strip(), neighbourhood, exact, bool(params.get("stream")))
