"""The gateway asks the semantic cache (``multiplexer/cache/``) between admission and
``decide``: a call that admission routed (its key's access checked on the route and the model)
and that the cache answers takes no quota and reserves no budget; it is answered in
``enqueue`` like an exact cache hit, its cost avoided booked as ``semantic_cache``. A miss's
answer is stored as the call is answered."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from multiplexer.core.call import CacheNote, Call, Outcome
from multiplexer.core.provider import STREAM
from multiplexer.core.sink import ChunkSink

if TYPE_CHECKING:
    from multiplexer.cache.semantic import Lookup, SemanticCache
    from multiplexer.gateway.admission import Plan


class Gateway(Protocol):
    """What the cache's step reads of the gateway (no import of it: it imports this)."""

    config: Any
    metrics: Any
    keys: Any
    cache: Any

    async def submit(self, call: Call) -> Outcome: ...

log = logging.getLogger(__name__)
CACHED_OPERATIONS = ("chat", "messages")


def semantic_for(gw: Gateway) -> SemanticCache | None:
    """The gateway's semantic cache, when the config names anything to cache (None: off)."""
    section = gw.config.cache.semantic
    if not section.enabled:
        return None
    from multiplexer.cache.semantic import SemanticCache
    from multiplexer.cache.store import CacheLog, PgLog, RedisLog, SqliteLog

    state = gw.config.state
    cache_log: CacheLog
    if state.url is not None:
        longest = max(s.ttl_s for s in [*section.routes.values(), *section.keys.values(),
                                        *section.teams.values()])
        cache_log = RedisLog(state.url, state.prefix, section.sync_ms, keep_s=longest)
    elif gw.config.store.url is not None:  # replicas sharing a PostgreSQL store and no Redis
        cache_log = PgLog(gw.config.store.url, gw.config.store.schema_, section.sync_ms / 1000.0)
    else:
        cache_log = SqliteLog(Path(gw.config.store.path), section.sync_ms / 1000.0)

    async def embed(route: str, texts: list[str]) -> list[np.ndarray] | None:
        outcome = await gw.submit(Call(route, {"input": texts}, face="cache"))
        if outcome.error is not None:
            log.warning("semantic cache: embeddings route %s failed: %s", route, outcome.error.message)
            return None
        try:
            data = sorted(outcome.result["data"], key=lambda d: d.get("index", 0))
            matrix = np.asarray([d["embedding"] for d in data], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("semantic cache: embeddings route %s answered no vectors: %r", route, e)
            return None
        matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
        return list(matrix)

    return SemanticCache(section, embed, gw.metrics.registry, cache_log)


async def run_semantic(cache: SemanticCache) -> None:
    """A cache a reload turned on: its background task, and its last writes sent as it stops
    (the gateway's own is closed by its exit stack)."""
    import anyio

    try:
        await cache.run()
    finally:
        with anyio.CancelScope(shield=True):
            await cache.aclose()


async def ask_cache(gw: Gateway, cache: SemanticCache, plans: Sequence[Plan]) -> None:
    """Each routed plan the cache covers looked up; a hit's answer on ``plan.cached`` (a stream's
    chunks already sent), its quota claim dropped; a miss's answer stored when it comes. The cache
    fails open: a fault in it is logged and the calls go upstream."""
    try:
        await _ask(gw, cache, plans)
    except Exception:
        log.exception("semantic cache: lookup failed; the calls go upstream")


async def _ask(gw: Gateway, cache: SemanticCache, plans: Sequence[Plan]) -> None:
    lookups: list[tuple[Plan, Lookup]] = []
    for plan in plans:
        call, item = plan.call, plan.item
        if plan.error is not None or item is None or plan.route is None:
            continue
        team = None
        if call.identity is not None:
            entry = gw.keys.entry(call.identity)
            team = entry.team if entry is not None else None
        settings = cache.settings_for(plan.label, call.method, call.identity, team)
        if settings is None:
            continue
        note = call.cache
        if note is not None and note.off:
            cache.skipped(plan.label, "off")
            continue
        if item.operation not in CACHED_OPERATIONS:
            cache.skipped(plan.label, "shape")
            continue
        if plan.dedup_key is not None and gw.cache.get(plan.dedup_key) is not None:
            continue  # today's exact TTL cache answers it in enqueue
        lookup = cache.ask(plan.label, settings, item.params, call.identity, team)
        if lookup is None:
            continue
        lookup.request_id = note.request_id if note is not None else None
        lookups.append((plan, lookup))
    if not lookups:
        return
    await cache.lookup([lk for _, lk in lookups])
    for plan, lk in lookups:
        if lk.hit is None:
            _store_when_answered(cache, plan, lk)
        else:
            await _answer(plan, lk)


async def _answer(plan: Plan, lk: Lookup) -> None:
    from multiplexer.cache.stream import replayed

    assert lk.hit is not None and plan.item is not None
    call = plan.call
    result = lk.hit.result
    note = call.cache = call.cache or CacheNote()
    note.how, note.similarity, note.original_request_id = "semantic", lk.similarity, lk.hit.request_id
    if call.sink is not None:  # OpenAI's chunks or Anthropic's events, as the route streams them
        chunks = replayed(plan.item.operation, result, plan.item.params)
        if chunks is None:
            note.how = None
            return
        for chunk in chunks:
            await call.sink.send(chunk)
        result = {"usage": result.get("usage")}
    plan.cached = Outcome(result=result)
    plan.claim = None  # a hit takes nothing of the key's quotas


def _store_when_answered(cache: SemanticCache, plan: Plan, lk: Lookup) -> None:
    """The miss's answer kept as the gateway answers it: through the call's last step (``shape``),
    which sees the provider's own successful outcome before the face shapes it. A stream's
    chunks are kept as they are relayed (only for this call: its sink's reader is wrapped) and
    stored, assembled, as the whole answer once the stream ended well."""
    from multiplexer.cache.stream import Recorder, recorder, whole

    call, item = plan.call, plan.item
    assert item is not None
    shape = call.shape
    kept: Recorder | None = None
    if call.sink is not None:
        sink = item.options.get(STREAM)
        if not isinstance(sink, ChunkSink) or sink.started:
            return
        kept = recorder(call.sink)
        # the same reader, seen through the recorder; the first chunk still timed from admission
        item.options[STREAM] = sink.reading(kept)
    operation = item.operation

    def store_then_shape(outcome: Outcome) -> Outcome:
        result = outcome.result
        try:
            if kept is not None:
                usage = result.get("usage") if isinstance(result, dict) else None
                answer = whole(operation, kept.chunks, usage)
                kept.chunks = []
                if answer is not None:
                    cache.store(lk, answer)
            elif isinstance(result, dict) and (result.get("choices") is not None
                                               or result.get("type") == "message"):
                cache.store(lk, result)
        except Exception:  # the cache fails open: the call is answered, its answer not kept
            log.exception("semantic cache: an answer could not be stored")
        return outcome if shape is None else shape(outcome)

    call.shape = store_then_shape


def cache_headers(call: Call) -> list[tuple[bytes, bytes]]:
    """``x-multiplexer-cache: semantic``, the similarity and the original request id on a hit."""
    note = call.cache
    if note is None or note.how is None:
        return []
    out = [(b"x-multiplexer-cache", note.how.encode()),
           (b"x-multiplexer-cache-similarity", f"{note.similarity or 0.0:.4f}".encode())]
    if note.original_request_id:
        out.append((b"x-multiplexer-cache-original-request-id",
                    note.original_request_id.encode("ascii", "replace")))
    return out


def note_of_headers(headers: dict[bytes, bytes], request_id: str | None) -> CacheNote:
    """What a request's headers tell the cache: ``cache-control: no-cache`` (or ``no-store``)
    and ``x-multiplexer-cache: off`` opt out."""
    control = headers.get(b"cache-control", b"").lower()
    off = b"no-cache" in control or b"no-store" in control or \
        headers.get(b"x-multiplexer-cache", b"").strip().lower() in (b"off", b"0", b"false", b"no")
    return CacheNote(off=off, request_id=request_id)
