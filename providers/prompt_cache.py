"""``prompt_cache: auto``: prompt-cache markers where the caller set none (opt-in, on a provider
or a route).

Anthropic caches only up to the ``cache_control`` breakpoints a request marks, so a caller that
marks none pays full price for its system prompt and tools on every turn. With ``auto`` a Messages
call that carries no ``cache_control`` anywhere gets breakpoints on the stable prefix, in the
order the API caches it (tools, then system, then messages), each only where the prefix up to it
reaches the model's minimum cacheable length (a shorter one is not cached, so no breakpoint), and
never more than the API's four:

- the last tool definition;
- the last block of the system prompt;
- in a conversation (a history before the last user turn), the last user turn, which the next
  turn reads, and the user turn before it, which this turn reads (its breakpoint of the turn
  before: a read within the 20-block lookback, however many blocks a turn adds).

A call with any marker of its own is sent as it is: the caller's markers are never moved, added
to or removed. Markers change what the provider caches, never the answer. Writes cost 1.25x the
input price for the marked prefix (5-minute cache), reads 0.1x: a prefix marked and never read
again costs more, which is why this is opt-in.

OpenAI caches every prompt of 1,024 tokens or more by itself; ``auto`` there adds a
``prompt_cache_key`` where the caller set none, from the caller's key and the prompt's stable head
(``core/cache_affinity.call_key``), which keeps one conversation's calls on one cache machine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from multiplexer.core.cache_affinity import call_key, digest64
from multiplexer.core.json_codec import dumps

from .packing import content_text, text_tokens

Mode = Literal["auto", "off"]
BREAKPOINTS = 4  # the Messages API's limit per request
EPHEMERAL = {"type": "ephemeral"}


class PromptCacheSettings(BaseModel):
    """A provider's ``prompt_cache`` (a route may say otherwise)."""

    prompt_cache: Mode = Field(
        default="off", description="auto: where a call carries no prompt-cache markers, add them: "
        "Anthropic cache_control breakpoints on the tools, the system prompt and a conversation's "
        "last user turns (only above the model's minimum cacheable length, at most 4), OpenAI a "
        "prompt_cache_key from the caller's key and the prompt's head; a caller's own markers are "
        "never changed (docs/prompt-cache.md); off: bodies go as the caller sent them")
    prompt_cache_min_tokens: int | None = Field(
        default=None, ge=1, description="prompt_cache: auto: the fewest (estimated) prompt tokens "
        "a breakpoint caches; unset: 2048 for Claude Haiku models, else 1024 (Anthropic's minimums)")


class PromptCacheRouteSettings(BaseModel):
    """A route's own keys for an ``openai`` or ``anthropic`` provider."""

    model_config = ConfigDict(extra="forbid")

    prompt_cache: Mode | None = Field(
        default=None, description="auto or off for this route's calls, instead of the provider's "
        "prompt_cache")


def mode_of(options: dict[str, Any], settings: Any) -> Mode:
    """The call's mode: its route's ``prompt_cache``, else its provider's."""
    mode = options.get("prompt_cache")
    if mode is None:
        mode = getattr(settings, "prompt_cache", "off")
    return "auto" if mode == "auto" else "off"


def minimum(model: str, settings: Any) -> int:
    """The fewest prompt tokens a breakpoint caches for ``model``."""
    given = getattr(settings, "prompt_cache_min_tokens", None)
    if isinstance(given, int):
        return given
    return 2048 if "haiku" in model.lower() else 1024


def marked(params: dict[str, Any]) -> bool:
    """Whether the caller set any ``cache_control`` (top level, tools, system or messages)."""
    if "cache_control" in params:
        return True
    for part in (params.get("tools"), params.get("system")):
        if type(part) is list and any(type(b) is dict and "cache_control" in b for b in part):
            return True
    for m in params.get("messages") or ():
        content = m.get("content") if type(m) is dict else None
        if type(content) is list and any(type(b) is dict and "cache_control" in b for b in content):
            return True
    return False


def _tokens(value: Any) -> int:
    if isinstance(value, str):
        return text_tokens(value)
    if isinstance(value, list) and all(type(b) is dict and "text" in b for b in value):
        return text_tokens(content_text(value))
    try:
        return text_tokens(dumps(value).decode())
    except ValueError:
        return 0


def _mark_last(blocks: Any) -> list[Any] | None:
    """``blocks`` (a string or a list of content blocks) with a breakpoint on the last one, as a
    new list (the caller's list and blocks are not changed); None: nothing to mark."""
    if isinstance(blocks, str):
        return [{"type": "text", "text": blocks, "cache_control": dict(EPHEMERAL)}] if blocks else None
    if type(blocks) is not list or not blocks or type(blocks[-1]) is not dict:
        return None
    last = blocks[-1]
    if last.get("type") in ("thinking", "redacted_thinking"):  # these take no cache_control
        return None
    return [*blocks[:-1], {**last, "cache_control": dict(EPHEMERAL)}]


def anthropic_markers(params: dict[str, Any], least: int) -> dict[str, Any] | None:
    """``params`` with breakpoints on its stable prefix (a new dict; the caller's objects are not
    changed), or None when it has markers of its own or nothing reaches ``least`` tokens."""
    if marked(params):
        return None
    out = dict(params)
    used = 0
    total = 0
    tools = params.get("tools")
    if type(tools) is list and tools:
        total += _tokens(tools)
        if total >= least and type(tools[-1]) is dict:
            out["tools"] = [*tools[:-1], {**tools[-1], "cache_control": dict(EPHEMERAL)}]
            used += 1
    system = params.get("system")
    if system:
        total += _tokens(system)
        if total >= least and (new := _mark_last(system)) is not None:
            out["system"] = new
            used += 1
    messages = params.get("messages")
    if type(messages) is list and len(messages) >= 3:  # a history: the conversation goes on
        sizes = [_tokens(m.get("content")) + 4 if type(m) is dict else 0 for m in messages]
        users = [i for i, m in enumerate(messages) if type(m) is dict and m.get("role") == "user"]
        chosen = [i for i in users[-2:] if total + sum(sizes[:i + 1]) >= least]
        new_messages = list(messages)
        changed = False
        for i in reversed(chosen):  # the last turn first: it is the one the next turn reads
            if used >= BREAKPOINTS:
                break
            content = _mark_last(messages[i].get("content"))
            if content is not None:
                new_messages[i] = {**messages[i], "content": content}
                used += 1
                changed = True
        if changed:
            out["messages"] = new_messages
    return out if used else None


def openai_cache_key(params: dict[str, Any], identity: str | None) -> str | None:
    """A ``prompt_cache_key`` for a call that names none: the caller's key and the prompt's stable
    head, hashed (None: the call has its own, or no head to hash)."""
    if params.get("prompt_cache_key"):
        return None
    head = call_key(params, "prefix")
    if head is None:
        return None
    mixed = digest64(f"{identity or ''}\x00{head:016x}".encode())
    return f"mux-{mixed:016x}"
