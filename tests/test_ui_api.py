"""The dashboard's JSON (`/ui/api/state`) and stream (`/ui/api/stream`): who may read them, that
their numbers are `/metrics`'s, and that streams share one snapshot per tick.

The page itself is driven in a real browser in tests/test_ui_browser.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from multiplexer.access.admin import ENV
from multiplexer.faces.ui.samples import quantile
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, v1_config

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "u" * 28
BOB = "bob-key-0123456789abcdef"
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
API = ("/ui/api/state", "/ui/api/stream")


def echo_config(tmp_path: Path | None, **server: Any) -> Any:
    """An echo gateway whose store is the test's own (``tmp_path``; None: the default store)."""
    store = {} if tmp_path is None else {"store": {"path": str(tmp_path / "multiplexer.db")}}
    return parse_config({"server": server, "providers": {"e": {"kind": "echo",
                                                               "batch": {"max_items": 8, "max_wait_ms": 2}}},
                         "routes": {"echo": {"provider": "e"}}, **store})


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)


@asynccontextmanager
async def serving(config: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with running(config, port=0) as (gw, url), httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield gw, http


async def frames(http: httpx.AsyncClient, n: int, headers: dict[str, str]) -> list[bytes]:
    """The first ``n`` snapshots of a stream, as sent."""
    out: list[bytes] = []
    async with http.stream("GET", "/ui/api/stream", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(line[6:].encode())
                if len(out) == n:
                    break
    return out


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_the_page_and_its_files_need_no_key_and_hold_no_data(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN)) as (_, http):
        root = await http.get("/", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/ui"
        page = await http.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/ui/static/app.js">' in page.text and "http" not in page.text.split("<body>")[0]
        for name, kind in [("app.js", "text/javascript"), ("app.css", "text/css"),
                           ("uplot.iife.min.js", "text/javascript"), ("uplot-LICENSE.txt", "text/plain")]:
            r = await http.get(f"/ui/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert (await http.get("/ui/static/../server.py")).status_code == 404
        assert (await http.get("/ui/static/nope.js")).json()["error"]["code"] == 404


async def test_the_api_and_the_stream_answer_only_a_key(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN, api_keys={"alice": KEY})) as (_, http):
        for path in API:
            for headers in ({}, {"authorization": "Bearer wrong-key-0123456789"},
                            {"authorization": "Basic x"}):
                r = await http.get(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
        admin = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()
        assert admin["view"] == "admin" and admin["identity"] is None
        assert set(admin["panels"]) == {"routes", "limits", "jobs", "mcp", "local", "state", "spend",
                                        "breakers", "cache"}
        own = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {KEY}"})).json()
        assert own["view"] == "key" and own["identity"] == "alice"
        assert set(own["panels"]) == {"jobs", "spend"}  # a caller sees nothing of the others
        assert admin["panels"]["breakers"] == {"configured": False,
                                               "detail": admin["panels"]["breakers"]["detail"]}


async def test_without_any_key_the_api_is_off_and_says_how_to_turn_it_on(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path)) as (_, http):
        for path in API:
            r = await http.get(path)
            assert r.status_code == 404 and "server.admin_key" in r.json()["error"]["message"]
        assert (await http.get("/ui")).status_code == 200  # the page, to say so


async def test_server_ui_false_mounts_nothing(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN, ui=False)) as (_, http):
        for path in ("/", "/ui", "/ui/static/app.js", *API):
            assert (await http.get(path, headers=AS_ADMIN)).status_code == 404, path


async def test_every_number_equals_metrics(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN)) as (_, http):
        body = [{"jsonrpc": "2.0", "id": i, "method": "echo", "params": {"i": i}} for i in range(20)]
        assert len((await http.post("/rpc", json=body)).json()) == 20
        await http.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "nope"})
        state = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()["panels"]
        m = scrape((await http.get("/metrics")).text)

    routes = {r["route"]: r for r in state["routes"]["routes"]}
    ok = m[("multiplexer_calls_total", (("outcome", "ok"), ("route", "echo")))]
    assert routes["echo"]["ok"] == ok == 20
    assert routes["(no route)"]["errors"] == {"-32601": 1}
    latency = routes["echo"]["latency"]
    assert latency["count"] == m[("multiplexer_call_duration_seconds_count", (("route", "echo"),))] == 20
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in m.items()
                     if k[0] == "multiplexer_call_duration_seconds_bucket" and ("route", "echo") in k[1])
    assert latency["p50_ms"] == round(quantile(0.5, buckets) * 1000, 3)  # type: ignore[operator]
    assert latency["p99_ms"] == round(quantile(0.99, buckets) * 1000, 3)  # type: ignore[operator]

    lane = next(x for x in state["routes"]["lanes"] if x["lane"] == "e")
    assert lane["batches"] == m[("multiplexer_batch_size_count", (("provider", "e"),))]
    assert lane["items"] == m[("multiplexer_batch_size_sum", (("provider", "e"),))] == 20
    assert sum(n for _, n in lane["batch_sizes"]) == lane["batches"] < 20  # calls shared batches
    provider = next(x for x in state["routes"]["providers"] if x["provider"] == "e")
    assert provider["upstream_requests"] == m[("multiplexer_upstream_requests_total", (("provider", "e"),))]
    totals = state["routes"]["totals"]
    assert totals["calls"] == 21 and totals["ratio"] == round(21 / provider["upstream_requests"], 3)
    limits = next(x for x in state["limits"]["providers"] if x["provider"] == "e")
    assert limits["concurrency"]["in_flight"] == 0 and limits["rpm"] is None
    assert state["state"]["state"] == {"mode": "local", "reachable": True, "replicas": 1, "degraded": {}}
    assert state["spend"]["configured"] is True and state["spend"]["routes"] == []  # echo is not priced


