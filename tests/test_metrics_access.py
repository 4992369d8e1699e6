"""``GET /metrics`` asks for a key once callers need one (a caller's or the admin's), unless
``server.metrics_public`` says the scrape is open; a keyless gateway keeps it open on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.access.admin import ENV
from multiplexer.gateway.config import parse_config
from multiplexer.server import running

pytestmark = pytest.mark.anyio
ADMIN = "adm-metrics-" + "m" * 24
CALLER = "caller-metrics-key-0123"


@pytest.fixture(autouse=True)
def _admin_key_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)  # the environment's would win over the config's


@asynccontextmanager
async def gateway(tmp_path: Path, host: str = "127.0.0.1", **server: Any,
                  ) -> AsyncIterator[httpx.AsyncClient]:
    config = parse_config({"server": {"port": 0, **server}, "store": {"path": str(tmp_path / "jobs.db")},
                           "providers": {"e": {"kind": "echo"}}, "routes": {"echo": {"provider": "e"}}})
    async with running(config, host=host) as (_, url), httpx.AsyncClient(base_url=url) as http:
        yield http


async def scrape(http: httpx.AsyncClient, key: str | None = None) -> httpx.Response:
    return await http.get("/metrics", headers={"authorization": f"Bearer {key}"} if key else {})


def refused(r: httpx.Response) -> None:
    """The HTTP face's 401: a JSON-RPC error body and a bearer challenge, no metrics."""
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == -32005 and r.json()["id"] is None
    assert r.headers["www-authenticate"] == 'Bearer realm="multiplexer"'
    assert "multiplexer_" not in r.text


def scraped(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    assert "multiplexer_http_requests_total" in r.text


async def test_with_caller_keys_a_scrape_needs_a_caller_key_or_the_admin_key(tmp_path: Path) -> None:
    async with gateway(tmp_path, api_keys={"ci": CALLER}, admin_key=ADMIN) as http:
        refused(await scrape(http))
        refused(await scrape(http, "not-a-key"))
        scraped(await scrape(http, CALLER))
        scraped(await scrape(http, ADMIN))


async def test_metrics_public_opens_the_scrape_of_a_keyed_gateway(tmp_path: Path) -> None:
    async with gateway(tmp_path, api_keys={"ci": CALLER}, metrics_public=True) as http:
        scraped(await scrape(http))


async def test_a_keyless_gateway_on_loopback_keeps_the_scrape_open(tmp_path: Path) -> None:
    async with gateway(tmp_path) as http:
        scraped(await scrape(http))
    async with gateway(tmp_path, admin_key=ADMIN) as http:  # no caller key issued yet
        scraped(await scrape(http))


async def test_once_the_store_issues_a_key_the_scrape_needs_one(tmp_path: Path) -> None:
    async with gateway(tmp_path, admin_key=ADMIN) as http:
        made = await http.post("/admin/keys", json={"name": "ci"},
                               headers={"authorization": f"Bearer {ADMIN}"})
        assert made.status_code == 201, made.text
        refused(await scrape(http))
        scraped(await scrape(http, made.json()["key"]))


async def test_a_public_keyless_gateway_scrapes_with_the_admin_key_or_metrics_public(
        tmp_path: Path) -> None:
    async with gateway(tmp_path, "0.0.0.0", allow_public_without_keys=True, admin_key=ADMIN) as http:
        refused(await scrape(http))
        scraped(await scrape(http, ADMIN))
    async with gateway(tmp_path, "0.0.0.0", allow_public_without_keys=True, metrics_public=True) as http:
        scraped(await scrape(http))


async def test_a_caller_keys_scrape_is_one_request_of_its_key(tmp_path: Path) -> None:
    async with gateway(tmp_path, api_keys={"ci": CALLER}, quotas={"ci": {"rpm": 1}},
                       admin_key=ADMIN) as http:
        scraped(await scrape(http, CALLER))
        again = await scrape(http, CALLER)
        scraped(await scrape(http, ADMIN))  # the admin's scrape is no caller's request
    assert again.status_code == 429 and again.json()["error"]["code"] == -32003
    assert again.json()["error"]["data"]["limit"] == "rpm"
    assert int(again.headers["retry-after"]) >= 1
