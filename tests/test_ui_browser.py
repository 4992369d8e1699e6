"""The dashboard in a real browser: the system's Chromium, driven by Playwright (no browser
download). A gateway with the shipped default config (mock, echo, an MCP child, a local model) and
an admin key serves `/ui`; the test logs in (the form, then a `#key=` link), sends calls, and
waits until the page shows the numbers `/metrics` and `/ui/api/state` have. A screenshot of each
panel goes to the test's temporary folder.

Without Chromium (``apt-get install chromium``) or Playwright this test skips and says why; the
API's own tests (tests/test_ui_api.py) run everywhere."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from multiplexer.access.admin import ENV
from multiplexer.gateway.config import load_config, parse_config
from multiplexer.server import running
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, v1_config

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "b" * 28
DEFAULT = Path(__file__).parents[1] / "multiplexer" / "defaults" / "default.yaml"
PANELS = ("kpis", "routes", "limits", "jobs", "mcp", "local", "state", "spend", "breakers")


def chromium() -> str:
    """The system's Chromium, or a skip that says what is missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        found, why = None, "playwright is not installed (pip install playwright)"
    else:
        why = "no chromium on this machine (apt-get install chromium)"
    if found is None:
        print(f"SKIP browser test: {why}")
        pytest.skip(why)
    return found


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    """One Chromium for the module's tests; each page is its own context, closed by its test."""
    executable = chromium()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


async def close_pages(browser: Any) -> None:
    for context in browser.contexts:
        await context.close()


