"""2026-07-28 POSTs served in the request's own task (``faces/mcp/exchange.py``).

The lean entry answers every request exactly as the SDK's entry does (status, content
type, body), commits to SSE only when a notification goes out, keeps a silent call's
stream alive, and drops notifications that come after the reply.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import mcp_types as types
import pytest
from mcp.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from multiplexer.core.provider import ToolSpec
from multiplexer.core.tracing import Tracer
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.mcp.batch import run_asgi
from multiplexer.faces.mcp.exchange import SingleExchange
from multiplexer.faces.mcp.http import McpEndpoint, mount_mcp
from multiplexer.faces.mcp.server import McpFace
from multiplexer.faces.mcp.tools import ToolCatalog
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import MODERN, call, stdio_upstream, structured, wait_until

pytestmark = pytest.mark.anyio

REGION_SCHEMA = {"type": "object", "properties": {"region": {"type": "string", "x-mcp-header": "Region"}}}
META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}
ACCEPT = "application/json, text/event-stream"


def config() -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "providers": {"builtin": {"kind": "echo"}},
        "routes": {"echo": {"provider": "builtin"},
                   "regional": {"provider": "builtin", "method": "echo", "input_schema": REGION_SCHEMA}},
    }


def post(method: str, params: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
         body: Any = None, rid: Any = 7) -> tuple[dict[str, str], bytes]:
    """A well-formed 2026-07-28 request, or ``body`` as given; ``headers`` override the defaults."""
    message = {"jsonrpc": "2.0", "id": rid, "method": method, "params": {**(params or {}), "_meta": META}}
    base = {"content-type": "application/json", "accept": ACCEPT, "mcp-protocol-version": MODERN,
            "mcp-method": method}
    if method == "tools/call" and params:
        base["mcp-name"] = str(params["name"])
    raw = body if isinstance(body, bytes) else json.dumps(message if body is None else body).encode()
    return {**base, **(headers or {})}, raw


CASES: dict[str, tuple[dict[str, str], bytes]] = {
    "call": post("tools/call", {"name": "echo", "arguments": {"a": 1}}),
    "call, string id": post("tools/call", {"name": "echo", "arguments": {}}, rid="x"),
    "list": post("tools/list"),
    "ping": post("ping"),
    "unknown tool": post("tools/call", {"name": "nope", "arguments": {}}),
    "unknown method": post("nope/nope"),
    "bad params": post("tools/call", {"name": 3}),
    "param header agrees": post("tools/call", {"name": "regional", "arguments": {"region": "eu"}},
                                headers={"mcp-param-region": "eu"}),
    "param header disagrees": post("tools/call", {"name": "regional", "arguments": {"region": "eu"}},
                                   headers={"mcp-param-region": "us"}),
    "param header missing": post("tools/call", {"name": "regional", "arguments": {"region": "eu"}}),
    "text content type": post("ping", headers={"content-type": "text/plain"}),
    "json accept only": post("ping", headers={"accept": "application/json"}),
    "wildcard accept": post("ping", headers={"accept": "*/*"}),
    "parse error": post("ping", body=b"{nope"),
    "notification": post("ping", body={"jsonrpc": "2.0", "method": "notifications/cancelled"}),
    "bad envelope": post("ping", body={"jsonrpc": "2.0", "id": {"no": 1}, "method": "ping"}),
    "not an object": post("ping", body="ping"),
    "method header mismatch": post("ping", headers={"mcp-method": "tools/list"}),
    "unsupported version": post("ping", headers={"mcp-protocol-version": "2099-01-01"}),
    "no envelope": post("ping", body={"jsonrpc": "2.0", "id": 1, "method": "ping"}),
}

# Served by the lean entry; every other case is the SDK's to answer.
LEAN = {"call", "call, string id", "list", "ping", "unknown tool", "unknown method", "param header agrees",
        "wildcard accept"}


async def asgi(app: Any, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
    """One POST through an ASGI app: status, content type, body (the client stays until the end)."""
    scope: Scope = {"type": "http", "method": "POST", "path": "/mcp", "query_string": b"",
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return await run_asgi(app, scope, body)


@pytest.fixture(scope="module")
async def endpoint() -> AsyncIterator[McpEndpoint]:
    async with Gateway(parse_config(config())) as gateway:
        routes, lifespan = mount_mcp(gateway, Authenticator({}))
        app = routes[0].app  # type: ignore[attr-defined]
        assert isinstance(app, McpEndpoint)
        async with lifespan(None):
            await asgi(app, *CASES["list"])  # a listing, as clients do: the schemas the header check reads
            yield app


@pytest.mark.parametrize("case", CASES)
async def test_answers_as_the_sdks_entry_does(endpoint: McpEndpoint, case: str) -> None:
    headers, body = CASES[case]
    handed: list[bool] = []
    fallback = endpoint.exchange.fallback

    async def sdk_entry(scope: Scope, receive: Receive, send: Send) -> None:
        handed.append(True)
        await fallback(scope, receive, send)

    endpoint.exchange.fallback = sdk_entry
    try:
        ours = await asgi(endpoint, headers, body)
    finally:
        endpoint.exchange.fallback = fallback
    sdk = await asgi(endpoint.manager.handle_request, headers, body)
    assert ours == sdk
    assert bool(handed) == (case not in LEAN)
    if case == "call":
        assert ours[0] == 200 and ours[1] == "application/json"
        result = json.loads(ours[2])["result"]
        assert result["structuredContent"] == {"a": 1} and result["resultType"] == "complete"


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    conf = parse_config({"server": {"host": "127.0.0.1", "port": 0},
                         "providers": {"tools": stdio_upstream()},
                         "routes": {"tools_*": {"provider": "tools", "dedup": False}}})
    async with running(conf) as (gw, url):
        yield gw, url + "/mcp"


async def test_a_call_turns_to_sse_only_to_report_progress(gateway: tuple[Gateway, str]) -> None:
    _, url = gateway
    sleep = {"name": "tools_sleep", "arguments": {"seconds": 0.01, "steps": 2}}
    async with httpx.AsyncClient(timeout=30) as http:
        headers, body = post("tools/call", sleep)
        quiet = await http.post(url, content=body, headers=headers)
        tracked = {**sleep, "_meta": {**META, "progressToken": "p1"}}
        headers, body = post("tools/call", {"name": "tools_sleep"}, body={
            "jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": tracked})
        reported = await http.post(url, content=body, headers=headers)
    assert quiet.headers["content-type"] == "application/json"
    assert quiet.json()["result"]["structuredContent"] == {"result": "slept"}
    assert reported.headers["content-type"] == "text/event-stream"
    events = [json.loads(line[5:]) for line in reported.text.splitlines() if line.startswith("data:")]
    assert [(e["method"], e["params"]["progressToken"], e["params"]["progress"]) for e in events[:-1]] == [
        ("notifications/progress", "p1", 1), ("notifications/progress", "p1", 2)]
    assert events[-1]["id"] == 8 and events[-1]["result"]["structuredContent"] == {"result": "slept"}


async def test_a_hang_up_cancels_the_upstream_call(gateway: tuple[Gateway, str]) -> None:
    gw, url = gateway
    before = structured(await call(gw, "tools_stats", {}))["cancelled"]
    headers, body = post("tools/call", {"name": "tools_sleep", "arguments": {"seconds": 30}})
    async with httpx.AsyncClient(timeout=30) as http, anyio.create_task_group() as tg:
        tg.start_soon(lambda: http.post(url, content=body, headers=headers))

        async def upstream_runs_it() -> bool:
            return structured(await call(gw, "tools_stats", {}))["running"] == 1

        await wait_until(upstream_runs_it)
        tg.cancel_scope.cancel()  # the client goes: its connection closes with no reply read

    async def upstream_cancelled() -> bool:
        stats = structured(await call(gw, "tools_stats", {}))
        return stats["cancelled"] == before + 1 and stats["running"] == 0

    await wait_until(upstream_cancelled)
    assert all(lane.in_flight == 0 for lane in gw.lanes.values())


def bare_server(started: anyio.Event, release: anyio.Event, late: list[Any]) -> Server[Any]:
    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        late.append(ctx.session)
        started.set()
        await release.wait()
        return types.CallToolResult(content=[types.TextContent(type="text", text="done")])

    return Server("bare", on_call_tool=call_tool)


class SilentCall:
    """A bare server whose tool call ends only once the entry has pinged its stream."""

    def __init__(self, keepalive_s: float) -> None:
        started, self.release, self.sessions = anyio.Event(), anyio.Event(), []
        server = bare_server(started, self.release, self.sessions)
        self.manager = StreamableHTTPSessionManager(app=server)
        self.entry = SingleExchange(server, self.manager.handle_request, lambda: {},
                                    keepalive_s=keepalive_s, ticks_per_keepalive=2)
        self.sent: list[Message] = []

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message.get("body") == b": ping\r\n\r\n":
            self.release.set()  # the stream is open and pinged: now the call may end

    async def receive(self) -> Message:
        await anyio.sleep_forever()
        raise AssertionError

    async def call(self, request_id: int, meta: dict[str, Any]) -> None:
        message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                   "params": {"name": "x", "_meta": meta}}
        headers, body = post("tools/call", {"name": "x"}, body=message)
        scope: Scope = {"type": "http", "method": "POST", "path": "/mcp",
                        "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
        with anyio.fail_after(10):
            await self.entry(scope, self.receive, self.send, Headers(scope=scope), body)


async def test_a_silent_call_is_kept_alive_and_late_notifications_are_dropped() -> None:
    silent = SilentCall(keepalive_s=0.02)
    async with silent.manager.run(), silent.entry.running():
        await silent.call(7, {**META, "progressToken": 1})
        await silent.sessions[0].report_progress(1)  # after the reply: dropped, no write, no error
        note = types.LoggingMessageNotification(params=types.LoggingMessageNotificationParams(
            level="info", data="late"))
        await silent.sessions[0].send_notification(note, related_request_id=7)
    sent = silent.sent
    assert sent[0]["type"] == "http.response.start" and dict(sent[0]["headers"])[b"content-type"] == (
        b"text/event-stream")
    assert sent[1]["body"] == b": ping\r\n\r\n"
    final = sent[-1]
    assert final["more_body"] is False and json.loads(final["body"].split(b"data: ")[1])["id"] == 7
    assert all(m.get("more_body") for m in sent[1:-1])


async def test_the_keepalive_ticker_waits_while_no_call_is_open() -> None:
    """An idle server is not woken every tick; the ticker starts with the first call."""
    silent = SilentCall(keepalive_s=0.002)
    async with silent.manager.run(), silent.entry.running():
        await anyio.sleep(0.05)  # 50 ticks' worth of idle time
        assert silent.entry.tick == 0
        await silent.call(8, META)
        assert silent.entry.tick > 0


def test_only_schemas_that_declare_headers_are_handed_to_the_header_check() -> None:
    catalog = ToolCatalog()
    catalog.build([ToolSpec("plain", "", {"type": "object", "properties": {"region": {"type": "string"}}}),
                   ToolSpec("regional", "", REGION_SCHEMA)])
    assert catalog.header_schema("regional") == REGION_SCHEMA
    assert catalog.header_schema("plain") is None and catalog.header_schema("unknown") is None
    assert catalog.input_schema("plain") == {"type": "object", "properties": {"region": {"type": "string"}}}


class _Tracing(Tracer):
    enabled = True


@pytest.mark.parametrize("traces", [False, True])
def test_the_sdks_span_per_message_follows_the_gateways_traces(traces: bool) -> None:
    gateway = Gateway(parse_config(config()), tracer=_Tracing() if traces else None)
    face = McpFace(gateway)
    sdk_spans = [m for m in face.server.middleware if type(m).__name__ == "OpenTelemetryMiddleware"]
    assert len(sdk_spans) == (1 if traces else 0)
    assert face.server.middleware[-1] == face._track_connection