async def test_the_spend_panel_equals_metrics(tmp_path: Any) -> None:
    config = parse_config({
        "server": {"admin_key": ADMIN}, "store": {"path": str(tmp_path / "jobs.db")},
        "providers": {"m": {"kind": "mock", "price": {"input_per_mtok": 1000, "output_per_mtok": 2000}}},
        "routes": {"chat": {"provider": "m", "operation": "chat", "models": ["mock-gpt"]}}})
    async with serving(config) as (_, http):
        for i in range(3):
            r = await http.post("/v1/chat/completions", json={
                "model": "mock-gpt", "messages": [{"role": "user", "content": f"hello {i}"}]})
            assert float(r.headers["x-multiplexer-cost-usd"]) > 0
        spend = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()["panels"]["spend"]
        m = scrape((await http.get("/metrics")).text)
    [row] = spend["routes"]
    assert row["route"] == "chat" and row["unknown_cost_calls"] == 0
    assert row["cost_usd"] == m[("multiplexer_spend_usd_total", (("provider", "m"), ("route", "chat")))] > 0
    assert spend["cost_usd"] == row["cost_usd"] and spend["saved_usd"] == 0


def priced_keys_config(tmp_path: Any) -> Any:
    """A priced mock route (whole nano-dollars per token, so sums are exact), two keys (alice with
    a budget), spend written only when the test says (flush_interval_s: an hour)."""
    return parse_config({
        "server": {"admin_key": ADMIN, "api_keys": {
            "alice": {"key": KEY, "budget_usd": {"daily": "2", "monthly": "10", "total": "50"}},
            "bob": BOB}},
        "store": {"path": str(tmp_path / "jobs.db")}, "spend": {"flush_interval_s": 3600},
        "providers": {"m": {"kind": "mock", "price": {"input_per_mtok": 1000, "output_per_mtok": 2000}}},
        "routes": {"chat": {"provider": "m", "operation": "chat", "models": ["mock-gpt"]}}})


async def spend_calls(http: httpx.AsyncClient, key: str, n: int) -> Decimal:
    """``n`` priced calls as ``key``: what they cost, from their answers' cost headers."""
    cost = Decimal(0)
    for i in range(n):
        r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
            "model": "mock-gpt", "messages": [{"role": "user", "content": f"{key[:3]} says hello {i}"}]})
        assert r.status_code == 200
        cost += Decimal(r.headers["x-multiplexer-cost-usd"])
    return cost


