"""Prompt-cache tokens counted and shown: every provider's cached fields read in one shape and
priced at their own rates (against hand-computed figures), Anthropic's reads and writes counted
as the input the tpm limit sees, and the spend store's input and cache-read tokens, by key and
route, in `/admin/spend` and `multiplexer spend` (on SQLite and PostgreSQL, old tables too)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import respx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from multiplexer import cli
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import Price, ProviderConfig, RouteConfig
from multiplexer.gateway.admission import Plan
from multiplexer.gateway.config import parse_config
from multiplexer.money.meter import Meter, MoneyMetrics
from multiplexer.money.prices import Prices, Tokens, tokens_of
from multiplexer.money.report import sums_json
from multiplexer.money.spend_store import PgSpendStore, SpendStore
from multiplexer.server import running
from providers.anthropic import AnthropicProvider, usage_total
from tests.fakes.serve import serve_app
from tests.pg_helpers import throwaway_schema
from tests.remote_helpers import item, make_provider, started

M = Decimal(1_000_000)
KEY_A, KEY_B = "sk-cache-alice-0123456789", "sk-cache-bobby-0123456789"
ADMIN = "adm-cache-" + "x" * 24

# Anthropic's 2025 usage: 100 plain input, 800 read, 300 written (100 for five minutes, 200 for an hour)
CLAUDE_USAGE = {"input_tokens": 100, "output_tokens": 50, "cache_read_input_tokens": 800,
                "cache_creation_input_tokens": 300,
                "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200}}
# OpenAI: 1000 prompt tokens of which 600 cached
OPENAI_USAGE = {"prompt_tokens": 1000, "completion_tokens": 20, "total_tokens": 1020,
                "prompt_tokens_details": {"cached_tokens": 600}}


# -- usage shapes and prices, by hand ------------------------------------------------------------
def test_every_providers_cached_fields_in_one_shape() -> None:
    assert tokens_of(OPENAI_USAGE) == Tokens(1000, 20, 600, 0, 0)
    assert tokens_of({"input_tokens": 900, "output_tokens": 9,
                      "input_tokens_details": {"cached_tokens": 512}}) == Tokens(900, 9, 512, 0, 0)
    assert tokens_of(CLAUDE_USAGE) == Tokens(1200, 50, 800, 300, 200)
    # the nested object without its sum: the writes are its parts
    parts = {k: v for k, v in CLAUDE_USAGE.items() if k != "cache_creation_input_tokens"}
    assert tokens_of(parts) == Tokens(1200, 50, 800, 300, 200)
    # Gemini: promptTokenCount includes the cached content; thoughts are output
    assert tokens_of({"promptTokenCount": 1000, "cachedContentTokenCount": 750, "candidatesTokenCount": 40,
                      "thoughtsTokenCount": 10, "totalTokenCount": 1050}) == Tokens(1000, 50, 750, 0, 0)


def test_anthropic_hour_long_cache_writes_cost_their_own_rate_by_hand() -> None:
    prices = Prices({"claude": ProviderConfig(kind="anthropic")}, {})
    rates = prices.rates("x", "claude", "claude-sonnet-4-5")
    assert rates is not None
    # genai-prices: $3 input, 1.25x for a five-minute write, 2x for an hour-long one
    assert (rates.input, rates.cache_write, rates.cache_write_1h) == (3, Decimal("3.75"), 6)
    t = tokens_of(CLAUDE_USAGE)
    assert t is not None
    by_hand = (100 * 3 + 800 * Decimal("0.3") + 100 * Decimal("3.75") + 200 * 6 + 50 * 15) / M
    assert rates.cost(t) == by_hand == Decimal("0.002865")
    assert rates.uncached(t) - rates.cost(t) == 800 * (3 - Decimal("0.3")) / M  # the reads' saving
    # a config price has one write rate: an hour-long write pays it too
    price = Price(input_per_mtok=Decimal(1), cached_input_per_mtok=Decimal("0.1"),
                  cache_write_per_mtok=Decimal(2))
    flat = Prices({"p": ProviderConfig(kind="anthropic", price=price)}, {})
    rates = flat.rates("x", "p", "any")
    assert rates is not None and rates.cost(t) == (100 + 80 + 600) / M


def plan(route: str, provider: str, model: str) -> Plan:
    params = {"model": model}
    p = Plan(Call(route, params, identity="alice"), route, 0.0)
    p.route = RouteConfig(provider=provider)
    p.item = Item(route=route, operation="chat", method=route, params=params, identity="alice",
                  options={"mode": "sync"})
    return p


def test_a_native_gemini_answer_is_priced_and_its_tokens_recorded() -> None:
    prices = Prices({"gem": ProviderConfig(kind="gemini", price=Price(
        input_per_mtok=Decimal(1), cached_input_per_mtok=Decimal("0.25"), output_per_mtok=Decimal(4)))}, {})
    meter = Meter(prices, ManualClock(), MoneyMetrics(Metrics()))
    meta = {"promptTokenCount": 1000, "cachedContentTokenCount": 750, "candidatesTokenCount": 50}
    body = Outcome({"candidates": [], "usageMetadata": meta})
    answer = meter.bill(plan("g", "gem", "gemini-2.5-flash"), body, body, None)
    # 250 plain x $1 + 750 cached x $0.25 + 50 output x $4, per million
    assert answer.cost == (250 + Decimal("187.5") + 200) / M
    assert meter.take()[0][-2:] == (1000, 750)


def test_tokens_are_counted_for_an_unpriced_model_and_not_for_a_shared_answer() -> None:
    meter = Meter(Prices({"oai": ProviderConfig(kind="openai")}, {}), ManualClock(), MoneyMetrics(Metrics()))
    body = Outcome({"usage": OPENAI_USAGE})
    assert meter.bill(plan("r", "oai", "my-own-finetune-xyz"), body, body, None).cost is None
    meter.bill(plan("r", "oai", "gpt-4o"), body, body, "dedup")  # sent nothing upstream
    assert [r[-2:] for r in meter.take()] == [(1000, 600), (0, 0)]


def test_anthropic_cache_reads_and_writes_count_toward_tpm() -> None:
    # 100 plain + 800 read + 300 written input, 50 output: what the provider's limit counts
    assert usage_total({"usage": CLAUDE_USAGE}) == 1250
    assert usage_total({"usage": {"input_tokens": 3, "output_tokens": 2}}) == 5
    assert usage_total({"usage": {"input_tokens": True}}) is None and usage_total({}) is None


# -- the spend store, old tables migrated ---------------------------------------------------------
OLD_TABLE = """CREATE TABLE {t} (
  day TEXT NOT NULL, key TEXT NOT NULL, team TEXT NOT NULL, route TEXT NOT NULL, model TEXT NOT NULL,
  calls BIGINT NOT NULL, cost BIGINT NOT NULL, saved BIGINT NOT NULL, unknown_calls BIGINT NOT NULL,
  saved_batch BIGINT NOT NULL, saved_dedup BIGINT NOT NULL, saved_cache BIGINT NOT NULL,
  saved_prompt_cache BIGINT NOT NULL, requests_saved BIGINT NOT NULL,
  PRIMARY KEY (day, key, team, route, model))"""
OLD_ROW = ("2026-12-01", "alice", "", "chat", "gpt-4o", 3, 900, 0, 0, 0, 0, 0, 0, 0)


@pytest.fixture(params=["sqlite", "postgresql"])
def old_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A spend store opened on a table the earlier schema made, with one row in it."""
    if request.param == "sqlite":
        path = tmp_path / "jobs.db"
        with sqlite3.connect(path) as conn:
            conn.execute(OLD_TABLE.format(t="spend"))
            conn.execute(f"INSERT INTO spend VALUES ({', '.join('?' * len(OLD_ROW))})", OLD_ROW)
        conn.close()
        yield lambda: SpendStore(path)
        return
    with throwaway_schema() as (url, schema, admin):
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(OLD_TABLE.format(t=f"{schema}.spend"))
        admin.execute(f"INSERT INTO {schema}.spend VALUES ({', '.join(['%s'] * len(OLD_ROW))})", OLD_ROW)
        yield lambda: PgSpendStore(url, schema)


