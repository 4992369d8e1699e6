"""Money: what calls cost (against hand-computed figures), what the gateway saved, the spend
report and its command, and budget refusals in each face's shape."""

from __future__ import annotations

from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer import cli
from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig, RouteConfig
from multiplexer.gateway.admission import Plan
from multiplexer.gateway.config import parse_config
from multiplexer.money.meter import Meter, MoneyMetrics
from multiplexer.money.prices import Prices, Tokens, tokens_of
from multiplexer.server import running
from tests.remote_helpers import fakes

pytestmark = pytest.mark.anyio
KEY = "sk-money-test-0123456789"
ADMIN = "adm-money-" + "x" * 24
M = Decimal(1_000_000)


# -- prices and usage shapes, by hand ----------------------------------------------------------
def test_usage_shapes_in_one_convention() -> None:
    # OpenAI chat: prompt_tokens includes the cached ones
    assert tokens_of({"prompt_tokens": 2000, "completion_tokens": 500,
                      "prompt_tokens_details": {"cached_tokens": 1000}}) == Tokens(2000, 500, 1000, 0)
    # OpenAI Responses: input_tokens includes input_tokens_details.cached_tokens
    assert tokens_of({"input_tokens": 300, "output_tokens": 7,
                      "input_tokens_details": {"cached_tokens": 256}}) == Tokens(300, 7, 256, 0)
    # Anthropic: input_tokens excludes cache reads and writes
    assert tokens_of({"input_tokens": 100, "output_tokens": 200, "cache_read_input_tokens": 2000,
                      "cache_creation_input_tokens": 1000}) == Tokens(3100, 200, 2000, 1000)
    assert tokens_of({"prompt_tokens": 8, "total_tokens": 8}) == Tokens(8, 0, 0, 0)  # embeddings
    assert tokens_of(None) is None and tokens_of({"total": 3}) is None


def test_amounts_as_text_are_decimal_to_the_nano_dollar_rounded_half_to_even() -> None:
    """The headers' and ``_meta``'s text, made from integer pico-dollars, is what ``Decimal``'s
    quantize to the nano-dollar (half to even) and normalize would write, for every case."""
    import random

    from multiplexer.money.report import pico_text

    def by_decimal(pico: int) -> bytes:
        amount = Decimal(pico).scaleb(-12).quantize(Decimal("0.000000001")).normalize()
        return format(amount, "f").encode()

    picked = random.Random(7)
    cases = [0, 1, 499, 500, 1500, 2500, 1000, 35_000_000, 10**12, 10**12 + 500, 3 * 10**15 + 1,
             *(picked.randrange(10**16) for _ in range(2000)),
             *(picked.randrange(10**6) * 1000 + 500 for _ in range(200))]
    for pico in cases:
        assert pico_text(pico) == by_decimal(pico), pico
    assert pico_text(35_000_000) == b"0.000035" and pico_text(2 * 10**12) == b"2"


def prices(**route: Any) -> Prices:
    return Prices({"oai": ProviderConfig(kind="openai"), "claude": ProviderConfig(kind="anthropic"),
                   "local": ProviderConfig(kind="mock")},
                  {"r": RouteConfig(provider="oai", **route)})


def test_openai_cached_tokens_cost_by_hand() -> None:
    rates = prices().rates("r", "oai", "gpt-4o")
    assert rates is not None and (rates.input, rates.cache_read, rates.output) == (2.5, 1.25, 10)
    t = tokens_of({"prompt_tokens": 2000, "completion_tokens": 500,
                   "prompt_tokens_details": {"cached_tokens": 1000}})
    assert t is not None
    # 1000 plain input x $2.5 + 1000 cached x $1.25 + 500 output x $10, per million
    by_hand = (1000 * Decimal("2.5") + 1000 * Decimal("1.25") + 500 * 10) / M
    assert rates.cost(t) == by_hand == Decimal("0.00875")
    assert rates.uncached(t) - rates.cost(t) == Decimal("0.00125")  # what the prompt cache saved


def test_anthropic_cache_reads_and_writes_by_hand() -> None:
    rates = prices().rates("x", "claude", "claude-sonnet-4-5")
    assert rates is not None
    assert (rates.input, rates.cache_read, rates.cache_write, rates.output) == (3, Decimal("0.3"),
                                                                                 Decimal("3.75"), 15)
    t = tokens_of({"input_tokens": 100, "output_tokens": 200, "cache_read_input_tokens": 2000,
                   "cache_creation_input_tokens": 1000})
    assert t is not None
    assert rates.cost(t) == Decimal("0.00765")  # (100x3 + 2000x0.3 + 1000x3.75 + 200x15) / 1e6


