"""The dashboard under its Content-Security-Policy, in Chromium (skips, saying why, without it or
Playwright, as tests/test_ui_browser.py does): the page reports no violation, and its bars, whose
widths the policy would refuse as style attributes, are drawn."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from multiplexer.access.admin import ENV
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.test_ui_browser import chromium

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "c" * 28
POLICY = "default-src 'self'; script-src 'self'; frame-ancestors 'none'"
WATCH = """window.violations = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.violations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample}`));"""


async def test_the_page_runs_under_its_policy_and_draws_its_bars(monkeypatch: Any) -> None:
    executable = chromium()
    from playwright.async_api import async_playwright

    monkeypatch.delenv(ENV, raising=False)
    config = parse_config({
        "server": {"admin_key": ADMIN},
        "providers": {"e": {"kind": "echo", "limits": {"rpm": 600, "concurrency": 4}}},
        "routes": {"echo": {"provider": "e"}}})
    async with (
        running(config, host="127.0.0.1", port=0) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        async_playwright() as pw,
    ):
        page_reply = await http.get("/ui")
        assert page_reply.headers["content-security-policy"] == POLICY
        browser = await pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1500, "height": 1100})
            console: list[str] = []
            page.on("console", lambda m: console.append(m.text))
            await page.add_init_script(WATCH)
            await page.goto(url + "/ui")
            await page.fill("#key", ADMIN)
            await page.click("#login button")
            await page.wait_for_selector("#main:not([hidden])")
            for i in range(30):
                await http.post("/rpc", json={"jsonrpc": "2.0", "id": i, "method": "echo", "params": {}})
            # the rpm bar of the echo provider: its width set through the DOM, not an attribute
            await page.wait_for_function(
                """() => [...document.querySelectorAll("#panel-limits .bar i")]
                          .some((i) => i.style.width !== "" && i.style.width !== "0%")""",
                timeout=15_000)
            halves = await page.evaluate(
                """() => getComputedStyle(document.querySelector("#panel-routes .charts"))
                          .gridTemplateColumns.split(" ").length""")
            assert halves == 2  # the routes panel's two columns come from the stylesheet
            assert await page.evaluate("window.violations") == []
            assert not [m for m in console if "Content Security Policy" in m], console
        finally:
            await browser.close()
