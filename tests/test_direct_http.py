"""The gateway's server calls the hot endpoints directly: a whole body in, one write out;
every request it cannot take that way goes through ASGI, and both keep HTTP's rules."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from multiplexer.faces.auth import Authenticator
from multiplexer.faces.http import create_app
from multiplexer.faces.reply import Reply
from multiplexer.faces.server_protocol import GatewayHttpProtocol
from multiplexer.faces.v1 import v1_routes
from tests.jsonrpc_helpers import gateway_with_upstream
from tests.test_joined_writes import Wire

pytestmark = pytest.mark.anyio


class Echo:
    """A direct endpoint that echoes the body; its ASGI app records that it ran instead."""

    limit = 64

    def __init__(self) -> None:
        self.direct_bodies: list[bytes] = []
        self.asgi_calls = 0
        self.gate: anyio.Event | None = None  # set: the direct call waits for it
        self.cancelled = False
        self.fail = False
        self.hand_back = False  # set: direct hands every request back to the ASGI app
        self.asgi_scopes: list[dict[str, Any]] = []

    async def direct(self, scope: dict[str, Any], body: bytes) -> Reply | None:
        self.direct_bodies.append(body)
        if self.hand_back:
            return None
        if self.fail:
            raise ValueError("broken endpoint")
        if self.gate is not None:
            try:
                await self.gate.wait()
            except BaseException:
                self.cancelled = True
                raise
        return Reply(200, b"echo:" + body, [(b"content-type", b"text/plain")])

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.asgi_calls += 1
        self.asgi_scopes.append(scope)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body) + 5).encode())]})
        await send({"type": "http.response.body", "body": b"asgi:" + body})


class App:
    """The outer app as ``create_app`` builds it: ``direct`` and ``max_header_bytes`` for the server."""

    def __init__(self, endpoint: Echo) -> None:
        self.direct = {("POST", "/x"): endpoint}
        self.max_header_bytes = 512
        self.endpoint = endpoint

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.endpoint(scope, receive, send)


def connect(endpoint: Echo) -> tuple[GatewayHttpProtocol, Wire]:
    config = uvicorn.Config(App(endpoint), lifespan="off", proxy_headers=False)
    config.load()
    protocol = GatewayHttpProtocol(config=config, server_state=ServerState(), app_state={})
    wire = Wire()
    protocol.connection_made(wire)  # type: ignore[arg-type]
    return protocol, wire


async def turns(n: int = 10) -> None:
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


def post(body: bytes, *headers: bytes) -> bytes:
    head = b"".join(h + b"\r\n" for h in headers)
    return b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), head, body)


def parse(sent: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The responses in what was written, in order."""
    out = []
    while sent:
        head, _, rest = sent.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        size = int(headers.get(b"content-length", b"0"))
        out.append((int(lines[0].split()[1]), headers, rest[:size]))
        sent = rest[size:]
    return out


async def test_a_whole_body_is_answered_directly_in_one_write() -> None:
    endpoint = Echo()
    _, wire = connect(endpoint)
    _.data_received(post(b"hello"))
    await turns()
    assert endpoint.direct_bodies == [b"hello"] and endpoint.asgi_calls == 0
    assert len(wire.sent) == 1 and not wire.closed
    [(status, headers, body)] = parse(wire.sent[0])
    assert (status, body) == (200, b"echo:hello")
    assert headers[b"content-length"] == b"10" and headers[b"content-type"] == b"text/plain"


async def test_a_request_the_endpoint_hands_back_is_answered_by_its_asgi_app_with_its_body() -> None:
    """``direct`` returning None (a stream, for the chat endpoints): the app runs it as the server
    would have, its body read once already and whole in the app's first ``receive``; the app's
    own disconnect handling applies (the request is not marked as called directly)."""
    from multiplexer.faces.disconnect import DIRECT, HOOK

    endpoint = Echo()
    endpoint.hand_back = True
    protocol, wire = connect(endpoint)
    protocol.data_received(post(b"stream me"))
    await turns()
    assert endpoint.direct_bodies == [b"stream me"] and endpoint.asgi_calls == 1
    [(status, _, body)] = parse(b"".join(wire.sent))
    assert (status, body) == (200, b"asgi:stream me") and not wire.closed
    [scope] = endpoint.asgi_scopes
    assert DIRECT not in scope["extensions"] and not scope["extensions"][HOOK].callbacks
    protocol.data_received(post(b"next"))  # the connection goes on
    await turns()
    assert parse(b"".join(wire.sent))[1][2] == b"asgi:next"