async def test_a_caller_key_sees_its_own_spend_only(tmp_path: Any) -> None:
    async with serving(priced_keys_config(tmp_path)) as (gw, http):
        alice_cost = await spend_calls(http, KEY, 3)
        bob_cost = await spend_calls(http, BOB, 1)
        assert alice_cost > 0 and bob_cost > 0 and alice_cost != bob_cost

        async def view(key: str) -> dict[str, Any]:
            r = await http.get("/ui/api/state", headers={"authorization": f"Bearer {key}"})
            return r.json()["panels"]["spend"]  # type: ignore[no-any-return]

        # nothing written yet: the figures come from the writer's buffer
        assert len(gw.money.meter.records) == 4
        alice, bob = await view(KEY), await view(BOB)
        admin = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()["panels"]["spend"]
        m = scrape((await http.get("/metrics", headers=AS_ADMIN)).text)
        reads = gw.money.own.reads
        assert await view(KEY) == alice and gw.money.own.reads == reads  # cached: no second read

        # written: the same figures from the store (nothing counted twice)
        await gw.money.flush()
        assert not gw.money.meter.records
        gw.money.own.ttl_s = 0
        assert await view(KEY) == alice and await view(BOB) == bob
        assert gw.money.own.reads == reads + 2

    today = alice["day"]
    assert alice["month"] == today[:7]
    for period in ("today", "this_month"):
        assert alice[period]["cost_usd"] == float(alice_cost) and alice[period]["calls"] == 3
        assert bob[period]["cost_usd"] == float(bob_cost) and bob[period]["calls"] == 1
    [row] = alice["routes"]
    assert (row["route"], row["model"]) == ("chat", "mock-gpt")
    assert row["today"]["cost_usd"] == row["this_month"]["cost_usd"] == float(alice_cost)
    spent = float(alice_cost)
    assert [(b["period"], b["budget_usd"], b["spent_usd"]) for b in alice["budgets"]] == [
        ("daily", 2.0, spent), ("monthly", 10.0, spent), ("total", 50.0, spent)]
    assert alice["budgets"][0]["used"] == round(float(alice_cost) / 2, 4)
    assert alice["budgets"][0]["reset_at"] > 0 and alice["budgets"][2]["reset_at"] is None
    assert bob["budgets"] == [] and str(float(bob_cost)) not in json.dumps(alice)
    assert "bob" not in json.dumps(alice)
    # the admin's panel: /metrics's counters, every key together, by route; and what the store
    # has by day and by key (nothing written yet when it was read: the writer had not flushed)
    assert set(admin) == {"configured", "cost_usd", "saved_usd", "saved_by", "unknown_cost_calls", "routes",
                          "stored"}
    assert admin["cost_usd"] == m[("multiplexer_spend_usd_total", (("provider", "m"), ("route", "chat")))]
    assert admin["cost_usd"] == pytest.approx(float(alice_cost + bob_cost))
    assert admin["stored"]["days"] == [] and admin["stored"]["keys"] == []


