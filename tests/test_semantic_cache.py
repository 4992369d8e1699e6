"""The semantic cache (multiplexer/cache/): a paraphrased last user turn answered from a stored
answer through /v1/chat/completions, never across keys, routes or access; the guard on every
neighbour; skips, opt-outs, TTL, LRU, the audit and wrong-hit reports, and replicas catching up.

Embeddings come from a stand-in route (bag of words, hashed), so nothing loads a model: the
real MiniLM's numbers are benchmarks/bench_semantic_cache.py's."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from multiplexer.cache.guard import disagreement
from multiplexer.cache.index import Entry, ScopeIndex
from multiplexer.cache.semantic import SemanticCache
from multiplexer.cache.settings import SemanticSection
from multiplexer.cache.store import CacheLog, PgLog, RedisLog, SqliteLog
from multiplexer.core.call import Item, Outcome
from multiplexer.core.provider import Provider, ProviderContext
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "s" * 28
ALICE, BOB, CAROL = "alice-key-0123456789", "bob-key-0123456789ab", "carol-key-0123456789"
DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
DIMS = 64


def word_vector(text: str) -> np.ndarray:
    """A bag of hashed words: texts that share most words sit close together."""
    v = np.zeros(DIMS, dtype=np.float32)
    for word in text.lower().replace("?", " ").replace(",", " ").split():
        seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little")
        v += np.random.default_rng(seed).standard_normal(DIMS).astype(np.float32)
    return v / max(float(np.linalg.norm(v)), 1e-9)


class Words(Provider):
    """An embeddings route: each input's bag-of-words vector, OpenAI's shape."""

    def __init__(self, ctx: ProviderContext | None = None) -> None:
        self.name = "words"
        self.calls = 0

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        out = []
        for item in items:
            self.calls += 1
            texts = item.params["input"]
            out.append(Outcome(result={"object": "list", "data": [
                {"object": "embedding", "index": i, "embedding": word_vector(t).tolist()}
                for i, t in enumerate(texts)]}))
        return out


def config(tmp_path: Path, alice: dict[str, Any] | None = None, **semantic: Any) -> Any:
    return parse_config(raw_config(tmp_path, alice, **semantic))


def raw_config(tmp_path: Path, alice: dict[str, Any] | None = None, **semantic: Any) -> Any:
    section = semantic or {"routes": {"chat": {"threshold": 0.6, "embed": "embed"},
                                      "claude": {"threshold": 0.6, "embed": "embed"}}}
    return {
        "server": {"admin_key": ADMIN, "key_store": {"enabled": False}, "api_keys": {
            "alice": {"key": ALICE, **(alice or {})}, "bob": {"key": BOB, "routes": ["embed"]},
            "carol": CAROL}},
        "store": {"path": str(tmp_path / "mux.db")},
        "providers": {"words": {"kind": "echo"},
                      "mock": {"kind": "mock", "price": {"input_per_mtok": 1, "output_per_mtok": 2}}},
        "routes": {"embed": {"provider": "words", "operation": "embeddings"},
                   "chat": {"provider": "mock", "operation": "chat", "models": ["mock-gpt"]},
                   "chat2": {"provider": "mock", "operation": "chat", "models": ["mock-2"]},
                   "claude": {"provider": "mock", "operation": "messages", "models": ["mock-claude"]}},
        "cache": {"semantic": section},
    }


async def serve(tmp_path: Path, **semantic: Any) -> Gateway:
    return Gateway(config(tmp_path, **semantic), providers={"words": Words()})


def body(text: str, model: str = "mock-gpt", **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **more}


def upstream(gw: Gateway) -> float:
    return gw.metrics.registry.get_sample_value("multiplexer_upstream_requests_total",
                                                {"provider": "mock"}) or 0.0


class Client:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def chat(self, key: str, text: str, headers: dict[str, str] | None = None,
                   **more: Any) -> httpx.Response:
        return await self.http.post("/v1/chat/completions", json=body(text, **more),
                                    headers={"authorization": f"Bearer {key}", **(headers or {})})

    async def admin(self, method: str, path: str) -> httpx.Response:
        return await self.http.request(method, path, headers={"authorization": f"Bearer {ADMIN}"})


# -- the bypass first: access is checked before the cache is asked ------------------------------
async def test_a_key_without_access_to_the_route_never_reads_its_cache(tmp_path: Path) -> None:
    semantic = {"routes": {"chat": {"threshold": 0.6, "embed": "embed", "scope": "global"}}}
    gw = await serve(tmp_path, **semantic)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        first = await c.chat(ALICE, "How do I reverse a list in Python?")
        assert first.status_code == 200
        assert (await c.chat(CAROL, "How can I reverse a Python list?")).headers.get(
            "x-multiplexer-cache") == "semantic"  # global scope: another key with access shares it
        refused = await c.chat(BOB, "How do I reverse a list in Python?")  # bob: embed only
        assert refused.status_code in (403, 404), refused.text
        assert "x-multiplexer-cache" not in refused.headers
        assert "reverse" not in refused.text


async def test_key_scope_keeps_each_keys_answers_its_own(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        await c.chat(ALICE, "How do I reverse a list in Python?")
        other = await c.chat(CAROL, "How do I reverse a list in Python?")
        assert other.status_code == 200 and "x-multiplexer-cache" not in other.headers
        assert upstream(gw) == 2


# -- hits -------------------------------------------------------------------------------------
async def test_a_paraphrase_is_answered_without_an_upstream_call(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        first = await c.chat(ALICE, "How do I reverse a list in Python?")
        assert first.status_code == 200 and upstream(gw) == 1
        hit = await c.chat(ALICE, "How can I reverse a Python list?")
        assert hit.status_code == 200, hit.text
        assert hit.headers["x-multiplexer-cache"] == "semantic"
        assert 0.6 <= float(hit.headers["x-multiplexer-cache-similarity"]) < 1.0
        assert hit.headers["x-multiplexer-cache-original-request-id"] == first.headers["x-request-id"]
        assert hit.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert float(hit.headers["x-multiplexer-saved-usd"]) > 0
        assert float(hit.headers["x-multiplexer-cost-usd"]) == 0
        assert upstream(gw) == 1
        embedded = gw.providers["words"].calls  # type: ignore[attr-defined]
        again = await c.chat(ALICE, "How can I reverse a Python list?")  # exact: no embedding
        assert again.headers["x-multiplexer-cache"] == "semantic"
        assert gw.providers["words"].calls == embedded  # type: ignore[attr-defined]
        # the guard: the same words in another order, another language, another number
        for near in ("How do I reverse a list in Java?", "How do I not reverse a list in Python?"):
            miss = await c.chat(ALICE, near)
            assert "x-multiplexer-cache" not in miss.headers, near
        assert upstream(gw) == 3
        r = gw.metrics.registry
        assert r.get_sample_value("multiplexer_semantic_cache_lookups_total",
                                  {"route": "chat", "result": "hit"}) == 1
        assert r.get_sample_value("multiplexer_semantic_cache_lookups_total",
                                  {"route": "chat", "result": "exact"}) == 1
        assert r.get_sample_value("multiplexer_saved_usd_total",
                                  {"route": "chat", "how": "semantic_cache"}) > 0


async def test_swapped_directions_hit_nothing_even_at_similarity_one(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        await c.chat(ALICE, "How long is a flight from Paris to Rome?")
        swapped = await c.chat(ALICE, "How long is a flight from Rome to Paris?")  # the same bag
        assert "x-multiplexer-cache" not in swapped.headers
        assert gw.metrics.registry.get_sample_value(
            "multiplexer_semantic_cache_guard_refusals_total", {"route": "chat", "reason": "roles"}) == 1


async def test_a_streamed_hit_is_sse_with_the_headers(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        first = (await c.chat(ALICE, "How do I boil an egg?")).json()
        hit = await c.chat(ALICE, "how do I boil an egg", stream=True,
                           stream_options={"include_usage": True})
        assert hit.status_code == 200 and hit.headers["content-type"].startswith("text/event-stream")
        assert hit.headers["x-multiplexer-cache"] == "semantic"
        events = [line[6:] for line in hit.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
        assert text == first["choices"][0]["message"]["content"]
        usage = chunks[-1]["usage"]
        assert {k: usage[k] for k in first["usage"]} == first["usage"]
        assert upstream(gw) == 1


async def test_what_is_never_cached(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        q = "What is the capital of France?"
        await c.chat(ALICE, q)
        asks: list[tuple[dict[str, str], dict[str, Any]]] = [
            ({"cache-control": "no-cache"}, {}),
            ({"x-multiplexer-cache": "off"}, {}),
            ({}, {"n": 2}),
            ({}, {"temperature": 1.5}),  # another neighbourhood: parameters must match exactly
            ({}, {"model": "mock-2"}),  # another route
            ({}, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        ]
        for headers, more in asks:
            r = await c.chat(ALICE, q, headers, **more)
            assert r.status_code == 200 and "x-multiplexer-cache" not in r.headers, (headers, more)
        long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
        tools = [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "42"}]
        for history in (long, tools):
            messages = [*history, {"role": "user", "content": q}]
            r = await h.post("/v1/chat/completions", headers={"authorization": f"Bearer {ALICE}"},
                             json={"model": "mock-gpt", "messages": messages})
            assert r.status_code == 200 and "x-multiplexer-cache" not in r.headers
        skips = {s.labels["reason"] for m in gw.metrics.registry.collect()
                 if m.name == "multiplexer_semantic_cache_skips" for s in m.samples}
        assert {"off", "n", "long", "tools"} <= skips
        assert upstream(gw) == 9


async def test_a_hit_takes_no_quota(tmp_path: Path) -> None:
    cfg = config(tmp_path, alice={"rpm": 1})
    gw = Gateway(cfg, providers={"words": Words()})
    async with running(cfg, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        assert (await c.chat(ALICE, "How do I reverse a list in Python?")).status_code == 200
        hit = await c.chat(ALICE, "How can I reverse a Python list?")
        assert hit.status_code == 200 and hit.headers["x-multiplexer-cache"] == "semantic"
        assert (await c.chat(ALICE, "What is the capital of Peru?")).status_code == 429


async def test_anthropic_messages_hit_in_their_own_shape(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        async def ask(text: str) -> httpx.Response:
            return await h.post("/v1/messages", headers={"x-api-key": ALICE}, json={
                "model": "mock-claude", "max_tokens": 64, "messages": [{"role": "user", "content": text}]})

        first = await ask("How do I reverse a list in Python?")
        hit = await ask("How can I reverse a Python list?")
        assert hit.status_code == 200 and hit.headers["x-multiplexer-cache"] == "semantic"
        assert hit.json()["type"] == "message" and hit.json()["content"] == first.json()["content"]
        assert upstream(gw) == 1


async def test_a_hit_reserves_no_budget(tmp_path: Path) -> None:
    semantic = {"routes": {"chat": {"threshold": 0.6, "embed": "embed", "scope": "global"}}}
    cfg = config(tmp_path, alice={"budget_usd": {"daily": 0}}, **semantic)  # alice may spend nothing
    gw = Gateway(cfg, providers={"words": Words()})
    async with running(cfg, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        assert (await c.chat(CAROL, "How do I reverse a list in Python?")).status_code == 200
        assert (await c.chat(ALICE, "What is the capital of Peru?")).status_code in (402, 429)
        hit = await c.chat(ALICE, "How can I reverse a Python list?")
        assert hit.status_code == 200 and hit.headers["x-multiplexer-cache"] == "semantic"


def test_names_the_cache_reads_must_exist(tmp_path: Path) -> None:
    from multiplexer.gateway.config import ConfigError

    with pytest.raises(ConfigError) as e:
        config(tmp_path, routes={"chatt": {"embed": "embed"}}, keys={"k": {"embed": "nope"}})
    assert "cache.semantic.routes.chatt: no route or model group named 'chatt'" in str(e.value)
    assert "cache.semantic.keys.k.embed: 'nope' is no route" in str(e.value)


def test_a_keys_settings_win_over_its_teams_and_its_routes() -> None:
    section = SemanticSection.model_validate({
        "routes": {"chat": {"threshold": 0.9}}, "teams": {"t": {"threshold": 0.8}},
        "keys": {"k": {"threshold": 0.7}}})

    async def embed(route: str, texts: list[str]) -> None:
        return None

    cache = SemanticCache(section, embed, CollectorRegistry())
    assert cache.settings_for("chat", None, "k", "t").threshold == 0.7  # type: ignore[union-attr]
    assert cache.settings_for("chat", None, "other", "t").threshold == 0.8  # type: ignore[union-attr]
    assert cache.settings_for("chat", None, None, None).threshold == 0.9  # type: ignore[union-attr]
    assert cache.settings_for("chat2", "group", None, None) is None
    assert cache.settings_for("member", "chat", None, None).threshold == 0.9  # type: ignore[union-attr]


async def test_answers_outlive_a_restart_in_the_store(tmp_path: Path) -> None:
    section = SemanticSection.model_validate({"routes": {"chat": {"threshold": 0.6}}})

    async def embed(route: str, texts: list[str]) -> list[np.ndarray]:
        return [word_vector(t) for t in texts]

    settings = section.routes["chat"]
    before = SemanticCache(section, embed, CollectorRegistry(), SqliteLog(tmp_path / "s.db", 0.05))
    lk = before.ask("chat", settings, body("How do I reverse a list in Python?"), "alice", None)
    assert lk is not None
    await before.lookup([lk])
    before.store(lk, {"object": "chat.completion", "choices": []})
    await before.aclose()  # what was not written yet is written as it closes
    after = SemanticCache(section, embed, CollectorRegistry(), SqliteLog(tmp_path / "s.db", 0.05))
    async with anyio.create_task_group() as tg:
        tg.start_soon(after.run)
        with anyio.fail_after(1.0):
            while not after.scopes:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    asked = after.ask("chat", settings, body("How can I reverse a Python list?"), "alice", None)
    assert asked is not None
    await after.lookup([asked])
    assert asked.hit is not None
    await after.aclose()


# -- the operator's side ------------------------------------------------------------------------
async def test_audit_wrong_hits_and_delete(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        await c.chat(ALICE, "How do I reverse a list in Python?")
        hit = await c.chat(ALICE, "How can I reverse a Python list?")
        hits = (await c.admin("GET", "/admin/cache/hits")).json()["hits"]
        assert len(hits) == 1 and hits[0]["asked"] == "How can I reverse a Python list?"
        assert hits[0]["matched"] == "How do I reverse a list in Python?"
        assert hits[0]["original_request_id"] == hit.headers["x-multiplexer-cache-original-request-id"]
        assert (await c.admin("POST", "/admin/cache/hits/nope/wrong")).status_code == 404
        wrong = await c.admin("POST", f"/admin/cache/hits/{hits[0]['id']}/wrong")
        assert wrong.status_code == 200 and wrong.json()["threshold_raised_by"] == pytest.approx(0.02)
        assert gw.metrics.registry.get_sample_value("multiplexer_semantic_cache_wrong_hits_total",
                                                    {"route": "chat"}) == 1
        again = await c.chat(ALICE, "How can I reverse a Python list?")  # its entry is gone
        assert "x-multiplexer-cache" not in again.headers
        stats = (await c.admin("GET", "/admin/cache")).json()["routes"]["chat"]
        assert stats["entries"] == 1 and stats["wrong_hits"] == 1
        spend = (await c.admin("GET", "/admin/spend")).json()["total"]
        assert spend["calls"] == 3 and spend["saved_by"]["semantic_cache"] > 0
        assert (await c.admin("DELETE", "/admin/cache?route=nope")).status_code == 404
        assert (await c.admin("DELETE", "/admin/cache?route=chat&key=carol")).json() == {"deleted": 0}
        assert (await c.admin("DELETE", "/admin/cache?route=chat")).json() == {"deleted": 1}
        assert "x-multiplexer-cache" not in (await c.chat(ALICE, "How can I reverse a Python list?")).headers


async def test_answers_expire_after_their_ttl(tmp_path: Path) -> None:
    semantic = {"routes": {"chat": {"threshold": 0.6, "embed": "embed", "ttl_s": 60}}}
    gw = await serve(tmp_path, **semantic)
    now = [1_000_000.0]
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        assert gw.semantic is not None
        gw.semantic.wall = lambda: now[0]
        c = Client(h)
        await c.chat(ALICE, "How do I reverse a list in Python?")
        now[0] += 59
        assert (await c.chat(ALICE, "How can I reverse a Python list?")).headers["x-multiplexer-cache"]
        now[0] += 2
        assert "x-multiplexer-cache" not in (await c.chat(ALICE, "How can I reverse a Python list?")).headers


# -- the parts --------------------------------------------------------------------------------
def test_the_guard_refuses_every_near_miss_of_the_three_sets() -> None:
    for name in ("semantic_pairs.jsonl", "semantic_pairs_unseen.jsonl", "semantic_pairs_unseen2.jsonl"):
        rows = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        passed = [r for r in rows if r["label"] == "miss" and disagreement(r["a"], r["b"]) is None]
        assert passed == [], name
        paraphrases = [r for r in rows if r["label"] == "hit"]
        agreed = sum(disagreement(r["a"], r["b"]) is None for r in paraphrases)
        assert agreed >= 0.75 * len(paraphrases), (name, agreed, len(paraphrases))
    assert len([line for line in (DATA / "semantic_pairs.jsonl").read_text().splitlines() if line]) >= 200


@pytest.mark.parametrize(("a", "b", "why"), [
    ("Convert 5 km to miles", "Convert 5 miles to km", "roles"),
    ("What is 15% of 200?", "What is 20% of 200?", "numbers"),
    ("What's new in Python 3.12?", "What's new in Python 3.11?", "numbers"),
    ("How far is 10 km?", "How far is 10 miles?", "units"),
    ("Why does my code work?", "Why doesn't my code work?", "negation"),
    ("Did Google acquire YouTube?", "Did YouTube acquire Google?", "entity_order"),
    ("How do I zoom in?", "How do I zoom out?", "particles"),
    ("Should I approve the loan?", "Should I deny the loan?", "content"),
    ("How much baking soda in cookies?", "How much baking powder in cookies?", "content"),
    ("How do I reverse a list in Python?", "How can I reverse a Python list?", None),
    ("Who wrote Hamlet?", "Who is the author of Hamlet?", None),
])
def test_the_guard_says_what_differs(a: str, b: str, why: str | None) -> None:
    assert disagreement(a, b) == why


def entry(i: int, expires: float = 2e9) -> Entry:
    v = np.zeros(4, dtype=np.float32)
    v[i % 4] = 1.0
    return Entry(f"e{i}", "s", "chat", "n", f"x{i}", f"q{i}", {"i": i}, None, expires, v)


def test_a_scope_keeps_its_most_recently_used_and_drops_the_expired() -> None:
    index = ScopeIndex(max_entries=2)
    a, b, c = entry(0), entry(1), entry(2, expires=10.0)
    index.add(a)
    index.add(b)
    index.touch(a)  # b is now the least recently used
    assert index.add(c) == [b]
    assert set(index.by_id) == {"e0", "e2"}
    assert [e.id for e, _ in index.nearest(a.vector, "n", now=0.0)] [:1] == ["e0"]  # type: ignore[arg-type]
    assert index.nearest(a.vector, "other", now=0.0) == []  # type: ignore[arg-type]
    assert index.expire(now=11.0) == 1 and set(index.by_id) == {"e0"}


def test_a_large_neighbourhood_moves_to_an_hnsw_index(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiplexer.cache.index as index_module

    monkeypatch.setattr(index_module, "SMALL", 3)
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((40, DIMS)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = ScopeIndex(max_entries=30)
    entries = [Entry(f"e{i}", "s", "chat", "n", f"x{i}", f"q{i}", {}, None, 2e9, vectors[i].copy())
               for i in range(40)]
    for e in entries:
        index.add(e)
    hood = index.hoods["n"]
    assert hood.index is not None and len(hood.index) == 30 and len(index) == 30  # 10 evicted
    for i in (10, 25, 39):
        found = index.nearest(vectors[i], "n", now=0.0)
        assert found[0][0].id == f"e{i}" and found[0][1] == pytest.approx(1.0, abs=1e-2)
    assert index.nearest(vectors[0], "n", now=0.0)[0][0].id != "e0"  # evicted
    index.remove(entries[39])
    assert all(e.id != "e39" for e, _ in index.nearest(vectors[39], "n", now=0.0))


@pytest.mark.parametrize("where", ["sqlite", "redis", "postgres"])
async def test_replicas_catch_up_within_a_second(tmp_path: Path, where: str) -> None:
    if where == "postgres":
        from tests.pg_helpers import throwaway_schema

        with throwaway_schema() as (url, schema, _):
            await replicas_catch_up(tmp_path, where, url, schema)
        # a gateway with a PostgreSQL store and no Redis logs its answers there
        from types import SimpleNamespace

        from multiplexer.gateway.semantic import semantic_for

        raw = raw_config(tmp_path)
        raw["store"] = {"path": str(tmp_path / "mux.db"), "url": url, "schema": schema}
        gw = SimpleNamespace(config=parse_config(raw), metrics=SimpleNamespace(registry=CollectorRegistry()))
        cache = semantic_for(gw)  # type: ignore[arg-type]
        assert cache is not None and isinstance(cache.log, PgLog) and cache.log.schema == schema
    else:
        await replicas_catch_up(tmp_path, where)


async def replicas_catch_up(tmp_path: Path, where: str, pg_url: str = "", schema: str = "") -> None:
    section = SemanticSection.model_validate({"routes": {"chat": {"threshold": 0.6}}, "sync_ms": 50})

    async def embed(route: str, texts: list[str]) -> list[np.ndarray]:
        return [word_vector(t) for t in texts]

    def log() -> CacheLog:
        if where == "sqlite":
            return SqliteLog(tmp_path / "s.db", 0.05)
        if where == "postgres":
            return PgLog(pg_url, schema, 0.05)
        return RedisLog(url, key_prefix, 50)

    if where == "redis":
        from tests.redis_helpers import prefix, redis_url

        url, key_prefix = redis_url(), prefix()
    one = SemanticCache(section, embed, CollectorRegistry(), log())
    two = SemanticCache(section, embed, CollectorRegistry(), log())
    settings = section.routes["chat"]
    params = body("How do I reverse a list in Python?")
    async with anyio.create_task_group() as tg:
        tg.start_soon(one.run)
        tg.start_soon(two.run)
        lk = one.ask("chat", settings, params, "alice", None)
        assert lk is not None
        await one.lookup([lk])
        one.store(lk, {"object": "chat.completion", "choices": []})
        asked = two.ask("chat", settings, body("How can I reverse a Python list?"), "alice", None)
        assert asked is not None
        with anyio.fail_after(1.0):
            while not two.scopes:
                await anyio.sleep(0.01)
        await two.lookup([asked])
        assert asked.hit is not None and asked.hit.text == "How do I reverse a list in Python?"
        one.clear()
        with anyio.fail_after(1.0):
            while any(len(s) for s in two.scopes.values()):
                await anyio.sleep(0.01)
        # an answer stored right after the clear outlives the clear read back from the log
        again = one.ask("chat", settings, body("What is the capital of Peru?"), "alice", None)
        assert again is not None
        await one.lookup([again])
        one.store(again, {"object": "chat.completion", "choices": []})
        with anyio.fail_after(1.0):
            while not any(len(s) for s in two.scopes.values()):
                await anyio.sleep(0.01)
        assert sum(len(s) for s in one.scopes.values()) == 1
        tg.cancel_scope.cancel()
    await one.aclose()
    await two.aclose()


# -- streams: a streamed miss stored, Anthropic's streamed hits ---------------------------------
def sse_text(r: httpx.Response) -> str:
    """The text of an OpenAI chat stream's chunks."""
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(ch["choices"][0]["delta"].get("content") or "" for ch in map(json.loads, events[:-1])
                   if ch["choices"])