async def test_a_body_in_two_packets_is_awaited_whole() -> None:
    endpoint = Echo()
    protocol, wire = connect(endpoint)
    request = post(b"0123456789")
    protocol.data_received(request[:-4])
    await turns()
    assert endpoint.direct_bodies == [] and wire.sent == []
    protocol.data_received(request[-4:])
    await turns()
    assert endpoint.direct_bodies == [b"0123456789"]
    assert parse(b"".join(wire.sent))[0][2] == b"echo:0123456789"


@pytest.mark.parametrize("request_bytes", [
    b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    post(b"a" * 65),  # over the endpoint's limit: the ASGI app decides (a face answers 413)
    post(b"hello", b"expect: 100-continue"),
    post(b"hello", b"x-filler: " + b"a" * 600),  # over the header cap: the app answers 431
], ids=["chunked", "over_limit", "expect_continue", "long_headers"])
async def test_requests_the_server_cannot_take_whole_go_through_asgi(request_bytes: bytes) -> None:
    endpoint = Echo()
    protocol, wire = connect(endpoint)
    protocol.data_received(request_bytes)
    await turns()
    assert endpoint.direct_bodies == [] and endpoint.asgi_calls == 1
    sent = b"".join(wire.sent).removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert parse(sent)[0][2].startswith(b"asgi:")