def fixed(value: float, digits: int) -> str:
    """``value`` as the page's ``Number.toFixed`` writes it: an exact tie (0.625 is one in binary)
    rounds up, where Python's format rounds it to even ("0.62")."""
    return str(Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def metric_total(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def shown(page: Any, expected: dict[str, str], timeout_ms: int = 15_000) -> None:
    """Wait until every ``data-v`` element named in ``expected`` shows that text; if it never
    does, fail naming each element that differs and what it showed."""
    from playwright.async_api import TimeoutError as PageTimeout

    try:
        await page.wait_for_function(
            """(want) => Object.entries(want).every(([k, v]) => {
                   const el = document.querySelector(`[data-v="${k}"]`);
                   return el && el.textContent === v; })""",
            arg=expected, timeout=timeout_ms)
    except PageTimeout:
        seen = await page.evaluate("""(keys) => Object.fromEntries(keys.map((k) => {
            const el = document.querySelector(`[data-v="${k}"]`);
            return [k, el ? el.textContent : null]; }))""", list(expected))
        differ = {k: {"expected": v, "shown": seen.get(k)} for k, v in expected.items() if seen.get(k) != v}
        raise AssertionError(f"after {timeout_ms} ms the page still shows {differ}") from None


async def test_the_dashboard_in_chromium(tmp_path: Path, monkeypatch: Any, browser: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)
    config = load_config(DEFAULT)
    config.server.admin_key = SecretStr(ADMIN)
    config.store.path = str(tmp_path / "multiplexer.db")  # the test's own keys, spend and jobs
    async with (
        running(config, host="127.0.0.1", port=0) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        try:
            page = await browser.new_page(viewport={"width": 1500, "height": 1100})
            # without a key: the login form, and the API refuses the page's own fetch
            await page.goto(url + "/ui")
            await page.wait_for_selector("#login:not([hidden])")
            refused = await page.evaluate("""async () => [
                (await fetch('/ui/api/state')).status, (await fetch('/ui/api/stream')).status]""")
            assert refused == [401, 401]
            await page.fill("#key", "not-the-admin-key-0123")
            await page.click("#login button")
            # a function, not an expression: the page's CSP refuses the eval Playwright polls those with
            await page.wait_for_function("() => document.querySelector('#login-error').textContent")
            assert "not the admin key" in (await page.text_content("#login-error") or "")
            # the form logs in
            await page.fill("#key", ADMIN)
            await page.click("#login button")
            await page.wait_for_selector("#main:not([hidden])")
            await page.wait_for_selector('[data-v="calls"]')
            before = int(await page.text_content('[data-v="calls"]') or "0")

            # calls: a JSON-RPC array to echo (batched), chat to the mock, a tool of the MCP child
            body = [{"jsonrpc": "2.0", "id": i, "method": "echo", "params": {"i": i}} for i in range(40)]
            assert len((await http.post("/rpc", json=body)).json()) == 40
            for i in range(5):
                r = await http.post("/v1/chat/completions", json={
                    "model": "mock-gpt", "messages": [{"role": "user", "content": f"hi {i}"}]})
                assert r.status_code == 200
            tool = {"jsonrpc": "2.0", "id": 1, "method": "tools_add", "params": {"a": 1, "b": 2}}
            await http.post("/rpc", json=tool)

            metrics = (await http.get("/metrics")).text
            state = (await http.get("/ui/api/state", headers={"authorization": f"Bearer {ADMIN}"})).json()
            panels = state["panels"]
            calls = int(metric_total(metrics, "multiplexer_calls_total"))
            assert calls == panels["routes"]["totals"]["calls"] >= before + 46
            lane = next(x for x in panels["routes"]["lanes"] if x["lane"] == "builtin")
            echo = next(x for x in panels["routes"]["routes"] if x["route"] == "echo")
            expected = {
                "calls": str(calls),
                "upstream_requests": str(int(metric_total(metrics, "multiplexer_upstream_requests_total"))),
                "route.echo.ok": str(int(metric_total(metrics, "multiplexer_calls_total", route="echo",
                                                      outcome="ok"))),
                "lane.builtin.batches": str(int(metric_total(metrics, "multiplexer_batch_size_count",
                                                             provider="builtin"))),
                "lane.builtin.items": str(lane["items"]),
                "route.echo.p50_ms": fixed(echo["latency"]["p50_ms"], 2),
                "provider.builtin.upstream_requests": str(int(metric_total(
                    metrics, "multiplexer_upstream_requests_total", provider="builtin"))),
                "mcp.tools.tools": str(panels["mcp"]["upstreams"][0]["tools"]),
            }
            # the share of each route's input its provider read from a prompt cache (the mock: none)
            chat_spend = next(r for r in panels["spend"]["routes"] if r["route"] == "chat")
            share = chat_spend["cache_read_share"]
            expected["spend.chat.cache_read"] = "-" if share is None else f"{100 * share:.1f}%"
            assert expected["route.echo.ok"] == str(echo["ok"]) == "40"
            assert int(expected["lane.builtin.batches"]) < 40  # forty calls, fewer upstream batches
            await shown(page, expected)
            assert int(await page.text_content('[data-v="calls"]') or "0") > before

            shots = tmp_path / "screenshots"
            shots.mkdir()
            for name in PANELS:
                element = page.locator(f'[data-panel="{name}"]')
                await element.screenshot(path=str(shots / f"{name}.png"))
                assert (shots / f"{name}.png").stat().st_size > 1000, name
            await page.screenshot(path=str(shots / "page.png"), full_page=True)
            assert "calls of unknown cost" in (await page.text_content("#panel-spend") or "")
            assert "no fallbacks" in (await page.text_content("#panel-breakers") or "")
            print(f"screenshots in {shots}")

            # a link with the key in its fragment logs in too; the fragment leaves the address bar
            await page.evaluate("sessionStorage.clear()")
            link = await browser.new_page()
            await link.goto(url + "/ui#key=" + ADMIN)
            await link.wait_for_selector("#main:not([hidden])")
            await link.wait_for_selector('[data-v="calls"]')
            assert "#" not in link.url and ADMIN not in link.url
            stored = await link.evaluate("sessionStorage.getItem('multiplexer.key')")
            assert stored == ADMIN
            await link.close()
            await page.close()
        finally:
            await close_pages(browser)
    assert json.dumps(state)  # the snapshot the page was compared with is plain JSON


async def test_jobs_progress_and_a_callers_own_view(tmp_path: Path, monkeypatch: Any, browser: Any) -> None:
    """An open batch job on the fake OpenAI upstream: the admin sees it with its progress bar and
    the store's totals; its owner's key sees its own jobs and spend panels only, the spend as its
    JSON has it; another key sees no job and no spend."""
    monkeypatch.delenv(ENV, raising=False)
    async with fakes() as f:
        data = v1_config(f, tmp_path, admin_key=ADMIN)
        data["server"]["api_keys"]["bob"] = "bob-key-0123456789abcdef"
        data["routes"]["chat_batch"] = {"provider": "oai", "operation": "chat", "mode": "batch"}
        data["providers"]["oai"]["price"] = {"input_per_mtok": 1000, "output_per_mtok": 2000}
        data["server"]["api_keys"]["alice"] = {"key": KEY, "budget_usd": {"daily": "1"}}
        async with (
            running(parse_config(data), port=0) as (_, url),
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            submit = {"jsonrpc": "2.0", "id": 1, "method": "jobs.submit", "params": {
                "more": True, "calls": [{"method": "chat_batch", "params": {  # reserved at submit:
                    "model": "gpt-4o-mini", "max_tokens": 10,  # 4 x 10 tokens fit the $1 budget
                    "messages": [{"role": "user", "content": "hi"}]}}] * 4}}
            job = (await http.post("/rpc", json=submit, headers={"authorization": f"Bearer {KEY}"})).json()
            job_id = job["result"]["job_id"]
            as_alice = {"authorization": f"Bearer {KEY}"}
            for i in range(2):  # priced calls of alice's own
                r = await http.post("/v1/chat/completions", headers=as_alice, json={
                    "model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"hi {i}"}]})
                assert float(r.headers["x-multiplexer-cost-usd"]) > 0
            mine = (await http.get("/ui/api/state", headers=as_alice)).json()["panels"]["spend"]
            assert mine["today"]["calls"] == 2 and mine["today"]["cost_usd"] > 0
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 900})
                await page.goto(f"{url}/ui#key={ADMIN}")
                await shown(page, {"jobs.open": "1"})
                row = page.locator("#panel-jobs tr", has_text=job_id)
                assert await row.locator(".bar").count() == 1  # its progress bar
                assert "client" in (await row.text_content() or "")
                await page.locator('[data-panel="jobs"]').screenshot(path=str(tmp_path / "jobs-admin.png"))

                own = await browser.new_page(viewport={"width": 1400, "height": 900})
                await own.goto(f"{url}/ui#key={KEY}")
                await own.wait_for_selector(f"#panel-jobs tr:has-text('{job_id}')")
                assert "key alice" in (await own.text_content("#who") or "")
                for hidden in ("routes", "limits", "mcp", "local", "state", "breakers"):
                    assert not await own.locator(f"#panel-{hidden}").is_visible(), hidden
                await shown(own, {"spend.own.today.cost": "$" + fixed(mine["today"]["cost_usd"], 6),
                                  "spend.own.month.cost": "$" + fixed(mine["this_month"]["cost_usd"], 6),
                                  "spend.own.today.calls": "2",
                                  "spend.own.budget.daily": "$" + fixed(mine["budgets"][0]["spent_usd"], 6)})
                assert "chat" in (await own.text_content("#panel-spend") or "")
                await own.locator('[data-panel="jobs"]').screenshot(path=str(tmp_path / "jobs-own.png"))
                await own.locator('[data-panel="spend"]').screenshot(path=str(tmp_path / "spend-own.png"))

                other = await browser.new_page()
                await other.goto(f"{url}/ui#key=bob-key-0123456789abcdef")
                await other.wait_for_selector("#panel-jobs .empty")
                assert job_id not in (await other.text_content("#panel-jobs") or "")
                await shown(other, {"spend.own.today.cost": "$0.000000", "spend.own.today.calls": "0"})
            finally:
                await close_pages(browser)