def test_an_old_store_gains_the_token_columns(old_store: Any) -> None:
    store = old_store()
    try:
        old = store.query(["key"], "2026-12-01", "2026-12-01")
        assert old == [("alice", 3, 900, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]  # no tokens known
        store.add([(*OLD_ROW[:5], 1, 300, 0, 0, 0, 0, 0, 0, 0, 1000, 600, 25, 1, 40, 0)])
        store.add([("2026-12-01", "bob", "", "chat", "gpt-4o", 1, 300, 0, 0, 0, 0, 0, 0, 0, 400, 100,
                    0, 0, 0, 0)])
    finally:
        store.close()
    again = old_store()  # opened a second time: nothing to add, nothing lost
    try:
        rows = again.query(["key"], "2026-12-01", "2026-12-01")
    finally:
        again.close()
    assert rows == [("alice", 4, 1200, 0, 0, 0, 0, 0, 0, 0, 1000, 600, 25, 1, 40, 0),
                    ("bob", 1, 300, 0, 0, 0, 0, 0, 0, 0, 400, 100, 0, 0, 0, 0)]
    shown = sums_json(rows[0][1:])
    assert (shown["input_tokens"], shown["cache_read_tokens"], shown["cache_read_share"]) == (1000, 600, 0.6)
    assert (shown["cache_writes_usd"], shown["cache_moves"], shown["cache_moves_usd"]) == (25e-9, 1, 40e-9)
    assert sums_json((*OLD_ROW[5:], 0, 0, 0, 0, 0, 0))["cache_read_share"] is None  # no input tokens known


# -- through the gateway, against upstreams on 127.0.0.1 --------------------------------------
def upstream() -> Starlette:
    """An OpenAI and an Anthropic endpoint answering with prompt-cache usage."""

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"id": "c1", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}],
                             "usage": OPENAI_USAGE})

    async def messages(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"id": "m1", "type": "message", "role": "assistant", "model": body["model"],
                             "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                             "stop_sequence": None, "usage": CLAUDE_USAGE})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/messages", messages, methods=["POST"])])