def named_events(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """Anthropic's stream as (event name, data) pairs."""
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_a_streamed_miss_is_stored_and_answers_a_paraphrase_either_way(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        first = await c.chat(ALICE, "How do I boil an egg?", stream=True)
        assert first.status_code == 200 and "x-multiplexer-cache" not in first.headers
        text = sse_text(first)
        assert text and upstream(gw) == 1
        whole = await c.chat(ALICE, "how do I boil an egg")  # not streamed: the assembled answer
        assert whole.headers["x-multiplexer-cache"] == "semantic"
        assert whole.json()["choices"][0]["message"]["content"] == text
        assert whole.json()["choices"][0]["finish_reason"] == "stop"
        streamed = await c.chat(ALICE, "How do I boil an egg", stream=True)
        assert streamed.headers["x-multiplexer-cache"] == "semantic" and sse_text(streamed) == text
        assert upstream(gw) == 1
        # a stream whose caller opted out is neither looked up nor stored
        off = await c.chat(ALICE, "What is the capital of Peru?", {"x-multiplexer-cache": "off"},
                           stream=True)
        assert off.status_code == 200
        again = await c.chat(ALICE, "What is the capital of Peru?")
        assert "x-multiplexer-cache" not in again.headers and upstream(gw) == 3


async def test_anthropic_streams_are_stored_and_hit_as_the_real_apis_events(tmp_path: Path) -> None:
    gw = await serve(tmp_path)
    async with running(gw.config, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        async def ask(text: str, stream: bool) -> httpx.Response:
            return await h.post("/v1/messages", headers={"x-api-key": ALICE}, json={
                "model": "mock-claude", "max_tokens": 64, "stream": stream,
                "messages": [{"role": "user", "content": text}]})

        first = await ask("How do I reverse a list in Python?", stream=True)
        assert first.status_code == 200 and "x-multiplexer-cache" not in first.headers
        text = "".join(d["delta"]["text"] for name, d in named_events(first)
                       if name == "content_block_delta")
        whole = await ask("How can I reverse a Python list?", stream=False)
        assert whole.headers["x-multiplexer-cache"] == "semantic"
        assert whole.json()["content"] == [{"type": "text", "text": text}]
        assert whole.json()["stop_reason"] == "end_turn"
        hit = await ask("How can I reverse a list in Python", stream=True)
        assert hit.status_code == 200 and hit.headers["x-multiplexer-cache"] == "semantic"
        assert hit.headers["content-type"].startswith("text/event-stream")
        events = named_events(hit)
        names = [name for name, _ in events]
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(names[3:-3]) == {"content_block_delta"}
        assert all(name == d["type"] for name, d in events)
        start = events[0][1]["message"]
        assert start["type"] == "message" and start["content"] == [] and start["stop_reason"] is None
        assert "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta") == text
        assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
        assert events[-2][1]["usage"]["output_tokens"] == whole.json()["usage"]["output_tokens"]
        assert upstream(gw) == 1


def test_a_relayed_streams_bytes_add_up_to_the_whole_answer() -> None:
    from multiplexer.cache.stream import whole

    chunks: list[Any] = [
        b'data: {"id":"c1","object":"chat.completion.chunk","created":5,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
        b'data: {"id":"c1","object":"chat.completion.chunk","created":5,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"h\\u00e9llo"},"finish_reason":null}]}\n\n',
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"content": " you"}, "finish_reason": "length"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    found = whole("chat", chunks, {})
    assert found is not None and found["choices"][0]["message"]["content"] == "h\u00e9llo you"
    assert found["choices"][0]["finish_reason"] == "length" and found["usage"]["completion_tokens"] == 2
    tool = {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]},
                                     "finish_reason": None}]}
    assert whole("chat", [*chunks[:2], tool, chunks[2]], {}) is None  # a tool call: not stored
    assert whole("chat", chunks[:2], {}) is None  # never finished
    named = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"m1","model":"c",'
             b'"usage":{"input_tokens":4,"output_tokens":1}}}\n\n',
             {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
             {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
             {"type": "content_block_stop", "index": 0},
             {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
             {"type": "message_stop"}]
    message = whole("messages", named, None)
    assert message is not None and message["content"] == [{"type": "text", "text": "Hi"}]
    assert message["usage"] == {"input_tokens": 4, "output_tokens": 2}
    thinking = {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}}
    assert whole("messages", [named[0], thinking, *named[2:]], None) is None
    assert whole("messages", named[:-1], None) is None  # no message_stop: cut short


async def test_an_upstreams_relayed_bytes_are_stored_as_the_whole_answer(tmp_path: Path) -> None:
    import asyncio

    pieces = [b'{"id":"c9","object":"chat.completion.chunk","created":7,"model":"gpt-up","choices":'
              b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}',
              b'{"id":"c9","object":"chat.completion.chunk","created":7,"model":"gpt-up","choices":'
              b'[{"index":0,"delta":{"content":"Boil it for"},"finish_reason":null}],"usage":null}',
              b'{"id":"c9","object":"chat.completion.chunk","created":7,"model":"gpt-up","choices":'
              b'[{"index":0,"delta":{"content":" nine minutes."},"finish_reason":"stop"}],"usage":null}',
              b'{"id":"c9","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5,"total_tokens":14}}',
              b"[DONE]"]
    asked: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        asked.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for data in pieces:  # each its own read, as a model's tokens come
            event = b"data: " + data + b"\n\n"
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    raw = raw_config(tmp_path)
    raw["providers"]["oai"] = {"kind": "openai", "base_url": f"http://127.0.0.1:{port}/v1",
                               "api_key": "sk-up", "retry": {"attempts": 1}}
    raw["routes"]["up"] = {"provider": "oai", "operation": "chat", "models": ["gpt-up"]}
    raw["cache"]["semantic"]["routes"] = {"up": {"threshold": 0.6, "embed": "embed"}}
    cfg = parse_config(raw)
    gw = Gateway(cfg, providers={"words": Words()})
    try:
        async with running(cfg, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
            c = Client(h)
            first = await c.chat(ALICE, "How long do I boil an egg?", model="gpt-up", stream=True)
            assert first.status_code == 200 and sse_text(first) == "Boil it for nine minutes."
            hit = await c.chat(ALICE, "how long do I boil an egg", model="gpt-up")
            assert hit.headers["x-multiplexer-cache"] == "semantic", hit.text
            answer = hit.json()
            assert answer["choices"][0]["message"]["content"] == "Boil it for nine minutes."
            assert answer["id"] == "c9" and answer["usage"]["completion_tokens"] == 5
            assert len(asked) == 1
    finally:
        server.close()


# -- a reload re-applies cache.semantic -------------------------------------------------------
async def test_a_reload_turns_the_cache_on_and_applies_new_settings_to_new_calls(tmp_path: Path) -> None:
    import yaml

    from multiplexer.gateway.config import load_config

    path = tmp_path / "gw.yaml"
    raw = raw_config(tmp_path)
    raw.pop("cache")
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    gw = Gateway(cfg, providers={"words": Words()})
    q, paraphrase = "How do I reverse a list in Python?", "How can I reverse a Python list?"

    async def reload(semantic: dict[str, Any]) -> dict[str, Any]:
        path.write_text(yaml.safe_dump({**raw, "cache": {"semantic": semantic}}))
        r = await c.admin("POST", "/admin/reload")
        assert r.status_code == 200 and r.json()["result"] == "ok", r.text
        assert "cache" not in r.json()["restart_needed"]
        return r.json()  # type: ignore[no-any-return]

    async with running(cfg, port=0, gateway=gw) as (_, url), httpx.AsyncClient(base_url=url) as h:
        c = Client(h)
        assert gw.semantic is None
        await reload({"routes": {"chat": {"threshold": 0.6, "embed": "embed"}}, "sync_ms": 50})
        assert gw.semantic is not None  # turned on: stores and answers from now on
        await c.chat(ALICE, q)
        assert (await c.chat(ALICE, paraphrase)).headers.get("x-multiplexer-cache") == "semantic"
        # a higher threshold for new calls; the scope is unchanged, so its answers are kept
        await reload({"routes": {"chat": {"threshold": 0.99, "embed": "embed"}}})
        far = await c.chat(ALICE, "How would I reverse a Python list?")
        assert "x-multiplexer-cache" not in far.headers
        assert (await c.chat(ALICE, q)).headers.get("x-multiplexer-cache") == "semantic"  # kept
        assert gw.semantic.sizes()["chat"] == 2
        # another scope (every caller's): the key's answers are no longer any call's, dropped
        await reload({"routes": {"chat": {"threshold": 0.6, "embed": "embed", "scope": "global"}}})
        assert gw.semantic.sizes().get("chat", 0) == 0
        assert "x-multiplexer-cache" not in (await c.chat(ALICE, q)).headers
        assert (await c.chat(CAROL, paraphrase)).headers.get("x-multiplexer-cache") == "semantic"
        # turned off: nothing is looked up or stored, nothing kept
        await reload({})
        assert "x-multiplexer-cache" not in (await c.chat(CAROL, paraphrase)).headers
        assert gw.semantic.sizes() == {}
        assert upstream(gw) == 4


def test_an_entry_keeps_its_answer_as_json_of_its_own_size_and_each_reader_a_copy() -> None:
    answer = {"object": "chat.completion", "choices": [{"message": {"content": "x" * 50}}]}
    a = Entry("e1", "chat|key:a|embed", "chat", "n", "x1", "q", answer, None, 2e9)
    b = Entry("e2", "chat|key:a|" + "embed", "chat", "n", "x2", "q", answer, None, 2e9)
    assert isinstance(a.body, bytes) and len(a.body) < 200
    assert a.scope is b.scope  # one string for every entry of a scope
    got = a.result
    got["choices"].clear()  # a caller's shaping never changes what the next hit reads
    assert a.result == answer
    from multiplexer.cache.key import Ask, ask_of

    found = ask_of(body("word " * 2000), route="chat", scope="s", max_messages=4)
    assert isinstance(found, Ask) and len(found.exact) == 32  # a digest, whatever the prompt's size
