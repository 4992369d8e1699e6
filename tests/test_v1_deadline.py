"""A ``/v1`` caller's deadline: ``x-multiplexer-deadline`` (seconds or an RFC 3339 time),
``_meta.timeout_ms`` or ``service_tier: "flex"`` lets a ``mode: auto`` route take the call to
its provider's batch API; without one it goes now. Bad values are a 400 naming the header."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from multiplexer.faces.v1.common import HttpError
from multiplexer.faces.v1.deadline import header_ms
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.remote_helpers import Fakes, fakes

pytestmark = pytest.mark.anyio
KEY = "sk-gateway-test"
HEADER = "x-multiplexer-deadline"
USER = [{"role": "user", "content": "hello there"}]
PATIENT = {"model": "gpt-4o-mini", "messages": USER}  # the auto route's model
LIVE_PATH, BATCHES = "/v1/chat/completions", "/v1/batches"


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[Fakes, httpx.AsyncClient]]:
    async with fakes() as f:
        f.openai.strict_keys = f.anthropic.strict_keys = True
        data = {
            "server": {"api_keys": {"alice": KEY}},
            "store": {"path": str(tmp_path / "jobs.db")},
            "providers": {"oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "sk-up",
                                  "batch_poll_interval_s": 0.01, "retry": {"attempts": 1}},
                          "claude": {"kind": "anthropic", "base_url": f.anthropic_url, "api_key": "up"}},
            "routes": {"auto": {"provider": "oai", "operation": "chat", "mode": "auto",
                                "models": ["gpt-4o-mini"]},
                       "chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o"]},
                       "claude": {"provider": "claude", "operation": "messages",
                                  "models": ["claude-sonnet-4-5"]}},
        }
        async with running(parse_config(data), port=0) as (_, url), \
                httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                                  timeout=30) as client:
            yield f, client


def answered(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def sent(f: Fakes) -> tuple[int, int]:
    """(batches created upstream, live chat requests upstream)."""
    return f.openai.requests[BATCHES], f.openai.requests[LIVE_PATH]


async def test_a_deadline_header_sends_a_call_on_an_auto_route_to_the_batch_api(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (f, client):
        assert answered(await client.post(LIVE_PATH, json=PATIENT)) == "echo: hello there"
        assert sent(f) == (0, 1)  # no deadline: now
        r = await client.post(LIVE_PATH, json=PATIENT, headers={HEADER: "90000"})  # 25 hours
        assert answered(r) == "echo: hello there"
        assert sent(f) == (1, 1)
        assert r.headers["x-multiplexer-route"] == "auto"
        later = (datetime.now(UTC) + timedelta(hours=25)).isoformat().replace("+00:00", "Z")
        assert answered(await client.post(LIVE_PATH, json=PATIENT, headers={HEADER: later})) == \
            "echo: hello there"
        assert sent(f) == (2, 1)
        assert answered(await client.post(LIVE_PATH, json=PATIENT, headers={HEADER: "30"})) == \
            "echo: hello there"
        assert sent(f) == (2, 2)  # thirty seconds is too short for a 24h window: now


async def test_meta_timeout_ms_is_read_and_never_sent(tmp_path: Path) -> None:
    """The JSON-RPC way to say it works on ``/v1`` too; the strict upstream never sees it."""
    async with gateway(tmp_path) as (f, client):
        body = {**PATIENT, "_meta": {"timeout_ms": 90_000_000}}
        assert answered(await client.post(LIVE_PATH, json=body)) == "echo: hello there"
        assert sent(f) == (1, 0)
        [job] = f.openai.batches.values()
        assert [item["body"] for item in job.items] == [PATIENT]
        for meta, param in (([1], "_meta"), ({"timeout_ms": -1}, "_meta.timeout_ms"),
                            ({"timeout_ms": True}, "_meta.timeout_ms")):
            r = await client.post(LIVE_PATH, json={**PATIENT, "_meta": meta})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_flex_is_a_long_deadline_on_an_auto_route_and_passes_through_elsewhere(
        tmp_path: Path) -> None:
    async with gateway(tmp_path) as (f, client):
        r = await client.post(LIVE_PATH, json={**PATIENT, "service_tier": "flex"})
        assert answered(r) == "echo: hello there"
        assert sent(f) == (1, 0)
        [job] = f.openai.batches.values()
        assert [item["body"] for item in job.items] == [PATIENT]  # the gateway's to read, not sent
        r = await client.post(LIVE_PATH, json={**PATIENT, "service_tier": "priority"})
        assert answered(r) == "echo: hello there" and sent(f) == (1, 1)
        assert f.openai.bodies[LIVE_PATH][-1]["service_tier"] == "priority"
        r = await client.post(LIVE_PATH, json={"model": "gpt-4o", "messages": USER, "service_tier": "flex"})
        assert answered(r) == "echo: hello there" and sent(f) == (1, 2)  # a sync route: as sent
        assert f.openai.bodies[LIVE_PATH][-1]["service_tier"] == "flex"


async def test_a_stream_on_an_auto_route_goes_now_whatever_its_deadline(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (f, client):
        r = await client.post(LIVE_PATH, json={**PATIENT, "stream": True}, headers={HEADER: "90000"})
        assert r.status_code == 200 and "echo" in r.text and "data: [DONE]" in r.text, r.text
        assert sent(f) == (0, 1)


BAD = ["soon", "0", "-5", "nan", "inf", "1e400", "", "2020-01-01T00:00:00Z", "2030-01-01T00:00:00",
       "2030-13-01T00:00:00Z"]


@pytest.mark.parametrize("value", BAD)
async def test_a_bad_deadline_header_is_a_400_naming_it(tmp_path: Path, value: str) -> None:
    async with gateway(tmp_path) as (f, client):
        r = await client.post(LIVE_PATH, json=PATIENT, headers={HEADER: value})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == HEADER and HEADER in error["message"], error
        r = await client.post("/v1/messages", headers={HEADER: value}, json={
            "model": "claude-sonnet-4-5", "max_tokens": 16, "messages": USER})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert HEADER in r.json()["error"]["message"]
        assert sent(f) == (0, 0) and f.anthropic.requests["/v1/messages"] == 0


def test_header_values_by_hand() -> None:
    now = datetime(2026, 12, 6, 12, 0, tzinfo=UTC).timestamp()
    assert header_ms(b"90000") == 90_000_000.0
    assert header_ms(b" 1.5 ") == 1500.0
    assert header_ms(b"2026-12-07T13:00:00Z", lambda: now) == 25 * 3_600_000.0
    assert header_ms(b"2026-12-06T14:30:00+02:00", lambda: now) == 30 * 60_000.0
    for past in (b"2026-12-06T11:59:59Z", b"2026-12-06T13:00:00+01:00"):  # a second ago, now
        with pytest.raises(HttpError) as bad:
            header_ms(past, lambda: now)
        assert bad.value.status == 400 and bad.value.param == HEADER
