"""One access line per HTTP request (``multiplexer.access``), on the direct and the ASGI path."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from multiplexer.faces.access import ACCESS, JsonLines
from tests.jsonrpc_helpers import gateway_with_upstream

pytestmark = pytest.mark.anyio
KEYS = {"api_keys": {"alice": "sk-alice-secret"}}
AUTH = {"authorization": "Bearer sk-alice-secret"}
RPC = {"jsonrpc": "2.0", "method": "subtract", "params": [5, 2], "id": 1}


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS]


async def chunked(body: bytes) -> AsyncIterator[bytes]:
    """A body of no declared length: the gateway's server leaves such a request to ASGI."""
    yield body


async def test_direct_rpc_lines_say_method_key_status_and_echo_the_clients_request_id(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    async with gateway_with_upstream(server=KEYS) as (url, _, _), httpx.AsyncClient() as http:
        ok = await http.post(f"{url}/rpc", json=RPC, headers={**AUTH, "x-request-id": "trace-7f3a"})
        missing = await http.post(f"{url}/rpc", headers=AUTH, json={**RPC, "method": "no_such"})
        denied = await http.post(f"{url}/rpc", json=RPC, headers={"authorization": "Bearer wrong"})
        array = await http.post(f"{url}/rpc", headers=AUTH, json=[RPC, {**RPC, "id": 2}, {**RPC, "id": 3}])
    assert ok.json()["result"] == 3 and ok.headers["x-request-id"] == "trace-7f3a"
    generated = missing.headers["x-request-id"]
    assert generated.startswith("req_") and generated != denied.headers["x-request-id"]
    assert array.status_code == 200
    messages = [r.getMessage() for r in lines(caplog)]
    assert len(messages) == 4
    first, second, third, fourth = messages
    assert first.startswith("POST /rpc 200 ") and first.endswith(
        "ms route=subtract key=alice rid=trace-7f3a")
    assert second.startswith("POST /rpc 200 ") and second.endswith(
        f"ms route=no_such key=alice code=-32601 rid={generated}")
    assert third.startswith("POST /rpc 401 ") and " key=- code=-32005 " in third
    assert " route=subtract key=alice calls=3 rid=" in fourth
    assert all("sk-alice-secret" not in m for m in messages)  # the key's name, never the key
    assert all(r.levelno == logging.INFO for r in lines(caplog))


async def test_asgi_requests_get_the_same_lines_and_ids(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    async with gateway_with_upstream(server=KEYS) as (url, _, _), httpx.AsyncClient() as http:
        health = await http.get(f"{url}/healthz")
        body = json.dumps({**RPC, "method": "no_such"}).encode()
        rpc = await http.post(f"{url}/rpc", content=chunked(body),
                              headers={**AUTH, "x-request-id": "has spaces"})
        lost = await http.get(f"{url}/nope")
    assert health.status_code == 200 and health.headers["x-request-id"].startswith("req_")
    assert rpc.json()["error"]["code"] == -32601
    assert rpc.headers["x-request-id"].startswith("req_")  # not a plain token: a new id instead
    assert lost.status_code == 404
    messages = [r.getMessage() for r in lines(caplog)]
    assert messages[0].startswith("GET /healthz 200 ")
    assert messages[0].endswith(f"route=- key=- rid={health.headers['x-request-id']}")
    assert messages[1].startswith("POST /rpc 200 ")
    assert messages[1].endswith(f"route=no_such key=alice code=-32601 rid={rpc.headers['x-request-id']}")
    assert messages[2].startswith("GET /nope 404 ")


async def test_v1_lines_name_the_route_and_send_one_request_id(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    routes = {"emb": {"provider": "calc", "operation": "embeddings", "models": ["calc-embed"]}}
    async with gateway_with_upstream(server=KEYS, routes=routes) as (url, _, _), \
            httpx.AsyncClient() as http:
        missing = await http.post(f"{url}/v1/embeddings", headers=AUTH,
                                  json={"model": "nope", "input": "x"})
    assert missing.status_code == 404
    assert len(missing.headers.get_list("x-request-id")) == 1
    message = lines(caplog)[0].getMessage()
    assert message.startswith("POST /v1/embeddings 404 ") and " key=alice code=-32009 " in message


async def test_json_lines_and_the_switch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    server: dict[str, Any] = {**KEYS, "log_format": "json"}
    async with gateway_with_upstream(server=server) as (url, _, gw), httpx.AsyncClient() as http:
        await http.post(f"{url}/rpc", json=RPC, headers={**AUTH, "x-request-id": "r-1"})
    record = lines(caplog)[0]
    fields = json.loads(record.getMessage())
    assert fields.pop("ms") >= 0
    assert fields == {"method": "POST", "path": "/rpc", "route": "subtract", "key": "alice",
                      "status": 200, "code": None, "calls": None, "request_id": "r-1"}
    formatted = json.loads(JsonLines().format(record))
    assert formatted["level"] == "INFO" and formatted["logger"] == ACCESS
    assert formatted["request_id"] == "r-1" and "msg" not in formatted
    caplog.clear()
    async with gateway_with_upstream(server={"access_log": False}) as (url, _, gw), \
            httpx.AsyncClient() as http:
        assert (await http.post(f"{url}/rpc", json=RPC)).headers["x-request-id"]
        counted = gw.metrics.http_requests.value("/rpc", "200")
    assert lines(caplog) == [] and counted == 1