async def test_the_admins_spend_panel_has_the_stores_spend_by_day_and_key(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every number of the admin's by-day and by-key figures equals `GET /admin/spend`'s."""
    from multiplexer.money import ledger

    monkeypatch.setattr(ledger, "OVERVIEW_S", 3600.0)  # the cache outlives the test however slow
    async with serving(priced_keys_config(tmp_path)) as (gw, http):
        alice_cost = await spend_calls(http, KEY, 2)
        bob_cost = await spend_calls(http, BOB, 1)
        await gw.money.flush()
        panel = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()["panels"]["spend"]["stored"]
        by_key = (await http.get("/admin/spend?group_by=key", headers=AS_ADMIN)).json()
        by_day = (await http.get("/admin/spend?group_by=day", headers=AS_ADMIN)).json()
        await spend_calls(http, KEY, 1)
        await gw.money.flush()
        again = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()["panels"]["spend"]["stored"]
    assert panel["keys"] == by_key["rows"] and panel["days"] == by_day["rows"]
    costs = {k["key"]: k["cost_usd"] for k in panel["keys"]}
    assert len(costs) == 2 and sorted(costs.values()) == sorted([float(alice_cost), float(bob_cost)])
    [today] = panel["days"]
    assert today["calls"] == 3 and today["cost_usd"] == pytest.approx(float(alice_cost + bob_cost))
    assert again == panel  # read at most once per OVERVIEW_S, whatever was written meanwhile


async def test_streams_share_one_snapshot_per_tick_and_build_none_unwatched(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN)) as (gw, http):
        ticks = gw.faces["ui"]
        ticks.interval_s = 0.05
        got: list[list[bytes]] = [[] for _ in range(5)]

        async def watch(i: int) -> None:
            got[i] = await frames(http, 4, AS_ADMIN)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(watch, i)
        by_tick: dict[int, set[bytes]] = {}
        for stream in got:
            ticks_seen = [json.loads(f)["tick"] for f in stream]
            assert ticks_seen == sorted(set(ticks_seen))  # one snapshot per tick, in order
            for f in stream:
                by_tick.setdefault(json.loads(f)["tick"], set()).add(f)
        assert all(len(bodies) == 1 for bodies in by_tick.values())  # the same bytes for everyone
        assert ticks.built == len(by_tick) < 20  # five streams, one build per tick
        await anyio.sleep(0.01)
        assert ticks.subscribers == 0 and ticks.views == {}
        built = ticks.built
        await anyio.sleep(0.2)  # four ticks with nobody watching
        assert ticks.built == built


async def test_a_caller_key_sees_its_own_jobs_only(tmp_path: Any) -> None:
    async with fakes() as f:
        data = v1_config(f, tmp_path, admin_key=ADMIN)
        data["server"]["api_keys"]["bob"] = BOB
        data["routes"]["chat_batch"] = {"provider": "oai", "operation": "chat", "mode": "batch"}
        async with serving(parse_config(data)) as (_, http):
            submit = {"jsonrpc": "2.0", "id": 1, "method": "jobs.submit", "params": {
                "more": True, "calls": [{"method": "chat_batch", "params": {
                    "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}}] * 3}}
            job = (await http.post("/rpc", json=submit, headers={"authorization": f"Bearer {KEY}"})).json()
            job_id = job["result"]["job_id"]
            alice = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {KEY}"})).json()
            bob = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {BOB}"})).json()
            admin = (await http.get("/ui/api/state", headers=AS_ADMIN)).json()
            m = scrape((await http.get("/metrics", headers=AS_ADMIN)).text)
    mine = alice["panels"]["jobs"]["jobs"]
    assert [j["job_id"] for j in mine] == [job_id] and mine[0]["total"] == 3
    assert sum(mine[0]["counts"].values()) == 3
    assert bob["panels"]["jobs"]["jobs"] == [] and "open" not in bob["panels"]["jobs"]
    panel = admin["panels"]["jobs"]
    assert [j["job_id"] for j in panel["jobs"]] == [job_id] and panel["jobs"][0]["identity"] == "alice"
    assert panel["open"] == m[("multiplexer_batch_jobs_open", ())] == 1
    assert sum(panel["items"].values()) == 3
    for state, n in panel["items"].items():
        assert n == m[("multiplexer_batch_items", (("state", state),))]


async def test_a_failing_panel_says_so_and_the_others_still_answer(monkeypatch: Any, tmp_path: Path) -> None:
    from multiplexer.faces.ui import panels

    async def broken(view: Any) -> dict[str, Any]:
        raise OSError("the store went away")

    monkeypatch.setitem(panels.PANELS, "limits", (broken, False))
    async with serving(echo_config(tmp_path, admin_key=ADMIN)) as (_, http):
        r = await http.get("/ui/api/state", headers=AS_ADMIN)
        assert r.status_code == 200
        body = r.json()["panels"]
        assert body["limits"] == {"configured": True, "error": "OSError: the store went away"}
        assert body["routes"]["totals"]["calls"] == 0
        assert (await frames(http, 1, AS_ADMIN))[0].count(b"the store went away") == 1


async def test_open_streams_end_when_the_server_stops(tmp_path: Path) -> None:
    """A dashboard left open does not hold the shutdown for the grace period."""
    ended = anyio.Event()
    got: list[bytes] = []

    async def watch(http: httpx.AsyncClient, first: anyio.Event) -> None:
        async with http.stream("GET", "/ui/api/stream", headers=AS_ADMIN) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got.append(line.encode())
                    first.set()
        ended.set()  # the server closed the stream: the body ended, no error

    async with httpx.AsyncClient(timeout=30) as http, anyio.create_task_group() as tg:
        with anyio.fail_after(4):  # well inside the 5 s grace period an open stream would hold
            async with running(echo_config(tmp_path, admin_key=ADMIN), port=0) as (gw, url):
                http.base_url = httpx.URL(url)
                first = anyio.Event()
                tg.start_soon(watch, http, first)
                await first.wait()
                assert gw.faces["ui"].subscribers == 1
            await ended.wait()
    assert len(got) >= 1


# -- every read is one request of its key -----------------------------------------------------

BOB_AUTH = {"authorization": f"Bearer {BOB}"}
POLICY = "default-src 'self'; script-src 'self'; frame-ancestors 'none'"


def too_many(r: httpx.Response, limit: str) -> None:
    """Refused by the key's ``limit``, in the admin API's shape."""
    assert r.status_code == 429, r.text
    assert r.json() == {"error": {"message": f"Rate limited: {limit}", "type": "rate_limited",
                                  "code": 429}}
    assert int(r.headers["retry-after"]) >= 1


async def test_a_key_at_one_request_a_minute_reads_the_dashboard_once(tmp_path: Path) -> None:
    """The dashboard's JSON is a request like any other: a snapshot costs the gateway a walk over
    every panel (open job items counted under the store's lock), so a key's rpm bounds it."""
    bob = {"bob": {"key": BOB, "rpm": 1}}
    async with serving(echo_config(tmp_path, admin_key=ADMIN, api_keys=bob)) as (_, http):
        replies = [await http.get("/ui/api/state", headers=BOB_AUTH) for _ in range(5)]
        assert [r.status_code for r in replies] == [200, 429, 429, 429, 429]
        too_many(replies[1], "rpm")
        r = await http.get("/ui/api/stream", headers=BOB_AUTH)  # a stream's opening is one too
        too_many(r, "rpm")
        assert (await http.get("/ui/api/state", headers=AS_ADMIN)).status_code == 200


async def test_an_open_stream_holds_its_keys_one_slot_until_it_closes(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN,
                                   api_keys={"bob": {"key": BOB, "concurrency": 1}})) as (_, http):
        async with http.stream("GET", "/ui/api/stream", headers=BOB_AUTH) as first:
            assert first.status_code == 200
            async for line in first.aiter_lines():
                if line.startswith("data: "):
                    break
            too_many(await http.get("/ui/api/stream", headers=BOB_AUTH), "concurrency")
            too_many(await http.get("/ui/api/state", headers=BOB_AUTH), "concurrency")
        with anyio.fail_after(10):  # the server sees the client go at its next tick at the latest
            while (await http.get("/ui/api/state", headers=BOB_AUTH)).status_code == 429:
                await anyio.sleep(0.05)


async def test_admin_reads_reach_the_quota_decision_and_are_never_refused(tmp_path: Path) -> None:
    """The admin key has no quota: its dashboard and /admin reads are counted (each one claim in
    the one quota decision), never refused."""
    bob = {"bob": {"key": BOB, "rpm": 1}}
    async with serving(echo_config(tmp_path, admin_key=ADMIN, api_keys=bob)) as (gw, http):
        seen: list[str | None] = []
        decide = gw.quotas.decide

        async def spy(claims: Any) -> Any:
            seen.extend(c.identity for c in claims if c is not None)
            return await decide(claims)

        gw.quotas.decide = spy
        for _ in range(3):
            assert (await http.get("/ui/api/state", headers=AS_ADMIN)).status_code == 200
            assert (await http.get("/admin/whoami", headers=AS_ADMIN)).status_code == 200
        assert (await frames(http, 1, AS_ADMIN))
        assert (await http.get("/ui/api/state", headers=BOB_AUTH)).status_code == 200
        assert (await http.get("/admin/whoami")).status_code == 401  # no key: nothing decided
        assert seen == [None] * 7 + ["bob"]


async def test_the_page_may_run_only_its_own_files(tmp_path: Path) -> None:
    async with serving(echo_config(tmp_path, admin_key=ADMIN)) as (_, http):
        page = await http.get("/ui")
        assert page.headers["content-security-policy"] == POLICY
        assert page.headers["x-content-type-options"] == "nosniff"
        assert " style=" not in page.text and "<script>" not in page.text
        script = (await http.get("/ui/static/app.js")).text
        assert "style=" not in script  # the policy refuses style attributes: widths go through the DOM
