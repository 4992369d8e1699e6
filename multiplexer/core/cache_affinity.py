"""Prompt-cache affinity keys and the rendezvous picker, shared by model groups
(``gateway/affinity.py``) and a provider's ``base_urls`` (``providers/endpoints.py``).

A provider caches a prompt's prefix where it served it, so a conversation whose turns land on
different deployments pays for its prefix on each. Rendezvous (highest random weight) hashing
ranks the candidates by a score of (key, candidate): every replica ranks alike with no shared
state, and a candidate that leaves moves only its own keys. A call's key is, in order: the
caller's ``prompt_cache_key``; its session (the ``x-session-id`` header, ``Call.session``); in
``session`` mode the body's ``metadata.session_id``, ``metadata.user_id`` (Anthropic) or ``user``
(OpenAI); in ``prefix`` mode a hash of the prompt's stable head: the system prompt, tools and
first user message, the same on every turn of one conversation. Bounded load sends a key past a
candidate with far more calls in flight than the mean. Pure functions: no state, no I/O.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from prometheus_client import CollectorRegistry
from pydantic import BeforeValidator

from multiplexer.core.json_codec import dumps
from multiplexer.core.metrics import Metrics
from multiplexer.core.plain_metrics import Tally

Mode = Literal["prefix", "session", "off"]


def _yaml_off(value: Any) -> Any:
    """YAML reads a bare ``off`` as false: it means ``off``."""
    return "off" if value is False else value


ModeSetting = Annotated[Mode, BeforeValidator(_yaml_off)]  # a group's or base_urls' setting
LOAD_FACTOR = 0.25  # a member is saturated above (1 + this) x the group's mean in flight, + 1
CACHED_OPERATIONS = frozenset({"chat", "messages"})  # groups of these default to ``prefix``
# Item options the gateway sets: a group's affinity key (the same hash, not taken twice, for the
# route's ``base_urls``) and the caller's ``x-session-id`` (``Call.session``).
AFFINITY_KEY = "affinity_key"
SESSION = "session"
# Set on a call's item when affinity sent it away from its pick: the spend report books it as a
# cache move, with what it cost (``money/meter.py``).
CACHE_MOVED = "cache_moved"
_MASK = (1 << 64) - 1
_SYSTEM_ROLES = ("system", "developer")


def digest64(data: bytes) -> int:
    """64 bits of SHA-256: processors' SHA extensions hash a long prompt about twice as fast as
    BLAKE2b (8 µs against 15 µs for 14 KB on an AMD EPYC), and every replica agrees."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _part(digest: Any, tag: bytes, value: Any) -> None:
    """One part into ``digest``: its tag, its length and its bytes (a string's UTF-8 as it is,
    anything else as compact JSON), so no two prompts' parts run together alike."""
    data = value.encode("utf-8", "surrogatepass") if type(value) is str else dumps(value)
    digest.update(tag + len(data).to_bytes(8, "little"))
    digest.update(data)


def _bare(content: Any) -> Any:
    """Content without its ``cache_control`` marks: clients move the last mark along each turn."""
    if type(content) is not list:
        return content
    return [{k: v for k, v in b.items() if k != "cache_control"}
            if type(b) is dict and "cache_control" in b else b for b in content]


def prefix_parts(params: dict[str, Any]) -> tuple[Any, list[Any], Any, Any] | None:
    """The parts of a prompt every turn of its conversation repeats: the system prompt (Anthropic's
    ``system``, the Responses API's ``instructions``, the leading system or developer messages),
    the tools and the first user message. None: the call has none (an embedding)."""
    system = params.get("system")
    if system is None:
        system = params.get("instructions")
    messages = params.get("messages")
    first: Any = None
    if messages is None:
        given = params.get("input")
        if isinstance(given, str):
            first = given
        elif isinstance(given, list):
            messages = given
    lead: list[Any] = []
    if type(messages) is list:
        leading = True
        for m in messages:
            if type(m) is not dict:
                break
            role = m.get("role")
            if leading and role in _SYSTEM_ROLES:
                lead.append(_bare(m.get("content")))
                continue
            leading = False
            if role == "user":
                first = _bare(m.get("content"))
                break
    tools = params.get("tools")
    if system is None and not lead and tools is None and first is None:
        return None
    return _bare(system), lead, _bare(tools), first