def test_config_price_overrides_and_unknown_models() -> None:
    p = prices(price={"input_per_mtok": "1", "output_per_mtok": "2", "per_call": "0.001"})
    rates = p.rates("r", "oai", "anything")
    assert rates is not None and rates.cost(Tokens(1_000_000, 500_000)) == Decimal("2.001")
    assert prices().rates("r", "oai", "no-such-model-anywhere") is None
    assert prices().rates("x", "local", "gpt-4o") is None  # a mock/local kind: only config prices
    assert prices().batch_discount("r", "oai") == Decimal("0.5")
    assert prices(batch_discount=0.25).batch_discount("r", "oai") == Decimal("0.25")
    assert prices().batch_discount("x", "local") == 0


def plan(route: str, provider: str, params: dict[str, Any], mode: str = "sync") -> Plan:
    p = Plan(Call(route, params, identity="alice"), route, 0.0)
    p.route = RouteConfig(provider=provider, mode=mode)
    p.item = Item(route=route, operation="chat", method=route, params=params, identity="alice",
                  options={"mode": mode})
    return p


def meter() -> Meter:
    return Meter(prices(), ManualClock(), MoneyMetrics(Metrics()))


def test_a_batch_line_costs_half_and_saves_the_rest() -> None:
    m = meter()
    line = {"id": "msg_1", "usage": {"input_tokens": 100, "output_tokens": 200,
                                     "cache_read_input_tokens": 2000, "cache_creation_input_tokens": 1000}}
    provider = Outcome(line)
    batch = plan("r", "claude", {"model": "claude-sonnet-4-5"}, mode="batch")
    answer = m.bill(batch, provider, provider, None)
    assert answer is not provider  # the caller's own outcome
    assert answer.cost == Decimal("0.003825")  # 0.00765 at half price
    # alone and synchronously, cache reads billed as input: (2100x3 + 1000x3.75 + 200x15) / 1e6
    assert answer.saved == Decimal("0.01305") - Decimal("0.003825")
    (record,) = m.take()
    pico = 10**12  # the ledger counts integer pico-dollars
    assert record[5:8] == (3_825_000_000, (Decimal("0.01305") - Decimal("0.003825")) * pico, "batch")
    assert record[8] == Decimal("0.00540") * pico  # of which the prompt cache


def test_a_shared_call_costs_nothing_and_saves_all() -> None:
    m = meter()
    body = Outcome({"usage": {"prompt_tokens": 1000, "completion_tokens": 100}})
    p = plan("r", "oai", {"model": "gpt-4o"})
    mine = m.bill(p, body, body, None)
    theirs = m.bill(p, body, body, "dedup")
    assert mine.cost == Decimal("0.0035") and mine.saved is None
    assert theirs.cost == 0 and theirs.saved == Decimal("0.0035")
    assert body.cost is None  # the provider's outcome, shared by both, is left alone


def test_an_unpriced_model_costs_unknown_not_zero() -> None:
    m = meter()
    body = Outcome({"usage": {"prompt_tokens": 1000, "completion_tokens": 100}})
    answer = m.bill(plan("r", "oai", {"model": "my-own-finetune-xyz"}), body, body, None)
    assert answer.cost is None
    assert m.take()[0][5] is None
    assert m.metrics.unknown == {"r": 1}


# -- through the gateway ------------------------------------------------------------------
def config(f: Any, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    keys = extra.pop("api_keys", {"alice": KEY})
    return {
        "server": {"api_keys": keys, "admin_key": ADMIN, **extra.pop("server", {})},
        "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {
            "oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up",
                    "retry": {"attempts": 1}},
            "claude": {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "up",
                       "retry": {"attempts": 1}},
        },
        "routes": {
            "chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini", "house-model"]},
            "cached": {"provider": "oai", "operation": "chat", "cache_ttl_s": 60,
                       "params": {"model": "gpt-4o-mini", "temperature": 0}},
            "claude": {"provider": "claude", "operation": "messages", "models": ["claude-sonnet-4-5"]},
        },
        **extra,
    }