async def test_pipelined_requests_are_answered_in_order() -> None:
    endpoint = Echo()
    protocol, wire = connect(endpoint)
    protocol.data_received(post(b"one") + post(b"two") + b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
    await turns(30)
    assert endpoint.direct_bodies == [b"one", b"two"] and endpoint.asgi_calls == 1
    assert [body for _, _, body in parse(b"".join(wire.sent))] == [b"echo:one", b"echo:two", b"asgi:"]
    assert not wire.closed


async def test_connection_close_is_honoured() -> None:
    endpoint = Echo()
    protocol, wire = connect(endpoint)
    protocol.data_received(post(b"bye", b"connection: close"))
    await turns()
    [(status, headers, body)] = parse(b"".join(wire.sent))
    assert (status, body, headers[b"connection"]) == (200, b"echo:bye", b"close")
    assert wire.closed


async def test_a_failing_endpoint_answers_500_and_closes() -> None:
    endpoint = Echo()
    endpoint.fail = True
    protocol, wire = connect(endpoint)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")  # the server's log, as for an ASGI app's error
    logger.addHandler(handler)
    try:
        protocol.data_received(post(b"x"))
        await turns()
    finally:
        logger.removeHandler(handler)
    [(status, headers, body)] = parse(b"".join(wire.sent))
    assert (status, body, headers[b"connection"]) == (500, b"Internal Server Error", b"close")
    assert wire.closed
    assert [str(r.exc_info[1]) for r in logged if r.exc_info] == ["broken endpoint"]


async def test_a_client_gone_mid_call_cancels_it_and_gets_nothing() -> None:
    endpoint = Echo()
    endpoint.gate = anyio.Event()
    protocol, wire = connect(endpoint)
    protocol.data_received(post(b"slow"))
    await turns()
    assert endpoint.direct_bodies == [b"slow"] and not endpoint.cancelled
    protocol.connection_lost(None)
    await turns()
    assert endpoint.cancelled and wire.sent == []
    assert not protocol.tasks  # the request's task ended


async def test_a_request_the_server_cancels_is_answered_500() -> None:
    """A shutdown past its grace period cancels the requests still running: their clients get a
    500 and a closed connection, as uvicorn answers an ASGI app it cancels."""
    endpoint = Echo()
    endpoint.gate = anyio.Event()
    protocol, wire = connect(endpoint)
    protocol.data_received(post(b"slow"))
    await turns()
    for task in list(protocol.tasks):
        task.cancel()
    await turns()
    [(status, headers, body)] = parse(b"".join(wire.sent))
    assert (status, body, headers[b"connection"]) == (500, b"Internal Server Error", b"close")
    assert endpoint.cancelled and wire.closed and not protocol.tasks


async def test_rpc_and_embeddings_are_direct_endpoints_of_the_gateway() -> None:
    """Through the real server: pipelined ``/rpc`` calls on one socket come back in order with
    their ids; the app names ``/rpc`` among the endpoints the server calls directly."""
    async with gateway_with_upstream() as (url, _, gateway):
        app = create_app(gateway, v1_routes(gateway, Authenticator({})))
        assert {("POST", "/rpc"), ("POST", "/v1/embeddings")} <= set(app.direct)  # type: ignore[attr-defined]
        host, port = url.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        requests = b""
        for i in range(3):
            body = json.dumps({"jsonrpc": "2.0", "method": "sum", "params": [i, 1], "id": i}).encode()
            requests += b"POST /rpc HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" \
                        b"content-length: %d\r\n\r\n%s" % (len(body), body)
        async with stream:
            await stream.send(requests)
            got = b""
            with anyio.fail_after(10):
                while len(parse_complete(got)) < 3:
                    got += await stream.receive()
        replies = [json.loads(body) for _, _, body in parse(got)]
        assert replies == [{"jsonrpc": "2.0", "result": i + 1, "id": i} for i in range(3)]


def parse_complete(sent: bytes) -> list[Any]:
    try:
        return parse(sent)
    except (ValueError, IndexError):
        return []


async def test_a_body_past_the_read_buffer_is_read_whole_through_the_real_server() -> None:
    """A body of many packets (past uvicorn's 64 KiB point where it pauses reading) reaches the
    direct call whole, and the connection serves the next request after it."""
    async with gateway_with_upstream() as (url, _, _), httpx.AsyncClient() as http:
        big = {"jsonrpc": "2.0", "method": "sum", "params": [1] * 120_000, "id": "big"}
        r = await http.post(f"{url}/rpc", json=big)
        assert r.json() == {"jsonrpc": "2.0", "result": 120_000, "id": "big"}
        assert len(r.request.content) > 3 * 65_536
        small = {"jsonrpc": "2.0", "method": "sum", "params": [2, 3], "id": 2}
        assert (await http.post(f"{url}/rpc", json=small)).json()["result"] == 5


async def test_chat_is_direct_and_a_stream_goes_through_asgi_counted_once(tmp_path: Any) -> None:
    """``/v1/chat/completions`` is called directly; a body asking for a stream is handed back and
    streams through the ASGI path. Each request is counted once in ``/metrics`` and carries its
    request id."""
    from multiplexer.gateway.config import parse_config
    from multiplexer.server import running
    from tests.remote_helpers import fakes

    async with fakes() as f:
        config = parse_config({
            "store": {"path": str(tmp_path / "jobs.db")},
            "providers": {"oai": {"kind": "openai", "base_url": f.openai_url + "/v1", "api_key": "k"}},
            "routes": {"chat": {"provider": "oai", "operation": "chat", "models": ["gpt-4o-mini"]}}})
        async with running(config, port=0) as (gateway, url), httpx.AsyncClient(base_url=url) as http:
            app = create_app(gateway, v1_routes(gateway, Authenticator({})))
            assert ("POST", "/v1/chat/completions") in app.direct  # type: ignore[attr-defined]
            ask = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "one two"}]}
            whole = await http.post("/v1/chat/completions", json=ask)
            streamed = await http.post("/v1/chat/completions", json={**ask, "stream": True})
            escaped = await http.post("/v1/chat/completions", content=json.dumps(
                {**ask, "stream": True}).replace('"stream"', '"\\u0073tream"'),
                headers={"content-type": "application/json"})
            page = (await http.get("/metrics")).text
    assert whole.json()["choices"][0]["message"]["content"] == "echo: one two"
    for r in (streamed, escaped):  # an escaped key is a stream too: never a direct call's 500
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.rstrip().endswith("data: [DONE]")
    assert all(r.headers.get("x-request-id", "").startswith("req_") for r in (whole, streamed, escaped))
    counted = [line for line in page.splitlines() if line.startswith("multiplexer_http_requests_total{")
               and 'route="/v1/chat/completions"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) == 3