def call_key(params: Any, mode: Mode, session: str | None = None) -> int | None:
    """A call's affinity key (64 bits), or None: the strategy (least busy, least outstanding)
    picks. ``session``: the caller's ``x-session-id`` (``Call.session``)."""
    if mode == "off" or type(params) is not dict:
        return None
    explicit = params.get("prompt_cache_key")
    if isinstance(explicit, str) and explicit:
        return digest64(b"k" + explicit.encode("utf-8", "surrogatepass"))
    if session:
        return digest64(b"s" + session.encode("utf-8", "surrogatepass"))
    if mode != "prefix":
        named = body_session(params)
        return digest64(b"s" + named.encode("utf-8", "surrogatepass")) if named else None
    parts = prefix_parts(params)
    if parts is None:
        return None
    system, lead, tools, first = parts
    digest = hashlib.sha256()  # as ``digest64``
    try:
        _part(digest, b"S", system)
        for content in lead:
            _part(digest, b"L", content)
        _part(digest, b"T", tools)
        _part(digest, b"U", first)
    except ValueError:  # NaN or Infinity somewhere: no key rather than a refusal
        return None
    return int.from_bytes(digest.digest()[:8], "little")


def body_session(params: dict[str, Any]) -> str | None:
    """A session the body names: ``metadata.session_id``, Anthropic's ``metadata.user_id`` or
    OpenAI's ``user``; None when it names none."""
    metadata = params.get("metadata")
    if type(metadata) is dict:
        for name in ("session_id", "user_id"):
            value = metadata.get(name)
            if isinstance(value, str) and value:
                return value
    user = params.get("user")
    return user if isinstance(user, str) and user else None


def ranking(key: int, members: Iterable[tuple[str, int, float]]) -> list[str]:
    scored = []
    for name, seed, weight in members:
        h = ((key ^ seed) * 0x9E3779B97F4A7C15) & _MASK  # Fibonacci hashing: the high bits mix
        u = ((h >> 11) + 0.5) / 9007199254740992.0  # its top 53 bits, never 0 or 1
        scored.append((-weight / math.log(u), name))
    scored.sort(reverse=True)
    return [name for _, name in scored]


def saturated(names: Iterable[str], busy: Mapping[str, int]) -> set[str]:
    """The members whose calls in flight exceed (1 + LOAD_FACTOR) x the members' mean, + 1."""
    loads = [(n, busy.get(n, 0)) for n in names]
    total = sum(load for _, load in loads)
    if not total:  # nothing in flight: the common case costs one pass
        return set()
    cap = (1 + LOAD_FACTOR) * total / len(loads) + 1
    return {n for n, load in loads if load > cap}


def prefix_order(keys: list[int | None]) -> list[int]:
    """Positions 0..n-1 of a batch's lines reordered so that lines sharing a prefix key go
    consecutively (each group where its first line was; a line without a key keeps its place
    among the groups): a provider that caches where it served a prefix then reuses it, and a
    page of lines sent at once keeps one conversation's lines on one deployment."""
    first: dict[int, int] = {}
    order = []
    for i, key in enumerate(keys):
        at = i if key is None else first.setdefault(key, i)
        order.append((at, i))
    order.sort()
    return [i for _, i in order]


_TALLIES: weakref.WeakKeyDictionary[CollectorRegistry, Tally] = weakref.WeakKeyDictionary()


def moves_tally(metrics: Metrics) -> Tally:
    """``multiplexer_cache_moves_total{group, reason}``: calls with an affinity key sent away from
    their rendezvous pick, each counted once. A group's (``group`` its name): ``breaker_open``,
    ``overloaded``, ``forbidden`` at the pick, ``fallback`` when the pick failed. A provider's
    ``base_urls`` (``group`` is ``<provider>@base_urls``): ``endpoint_down`` (taken out, its
    breaker open or at its ``endpoint_concurrency``) or ``overloaded``. Labels are config names
    and those words. One per registry: the gateway and its providers count in the same one."""
    tally = _TALLIES.get(metrics.registry)
    if tally is None:
        tally = _TALLIES[metrics.registry] = Tally(
            "multiplexer_cache_moves", "Calls with a cache affinity key served away from their "
            "rendezvous pick (a group's route, a provider's base URL), by group and why",
            ["group", "reason"], metrics.registry)
    return tally