@pytest.mark.anyio
async def test_the_report_shows_the_cache_read_share_by_key_and_route(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    async with serve_app(upstream()) as url:
        config = parse_config({
            "server": {"api_keys": {"alice": KEY_A, "bob": KEY_B}, "admin_key": ADMIN},
            "store": {"path": str(tmp_path / "jobs.db")},
            "providers": {"oai": {"kind": "openai", "base_url": url + "/v1", "api_key": "sk-up",
                                  "retry": {"attempts": 1}},
                          "claude": {"kind": "anthropic", "base_url": url, "api_key": "up",
                                     "retry": {"attempts": 1}}},
            "routes": {"chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o"]},
                       "claude": {"provider": "claude", "operation": "messages",
                                  "models": ["claude-sonnet-4-5"]}}})
        async with running(config, port=0) as (_, gw_url), \
                httpx.AsyncClient(base_url=gw_url, timeout=30) as c:
            ask = {"messages": [{"role": "user", "content": "hi"}]}
            for key, n in ((KEY_A, 2), (KEY_B, 1)):
                for _ in range(n):
                    r = await c.post("/v1/chat/completions", json={**ask, "model": "gpt-4o"},
                                     headers={"authorization": f"Bearer {key}"})
                    assert r.status_code == 200, r.text
            r = await c.post("/v1/messages", json={**ask, "model": "claude-sonnet-4-5", "max_tokens": 8},
                             headers={"authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 200, r.text
            assert Decimal(r.headers["x-multiplexer-cost-usd"]) == Decimal("0.002865")
            reply = await c.get("/admin/spend", params={"group_by": "key,route"},
                                headers={"authorization": f"Bearer {ADMIN}"})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            rows = {(row["key"], row["route"]): (row["input_tokens"], row["cache_read_tokens"],
                                                 row["cache_read_share"]) for row in body["rows"]}
            assert rows == {("alice", "chat"): (2000, 1200, 0.6), ("alice", "claude"): (1200, 800, 0.6667),
                            ("bob", "chat"): (1000, 600, 0.6)}
            total = body["total"]
            assert (total["input_tokens"], total["cache_read_tokens"], total["cache_read_share"]) == (
                4200, 2600, round(2600 / 4200, 4))
            monkeypatch.setenv("MULTIPLEXER_MASTER_KEY", ADMIN)
            status = await anyio.to_thread.run_sync(cli.main, ["spend", "--by", "key,route", "--url", gw_url])
    out = capsys.readouterr().out.splitlines()
    assert status == 0 and out[0].split()[-1] == "cache_read_share"
    assert [line.split()[-1] for line in out[1:]] == ["0.6000", "0.6667", "0.6000", "0.6190"]


@pytest.mark.anyio
async def test_the_tpm_limiter_is_charged_the_cache_reads_and_writes(tmp_path: Path) -> None:
    p = make_provider(AnthropicProvider, {"base_url": "http://claude.test", "api_key": "k"}, tmp_path,
                      tpm=5_000)
    headers = {"anthropic-ratelimit-tokens-limit": "5000", "anthropic-ratelimit-tokens-remaining": "4000",
               "anthropic-ratelimit-tokens-reset": "2100-01-01T00:00:00Z"}
    answer = {"id": "m1", "type": "message", "role": "assistant", "model": "claude",
              "stop_reason": "end_turn", "content": [{"type": "text", "text": "ok"}], "usage": CLAUDE_USAGE}
    with respx.mock(base_url="http://claude.test") as mock:
        mock.post("/v1/messages").mock(return_value=httpx.Response(200, headers=headers, json=answer))
        async with started(p):
            it = item(p, "messages", {"model": "claude", "max_tokens": 16,
                                      "messages": [{"role": "user", "content": "x"}]})
            p.ctx.limiter.consume(1, it.tokens)
            await p.execute("messages", [it])
    # clamped to the upstream's 4000 left, then charged the 1250 real tokens less the estimate
    assert p.ctx.limiter.tokens.level == pytest.approx(4000 - (1250 - it.tokens))


def test_a_streams_usage_keeps_the_writes_split_by_lifetime(tmp_path: Path) -> None:
    p = make_provider(AnthropicProvider, {"base_url": "http://claude.test", "api_key": "k"}, tmp_path)
    it = item(p, "messages", {"model": "claude", "max_tokens": 16,
                              "messages": [{"role": "user", "content": "x"}]})
    usage: dict[str, Any] = {}
    start = {k: v for k, v in CLAUDE_USAGE.items() if k != "output_tokens"} | {"output_tokens": 1}
    p.stream_event(it, "message_start", {"type": "message_start", "message": {"usage": start}}, usage)
    p.stream_event(it, "message_delta", {"type": "message_delta", "usage": {"output_tokens": 50}}, usage)
    assert tokens_of(usage) == Tokens(1200, 50, 800, 300, 200)
