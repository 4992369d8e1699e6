"""``server.keepalive_s``: pooled clients whose idle timeout is the server's, or shorter, lose no
request at the boundary (a server that closes first, as the client reuses, loses one)."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.server import running

pytestmark = pytest.mark.anyio
KEEPALIVE_S = 0.5
CONNECTIONS = 4  # per client: each wave opens (or reuses) this many pooled connections


def test_the_default_outlasts_common_60_s_idle_timeouts() -> None:
    assert parse_config({}).server.keepalive_s == 75.0


async def wave(http: httpx.AsyncClient, url: str, wave_no: int) -> list[Any]:
    out: list[Any] = [None] * CONNECTIONS

    async def one(i: int) -> None:
        body = {"jsonrpc": "2.0", "method": "echo", "params": {"w": wave_no, "i": i}, "id": i}
        out[i] = (await http.post(f"{url}/rpc", json=body)).json()

    async with anyio.create_task_group() as tg:
        for i in range(CONNECTIONS):
            tg.start_soon(one, i)
    return out


@pytest.mark.parametrize("client_expiry", [KEEPALIVE_S - 0.1, KEEPALIVE_S])
async def test_requests_right_at_the_keepalive_boundary_are_all_answered(client_expiry: float) -> None:
    config = parse_config({"server": {"port": 0, "keepalive_s": KEEPALIVE_S},
                           "providers": {"p": {"kind": "echo"}}, "routes": {"echo": {"provider": "p"}}})
    # each client idles to a point around its own expiry (and the server's keep-alive), then fires
    offsets = [-0.02, -0.005, 0.0, 0.002, 0.005, 0.01, 0.02]
    async with running(config) as (_, url):
        answers: dict[float, list[Any]] = {}

        async def client(offset: float) -> None:
            limits = httpx.Limits(max_connections=CONNECTIONS, keepalive_expiry=client_expiry)
            async with httpx.AsyncClient(limits=limits) as http:
                await wave(http, url, 0)
                await anyio.sleep(client_expiry + offset)
                answers[offset] = await wave(http, url, 1) + await wave(http, url, 2)

        async with anyio.create_task_group() as tg:
            for offset in offsets:
                tg.start_soon(client, offset)
    for offset in offsets:
        got = answers[offset]
        assert [a["result"] for a in got] == [{"w": w, "i": i} for w in (1, 2) for i in range(CONNECTIONS)]
