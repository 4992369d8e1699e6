"""``/metrics``: call latency and in-flight calls per route, HTTP requests by route and status."""

from __future__ import annotations

import anyio
import httpx
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.faces import http as http_face
from multiplexer.gateway.gateway import Gateway
from tests.jsonrpc_helpers import gateway_with_upstream
from tests.test_access_log import RPC, chunked
from tests.test_gateway import Gate
from tests.test_limit_stage import config

pytestmark = pytest.mark.anyio


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from the exposition text (labels in any order), None when absent."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, _, value = line.rpartition(" ")
            inside = series[len(name):].strip("{}")
            if set(filter(None, inside.split(","))) == want:
                return float(value)
    return None


async def test_in_flight_calls_and_their_latency_per_route() -> None:
    clock, prov = ManualClock(), Gate()
    async with Gateway(config({}), clock=clock, providers={"p": prov}) as gw:
        out: list[Outcome] = []

        async def call(method: str) -> None:
            out.append(await gw.submit(Call(method, {}, timeout_ms=10_000)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "r")
            tg.start_soon(call, "r")
            await clock.advance(0)
            during = gw.metrics.render().decode()
            await clock.advance(0.3)
            prov.gate.set()
        await gw.submit(Call("no.such.method", {}))
        after = gw.metrics.render().decode()
    assert [o.ok for o in out] == [True, True]
    assert sample(during, "multiplexer_calls_in_flight", route="r") == 2
    assert sample(after, "multiplexer_calls_in_flight", route="r") == 0
    seconds = "multiplexer_call_duration_seconds"
    assert sample(after, seconds + "_bucket", route="r", le="0.25") == 0
    assert sample(after, seconds + "_bucket", route="r", le="0.5") == 2
    assert sample(after, seconds + "_count", route="r") == 2
    assert sample(after, seconds + "_sum", route="r") == pytest.approx(0.6)
    # an unknown method is the one route "(no route)", never its own label
    assert sample(after, "multiplexer_calls_total", route="(no route)", outcome="-32601") == 1
    assert "no.such.method" not in after


async def test_http_requests_by_route_template_and_status_a_500_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("a bug in the face")

    async with gateway_with_upstream() as (url, _, _), httpx.AsyncClient() as http:
        assert (await http.post(f"{url}/rpc", json=RPC)).status_code == 200
        await http.get(f"{url}/v1/files/file-abc")
        await http.get(f"{url}/no/such/path")
        monkeypatch.setattr(http_face, "handle_body", broken)
        direct = await http.post(f"{url}/rpc", json=RPC)
        asgi = await http.post(f"{url}/rpc", content=chunked(b"{}"))
        monkeypatch.undo()
        text = (await http.get(f"{url}/metrics")).text
    assert direct.status_code == 500 and asgi.status_code == 500
    requests = "multiplexer_http_requests_total"
    assert sample(text, requests, route="/rpc", status="200") == 1
    assert sample(text, requests, route="/rpc", status="500") == 2
    assert sample(text, requests, route="/v1/files/{file_id}", status="404") == 1
    assert sample(text, requests, route="other", status="404") == 1
    assert sample(text, "multiplexer_calls_total", route="subtract", outcome="ok") == 1
    assert sample(text, "multiplexer_call_duration_seconds_count", route="subtract") == 1
    assert "/no/such/path" not in text and "file-abc" not in text