@asynccontextmanager
async def gateway(tmp_path: Path, **extra: Any):
    async with (
        fakes() as f,
        running(parse_config(config(f, tmp_path, **extra)), port=0) as (gw, url),
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as client,
    ):
        yield f, gw, client


def chat(text: str, **more: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], **more}


def rpc(method: str, params: Any, rid: int = 1, **meta: Any) -> dict[str, Any]:
    if meta:
        params = {**params, "_meta": meta}
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


async def spend(client: httpx.AsyncClient, **query: str) -> dict[str, Any]:
    reply = await client.get("/admin/spend", params=query, headers={"authorization": f"Bearer {ADMIN}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_cost_header_rpc_meta_and_the_report(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (_, gw, client):
        r = await client.post("/v1/chat/completions", json=chat("hello there"))
        assert r.status_code == 200
        usage = r.json()["usage"]
        # gpt-4o-mini: $0.15 in, $0.60 out per million
        expected = (usage["prompt_tokens"] * Decimal("0.15")
                    + usage["completion_tokens"] * Decimal("0.6")) / M
        assert Decimal(r.headers["x-multiplexer-cost-usd"]) == expected == Decimal("0.0000021")
        assert "x-multiplexer-saved-usd" not in r.headers
        r = await client.post("/rpc", json=rpc("chat", chat("hello there"), want_cost=True))
        assert r.json()["result"]["_meta"] == {"cost_usd": "0.0000021"}
        r = await client.post("/rpc", json=rpc("chat", chat("hello there")))
        assert "_meta" not in r.json()["result"]  # only when asked
        r = await client.post("/rpc", json=rpc("chat", chat("x"), want_cost="yes"))
        assert r.json()["error"]["code"] == -32602
        # an unpriced model: no header, counted unknown
        r = await client.post("/v1/chat/completions", json={**chat("hi"), "model": "house-model"})
        assert r.status_code == 200 and "x-multiplexer-cost-usd" not in r.headers
        report = await spend(client, group_by="key,route,model")
        rows = {row["model"]: row for row in report["rows"]}
        assert rows["gpt-4o-mini"]["calls"] == 3 and rows["house-model"]["unknown_cost_calls"] == 1
        assert rows["gpt-4o-mini"]["cost_usd"] == pytest.approx(0.0000063)
        assert rows["gpt-4o-mini"]["key"] == "alice" and rows["gpt-4o-mini"]["route"] == "chat"
        assert report["total"]["calls"] == 4 and report["total"]["unknown_cost_calls"] == 1
        metrics = (await client.get("/metrics")).text
        line = next(x for x in metrics.splitlines()
                    if x.startswith('multiplexer_spend_usd_total{provider="oai",route="chat"}'))
        assert float(line.split()[-1]) == pytest.approx(0.0000063)
        assert 'multiplexer_unknown_cost_calls_total{route="chat"} 1.0' in metrics
        bad = await client.get("/admin/spend", params={"group_by": "colour"},
                               headers={"authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 400 and "group_by" in bad.json()["error"]["message"]
        assert (await client.get("/admin/spend")).status_code == 401  # a caller's key is not admin
    assert gw.money is not None


async def test_a_stream_is_priced_from_its_final_usage(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (_, _, client):
        async with client.stream("POST", "/v1/chat/completions",
                                 json=chat("one two three", stream=True)) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                pass
        report = await spend(client, group_by="route")
        # prompt 3 words, reply "echo: one two three" 4 words
        by_hand = (3 * Decimal("0.15") + 4 * Decimal("0.6")) / M
        assert report["rows"][0]["cost_usd"] == pytest.approx(float(by_hand))


def sse_data(body: str) -> list[Any]:
    """The JSON of each ``data:`` line of a server-sent event stream (``[DONE]`` left out)."""
    import json

    return [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def test_a_streams_cost_rides_in_its_final_usage_event(tmp_path: Path) -> None:
    """The headers of a stream leave before its usage is known: its cost and saving come in the
    event with the final usage, in each API's shape, and equal what the spend report booked."""
    async with gateway(tmp_path) as (_, _, client):
        r = await client.post("/v1/chat/completions", json=chat(
            "one two three", stream=True, stream_options={"include_usage": True}))
        *words, last = sse_data(r.text)
        assert r.status_code == 200 and "x-multiplexer-cost-usd" not in r.headers
        assert r.text.endswith("data: [DONE]\n\n") and last["choices"] == []
        # prompt 3 words, reply "echo: one two three" 4 words, gpt-4o-mini at $0.15 / $0.6
        assert last["usage"]["prompt_tokens"] == 3 and last["usage"]["completion_tokens"] == 4
        openai_cost = (3 * Decimal("0.15") + 4 * Decimal("0.6")) / M
        assert Decimal(last["usage"]["cost_usd"]) == openai_cost
        assert all("usage" not in w or w["usage"] is None for w in words)

        plain = await client.post("/v1/chat/completions", json=chat("one two three", stream=True))
        assert all(not e.get("usage") for e in sse_data(plain.text))  # not asked for: no usage event

        r = await client.post("/v1/messages", json={
            "model": "claude-sonnet-4-5", "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "four five"}]})
        events = sse_data(r.text)
        [delta] = [e for e in events if e["type"] == "message_delta"]
        [start] = [e for e in events if e["type"] == "message_start"]
        assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
        spent_in = start["message"]["usage"]["input_tokens"]
        spent_out = delta["usage"]["output_tokens"]
        claude_cost = (spent_in * 3 + spent_out * 15) / M  # claude-sonnet-4-5: $3 / $15
        assert spent_in > 0 and Decimal(delta["usage"]["cost_usd"]) == claude_cost

        r = await client.post("/v1/responses", json={"model": "gpt-4o-mini", "input": "six seven",
                                                     "stream": True})
        done = sse_data(r.text)[-1]
        assert done["type"] == "response.completed"
        usage = done["response"]["usage"]
        responses_cost = (usage["input_tokens"] * Decimal("0.15")
                          + usage["output_tokens"] * Decimal("0.6")) / M
        assert usage["output_tokens"] > 0 and Decimal(usage["cost_usd"]) == responses_cost

        report = await spend(client, group_by="route")
        by_route = {row["route"]: Decimal(str(row["cost_usd"])) for row in report["rows"]}
        assert by_route["claude"] == claude_cost
        # and the stream that did not ask for its usage, priced all the same
        assert by_route["chat"] == pytest.approx(2 * openai_cost + responses_cost)


async def test_a_dedup_burst_and_a_cache_hit_show_their_savings(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (f, _, client):
        body = {"messages": [{"role": "user", "content": "same words"}]}

        async def one(i: int, out: list[Any]) -> None:
            r = await client.post("/rpc", json=rpc("cached", body, rid=i, want_cost=True))
            out.append(r.json()["result"]["_meta"])

        metas: list[Any] = []
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i, metas)
        after_burst = f.openai.requests["/v1/chat/completions"]
        later: list[Any] = []
        await one(99, later)  # from the cache
        assert f.openai.requests["/v1/chat/completions"] == after_burst
        cost = Decimal("0.0000021")  # 2 words in, 3 out ("echo: same words") at gpt-4o-mini prices
        paid = [m for m in metas if Decimal(m["cost_usd"]) > 0]
        assert [Decimal(m["cost_usd"]) for m in paid] == [cost] * after_burst
        assert all(Decimal(m["saved_usd"]) == cost for m in metas if m not in paid)
        assert later == [{"cost_usd": "0", "saved_usd": "0.0000021"}]
        total = (await spend(client, group_by=""))["total"]
        assert total["calls"] == 9
        assert total["saved_by"]["cache"] > 0 and total["saved_usd"] == pytest.approx(
            float(cost * (9 - after_burst)))


async def test_spend_command_prints_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    async with gateway(tmp_path) as (_, _, client):
        await client.post("/v1/chat/completions", json=chat("hello there"))
        url = str(client.base_url).rstrip("/")
        monkeypatch.setenv("MULTIPLEXER_MASTER_KEY", ADMIN)
        status = await anyio.to_thread.run_sync(cli.main, ["spend", "--by", "key,route", "--url", url])
        out = capsys.readouterr().out.splitlines()
        assert status == 0
        assert out[0].split() == ["key", "route", "calls", "cost_usd", "saved_usd", "unknown_cost_calls",
                                  "cache_read_share"]
        assert out[1].split() == ["alice", "chat", "1", "0.000002", "0.000000", "0", "0.0000"]
        assert out[-1].split()[0] == "total"
        monkeypatch.setenv("MULTIPLEXER_MASTER_KEY", "wrong")
        assert await anyio.to_thread.run_sync(cli.main, ["spend", "--url", url]) != 0


BUDGET = {"api_keys": {"alice": {"key": KEY, "budget_usd": {"daily": "0.00001"}}}}


async def test_budget_refusals_in_each_faces_shape(tmp_path: Path) -> None:
    async with gateway(tmp_path, **BUDGET) as (f, _, client):
        first = await client.post("/v1/chat/completions", json=chat("hello there", max_tokens=10))
        assert first.status_code == 200
        sent = f.openai.requests["/v1/chat/completions"]
        for _ in range(20):  # the cap is reached as reservations settle; then every call is refused
            r = await client.post("/v1/chat/completions", json=chat("hello there", max_tokens=10))
            if r.status_code == 429:
                break
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["code"] == "insufficient_quota" and err["type"] == "insufficient_quota"
        assert int(r.headers["retry-after"]) >= 1
        sent = f.openai.requests["/v1/chat/completions"]
        r = await client.post("/rpc", json=rpc("chat", chat("hello there")))
        e = r.json()["error"]
        assert e["code"] == -32003 and e["data"]["limit"] == "budget_usd"
        assert e["data"]["period"] == "daily" and e["data"]["reset"].endswith("T00:00:00Z")
        assert Decimal(e["data"]["spend"]) >= Decimal("0.00001")
        r = await client.post("/v1/messages", headers={"x-api-key": KEY}, json={
            "model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert f.openai.requests["/v1/chat/completions"] == sent  # nothing was sent once refused
        metrics = (await client.get("/metrics")).text
        assert 'multiplexer_budget_refusals_total{period="daily",scope="key"} 3.0' in metrics


async def test_auto_mode_sends_a_patient_call_to_the_batch_api_and_books_the_saving(tmp_path: Path) -> None:
    routes = {"auto": {"provider": "oai", "operation": "chat", "mode": "auto", "max_latency_s": 90_000,
                       "params": {"model": "gpt-4o-mini"}}}
    async with fakes() as f:
        data = config(f, tmp_path)
        data["routes"].update(routes)
        data["providers"]["oai"]["batch_poll_interval_s"] = 0.01
        auth = {"authorization": f"Bearer {KEY}"}
        async with running(parse_config(data), port=0) as (_, url), \
                httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:
            msg = {"messages": [{"role": "user", "content": "hello there"}]}
            # its route allows a day: the batch API (24h window), at half price
            r = (await client.post("/rpc", json=rpc("auto", msg, want_cost=True))).json()
            assert r["result"]["choices"][0]["message"]["content"] == "echo: hello there"
            assert len(f.openai.batches) == 1 and f.openai.requests["/v1/chat/completions"] == 0
            assert r["result"]["_meta"] == {"cost_usd": "0.00000105", "saved_usd": "0.00000105"}
            # this caller needs an answer within a second: now, at the full price
            r = (await client.post("/rpc", json=rpc("auto", msg, want_cost=True, timeout_ms=1000))).json()
            assert r["result"]["_meta"] == {"cost_usd": "0.0000021"}
            assert len(f.openai.batches) == 1 and f.openai.requests["/v1/chat/completions"] == 1
            total = (await spend(client, group_by="route"))["rows"][0]
            assert total["calls"] == 2 and total["saved_by"]["batch"] == pytest.approx(0.00000105)


async def test_packed_embeddings_book_the_upstream_requests_they_saved(tmp_path: Path) -> None:
    async with fakes() as f:
        data = config(f, tmp_path)
        data["routes"]["embed"] = {"provider": "oai", "operation": "embeddings",
                                   "batch": {"max_items": 8, "max_wait_ms": 200, "eager": False},
                                   "params": {"model": "text-embedding-3-small"}}
        auth = {"authorization": f"Bearer {KEY}"}
        async with running(parse_config(data), port=0) as (_, url), \
                httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:
            r = await client.post("/rpc", json=[rpc("embed", {"input": f"text number {i}"}, rid=i)
                                                for i in range(8)])
            assert all("result" in x for x in r.json())
            sent = f.openai.requests["/v1/embeddings"]
            assert sent < 8
            total = (await spend(client, group_by="route"))["rows"][0]
            assert total["calls"] == 8 and total["upstream_requests_saved"] == pytest.approx(8 - sent)
            # text-embedding-3-small: $0.02 per million; 3 words each
            assert total["cost_usd"] == pytest.approx(8 * 3 * 0.02 / 1e6)


async def test_a_daily_budget_alerts_once_and_starts_again_at_midnight(
        caplog: pytest.LogCaptureFixture) -> None:
    from multiplexer.core.policy import BudgetUsd
    from multiplexer.money.budgets import Budgets, LocalCounters
    from multiplexer.money.settings import BudgetsConfig

    # 2026-12-03 23:00 in Paris (22:00 UTC)
    clock = ManualClock(wall=1_796_335_200.0)
    alerts: list[tuple[str, str]] = []
    cap = BudgetUsd(daily=Decimal("0.001"), alert_at=0.5)
    budgets = Budgets(BudgetsConfig(timezone="Europe/Paris"), prices(), LocalCounters(clock.wall),
                      lambda identity: [("key", "alice", cap)], clock.wall,
                      lambda scope, period: None, lambda scope, period: alerts.append((scope, period)))
    p = plan("r", "oai", {"model": "gpt-4o", "max_tokens": 100, "messages": []})
    p.item.tokens = 110  # type: ignore[union-attr]
    most = budgets.most(p)
    assert most == (10 * 2500 + 100 * 10_000) * 1000 // 1000  # 10 in, 100 out at gpt-4o's prices, nano
    decided = []
    for _ in range(3):
        decided += await budgets.reserve([p], [[("key", "alice", cap)]])
    assert [type(d).__name__ for d in decided] == ["Reservation", "RpcError", "RpcError"]
    assert alerts == [("key", "daily")] and "budget alert" in caplog.text
    refusal = decided[1]
    assert refusal.data["reset"] == "2026-12-03T23:00:00Z"  # midnight in Paris  # type: ignore[union-attr]
    await clock.advance(3600)  # a new day in Paris: a new counter
    (again,) = await budgets.reserve([p], [[("key", "alice", cap)]])
    assert type(again).__name__ == "Reservation" and alerts == [("key", "daily"), ("key", "daily")]


async def test_mcp_results_carry_the_cost_when_asked(tmp_path: Path) -> None:
    from tests.mcp_helpers import mcp_http_client

    async with gateway(tmp_path) as (_, _, client):
        url = str(client.base_url).rstrip("/") + "/mcp"
        async with mcp_http_client(url, key=KEY) as mcp:
            args = chat("hello there")
            asked = await mcp.call_tool("chat", args, meta={"want_cost": True})
            assert not asked.is_error and (asked.meta or {}).get("cost_usd") == "0.0000021"
            plain = await mcp.call_tool("chat", args)
            assert not plain.is_error and not (plain.meta or {}).get("cost_usd")


async def test_the_writer_stops_before_the_spend_store_closes(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A gateway closing while its spend writer is mid-batch: the writer's task ends first, the
    last batch is written after it, and nothing touches the closed store (no error logged)."""
    import logging
    import threading

    from multiplexer.gateway.gateway import Gateway
    from multiplexer.money.spend_store import SpendStore

    caplog.set_level(logging.ERROR)
    clock = ManualClock()
    conf = parse_config({"store": {"path": str(tmp_path / "jobs.db")},
                         "providers": {"m": {"kind": "mock", "price": {"input_per_mtok": 1,
                                                                      "output_per_mtok": 1}}},
                         "routes": {"chat": {"provider": "m", "operation": "chat", "models": ["gpt-x"]}}})
    entered, release = threading.Event(), threading.Event()
    added: list[int] = []
    real_add = SpendStore.add

    def slow_add(self: SpendStore, rows: Any) -> None:
        entered.set()
        release.wait(10)  # the writer holds its batch while the gateway starts closing
        added.append(sum(r[5] for r in rows))
        real_add(self, rows)

    gw = Gateway(conf, clock=clock)
    async with gw:
        assert gw.money is not None
        gw.money.store = None
        SpendStore.add = slow_add  # type: ignore[method-assign]
        try:
            assert (await gw.submit(Call("chat", chat("one")))).ok
            await clock.advance(gw.money.config.flush_interval_s)  # the writer's batch starts
            await anyio.to_thread.run_sync(entered.wait, 10)
            assert (await gw.submit(Call("chat", chat("two")))).ok  # after the batch was taken
            timer = threading.Timer(0.05, release.set)  # lets the batch go once closing began
            timer.start()
            await gw.aclose()
            timer.join()
        finally:
            SpendStore.add = real_add  # type: ignore[method-assign]
    assert added == [1, 1]  # the writer's batch, then the last one, both written
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
