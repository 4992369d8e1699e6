"""docs/dashboard.png: the dashboard on the default config with traffic, in the system's Chromium.

    python3 docs/dashboard_screenshot.py docs/dashboard.png

Needs Playwright and Chromium (as tests/test_ui_browser.py); Pillow, if installed, keeps the PNG
small by reducing it to 64 colours."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
from pydantic import SecretStr

from multiplexer.gateway.config import load_config
from multiplexer.server import running

ADMIN = "adm-" + "s" * 28
DEFAULT = Path(__file__).parents[1] / "multiplexer" / "defaults" / "default.yaml"


def requests(i: int) -> list[tuple[str, Any]]:
    """One round of traffic: an array of echo calls, chat, embeddings, a tool, now and then a bad call."""
    out: list[tuple[str, Any]] = [
        ("/rpc", [{"jsonrpc": "2.0", "id": k, "method": "echo", "params": {"k": k}} for k in range(30)]),
        ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": [f"text {i} {k}" for k in range(8)]}),
        ("/rpc", {"jsonrpc": "2.0", "id": 1, "method": "tools_add", "params": {"a": i, "b": 2}}),
    ]
    out += [("/v1/chat/completions", {"model": "mock-gpt", "messages": [
        {"role": "user", "content": f"hello {i} {k}"}]}) for k in range(4)]
    if i % 7 == 0:
        out.append(("/rpc", {"jsonrpc": "2.0", "id": 1, "method": "sum", "params": {"values": "x"}}))
    return out


async def traffic(url: str, stop: anyio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        i = 0
        while not stop.is_set():
            i += 1
            async with anyio.create_task_group() as tg:
                for path, body in requests(i):
                    tg.start_soon(post, http, path, body)
            await anyio.sleep(0.05)


async def post(http: httpx.AsyncClient, path: str, body: Any) -> None:
    await http.post(path, json=body)


async def main(out: str) -> None:
    from playwright.async_api import async_playwright

    config = load_config(DEFAULT)
    config.server.admin_key = SecretStr(ADMIN)
    async with running(config, host="127.0.0.1", port=0) as (_, url), async_playwright() as pw:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for _ in range(100):  # the local model loaded
                if (await http.get("/readyz")).status_code == 200:
                    break
                await anyio.sleep(0.5)
        stop = anyio.Event()
        chromium = shutil.which("chromium") or "chromium"
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1360, "height": 960})
        await page.goto(url + "/ui")  # the login form: the key never goes in a URL
        await page.fill("#key", ADMIN)
        await page.click("#login button")
        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic, url, stop)
            await anyio.sleep(25)
            await page.screenshot(path=out, full_page=True)
            stop.set()
        await browser.close()
    try:
        from PIL import Image
    except ImportError:
        return
    image = Image.open(out).convert("RGB")
    small = image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(out, optimize=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
