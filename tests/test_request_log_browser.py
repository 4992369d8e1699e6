"""The request log's page in the system's Chromium (skips, saying why, without it or Playwright):
the admin key lists every call, the filters narrow it, a call's path is drawn as a timeline, and
a caller's key sees its own calls only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.access.admin import ENV
from tests.test_request_log import ADMIN, ALICE, BOB, gateway_config, rpc
from tests.test_ui_browser import browser  # noqa: F401  (the module's one Chromium)

pytestmark = pytest.mark.anyio


async def test_the_request_log_page_in_chromium(tmp_path: Path, monkeypatch: Any,
                                                browser: Any) -> None:  # noqa: F811
    from multiplexer.server import running

    monkeypatch.delenv(ENV, raising=False)
    async with running(gateway_config(tmp_path), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url) as http:
        await rpc(http, ALICE, "echo", {"x": 1})
        await rpc(http, ALICE, "nope", {})
        await rpc(http, BOB, "echo", {"y": 2})
        context = await browser.new_context(viewport={"width": 1300, "height": 900})
        try:
            page = await context.new_page()
            await page.goto(f"{url}/ui/requests#key={ADMIN}")
            await page.wait_for_function("() => document.querySelector('#main').dataset.loaded === '3'")
            await page.select_option("select[name=status]", "error")
            await page.click("#search")
            await page.wait_for_function("() => document.querySelector('#main').dataset.loaded === '1'")
            assert await page.text_content("#rows tbody [data-status]") == "-32601"
            await page.click("#rows tbody tr")
            await page.wait_for_selector('#timeline [data-event="failed"]')
            assert await page.text_content('[data-field="asked"]') == "nope (model \u2013)"
            await page.screenshot(path=str(tmp_path / "requests.png"))

            mine = await context.new_page()  # a caller's key: its own calls, whatever it filters on
            await mine.goto(f"{url}/ui/requests#key={BOB}")
            await mine.wait_for_function("() => document.querySelector('#main').dataset.loaded === '1'")
            await mine.click("#rows tbody tr")
            await mine.wait_for_selector('#timeline [data-event="answered"]')
            assert await mine.text_content('[data-field="key"]') == "bob"
        finally:
            await context.close()
