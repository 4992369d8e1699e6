"""Every refusal says what to do, in its face's shape, against a gateway on 127.0.0.1: a budget's
names the key, the period, the cap, the spend and when it resets; a 401 is one sentence with the
fix; a 413 names the size, the limit and its setting; an unknown name points at the closest one the
caller may use; a browser's GET /mcp and a wrong method anywhere get JSON with the method to send.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.core.errors import closest, method_not_found
from multiplexer.core.policy import RouteConfig
from multiplexer.core.router import Router
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.money.budgets import Counter, budget_refusal, nanos
from multiplexer.server import running
from tests.mcp_helpers import McpHttp, stdio_upstream

pytestmark = pytest.mark.anyio

KEYS = {"alice": "sk-refusal-alice-0123456789", "tess": "sk-refusal-tess-0123456789",
        "carol": "sk-refusal-carol-0123456789", "old": "sk-refusal-old-0123456789"}
LIMIT = 2048
HI = [{"role": "user", "content": "hi"}]


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "server": {"max_body_bytes": LIMIT, "admin_key": "sk-refusal-admin-0123456789",
                   "api_keys": {
                       "alice": {"key": KEYS["alice"], "budget_usd": {"daily": "0.000000001"}},
                       "tess": {"key": KEYS["tess"], "budget_usd": {"total": "0.000000001"}},
                       "carol": {"key": KEYS["carol"], "routes": ["chat", "echo", "tools_*"],
                                 "models": ["mock-gpt"]},
                       "old": {"key": KEYS["old"], "expires_at": "2001-01-01T00:00:00Z"}}},
        "store": {"path": str(tmp_path / "refusals.db")},
        "providers": {"m": {"kind": "mock", "price": {"per_call": "0.01"}}, "e": {"kind": "echo"},
                      "tools": stdio_upstream()},
        "routes": {"chat": {"provider": "m", "operation": "chat", "models": ["mock-gpt", "mock-gpt-mini"]},
                   "claude": {"provider": "m", "operation": "messages", "models": ["mock-claude"]},
                   "echo": {"provider": "e"}, "echo_all": {"provider": "e"},
                   "tools_*": {"provider": "tools"}},
        "groups": {"gpt-pool": {"routes": ["chat"]}},
    }


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    async with running(parse_config(config(tmp_path)), port=0) as (gateway, url), \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield gateway, http


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def rpc(method: str, params: Any = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}


# -- budgets -----------------------------------------------------------------------------------
def next_midnight() -> str:
    return (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT00:00:00Z")


async def test_a_spent_daily_budget_names_key_period_cap_spend_and_reset_on_every_face(served: Any) -> None:
    _, http = served
    chat = {"model": "mock-gpt", "messages": HI}
    assert (await http.post("/v1/chat/completions", json=chat, headers=bearer("alice"))).status_code == 200
    before = next_midnight()
    call = rpc("chat", {"messages": HI})
    error = (await http.post("/rpc", json=call, headers=bearer("alice"))).json()["error"]
    midnight = error["data"]["reset"]
    assert midnight in (before, next_midnight())  # the test may run across a midnight
    said = ("Budget exceeded: key alice's daily budget of $0.000000001 is spent ($0.01); it resets at "
            + midnight)
    assert (error["code"], error["message"]) == (-32003, said)
    assert error["data"] == {"limit": "budget_usd", "scope": "key", "name": "alice", "period": "daily",
                             "budget_usd": "1E-9", "spend": "0.01", "reset": midnight,  # data as it was
                             "retry_after": error["data"]["retry_after"]}
    assert 0 < error["data"]["retry_after"] <= 86_400

    r = await http.post("/v1/chat/completions", json=chat, headers=bearer("alice"))
    assert r.status_code == 429 and r.json() == {"error": {
        "message": said, "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}
    r = await http.post("/v1/messages", json={"model": "mock-claude", "max_tokens": 5, "messages": HI},
                        headers=bearer("alice"))
    assert r.status_code == 429 and r.json() == {"type": "error", "error": {"type": "rate_limit_error",
                                                                            "message": said}}


async def test_a_spent_total_budget_says_it_never_resets(served: Any) -> None:
    _, http = served
    call = rpc("chat", {"messages": HI})
    assert "result" in (await http.post("/rpc", json=call, headers=bearer("tess"))).json()
    error = (await http.post("/rpc", json=call, headers=bearer("tess"))).json()["error"]
    assert error["message"] == ("Budget exceeded: key tess's total budget of $0.000000001 is spent ($0.01); "
                                "it never resets (an admin may raise it)")
    assert error["data"]["reset"] is None and "retry_after" not in error["data"]


def test_a_batch_refused_before_the_cap_is_spent_says_what_is_left() -> None:
    c = Counter("k", nanos(Decimal(100)), 0, 0, "team", "ops", "monthly", 1_798_761_600.0)
    refused = budget_refusal(c, nanos(Decimal("99.5")), 1_798_000_000.0)
    assert refused.message == ("Budget exceeded: team ops's monthly budget of $100 has $0.5 left "
                               "($99.5 spent); it resets at 2027-01-01T00:00:00Z")
    assert refused.data is not None and refused.data["budget_usd"] == "1E+2"  # data as it always was


# -- keys --------------------------------------------------------------------------------------
SEND = "send Authorization: Bearer <key>"
UNAUTHORIZED = [
    ({}, "missing bearer key", f"Invalid API key: no key was sent; {SEND}"),
    ({"authorization": "Basic abc"}, "malformed Authorization header",
     f"Invalid API key: the Authorization header is not 'Bearer <key>'; {SEND}"),
    ({"authorization": "Bearer sk-never-made-0123456789"}, "unknown key",
     f"Invalid API key: no key matches this bearer; {SEND}"),
    (bearer("old"), "key expired",
     f"Invalid API key: this key expired at 2001-01-01T00:00:00Z; ask an admin for a new key, then {SEND}"),
]


@pytest.mark.parametrize(("headers", "detail", "said"), UNAUTHORIZED, ids=[d for _, d, _ in UNAUTHORIZED])
async def test_a_401_says_it_once_with_the_fix_on_every_face(served: Any, headers: dict[str, str],
                                                             detail: str, said: str) -> None:
    _, http = served
    for path in ("/rpc", "/mcp"):
        r = await http.post(path, json=rpc("echo"), headers=headers)
        assert r.status_code == 401 and r.json()["error"] == {"code": -32005, "message": said,
                                                              "data": {"detail": detail}}
    r = await http.post("/v1/chat/completions", json={"model": "mock-gpt", "messages": HI}, headers=headers)
    assert r.status_code == 401 and r.json() == {"error": {
        "message": said, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    r = await http.post("/v1/messages", json={"model": "mock-claude", "max_tokens": 5, "messages": HI},
                        headers=headers)
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                            "message": said}}


# -- body size ---------------------------------------------------------------------------------
BIG = b'{"pad": "' + b"x" * 9000 + b'"}'
DECLARED = (f"Request body too large: the body is {len(BIG):,} bytes; the limit is 2,048 "
            "(server.max_body_bytes)")
CHUNKED = "Request body too large: the body is over the limit of 2,048 bytes (server.max_body_bytes)"


async def chunks() -> AsyncIterator[bytes]:
    for i in range(0, len(BIG), 1000):  # no content-length: sent chunked
        yield BIG[i:i + 1000]


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
async def test_a_413_names_the_size_the_limit_and_its_setting(served: Any, chunked: bool) -> None:
    _, http = served
    said = CHUNKED if chunked else DECLARED
    data = {"max_body_bytes": LIMIT} if chunked else {"max_body_bytes": LIMIT, "body_bytes": len(BIG)}
    headers = {**bearer("carol"), "content-type": "application/json"}
    for path in ("/rpc", "/mcp"):
        r = await http.post(path, content=chunks() if chunked else BIG, headers=headers)
        assert r.status_code == 413 and r.json()["error"] == {"code": -32006, "message": said, "data": data}
    r = await http.post("/v1/chat/completions", content=chunks() if chunked else BIG, headers=headers)
    assert r.status_code == 413 and r.json() == {"error": {
        "message": said, "type": "invalid_request_error", "param": None, "code": None}}
    r = await http.post("/v1/messages", content=chunks() if chunked else BIG, headers=headers)
    assert r.status_code == 413 and r.json() == {"type": "error", "error": {"type": "request_too_large",
                                                                            "message": said}}


# -- unknown names -----------------------------------------------------------------------------
def test_the_router_points_at_the_closest_name_it_may_use() -> None:
    router = Router({n: RouteConfig(provider="p") for n in ("echo", "echo_all", "sum", "tools_*")},
                    {"gpt-pool": ["sum"]})
    with pytest.raises(Exception) as unknown:
        router.resolve("ecoh")
    assert unknown.value.to_dict() == method_not_found("ecoh", "echo").to_dict() == {  # type: ignore[attr-defined]
        "code": -32601, "message": "Method not found: method 'ecoh' is not served here; did you mean 'echo'?",
        "data": {"method": "ecoh", "did_you_mean": "echo"}}
    assert router.unknown("gpt-pol").data == {"method": "gpt-pol", "did_you_mean": "gpt-pool"}
    assert router.unknown("echo_al").data == {"method": "echo_al", "did_you_mean": "echo_all"}
    assert router.unknown("echo_al", lambda name: name != "echo_all").data == {"method": "echo_al",
                                                                                "did_you_mean": "echo"}
    assert router.unknown("zzzz").to_dict() == {  # nothing close: nothing suggested
        "code": -32601, "data": {"method": "zzzz"},
        "message": "Method not found: method 'zzzz' is not served here"}
    assert router.names() == ["echo", "echo_all", "sum", "gpt-pool"]  # a wildcard is no name to call
    assert closest("tools_ecoh", router.names()) is None


async def test_an_unknown_method_on_rpc_points_at_a_route_the_key_may_use(served: Any) -> None:
    _, http = served
    said = (await http.post("/rpc", json=rpc("echo_al"), headers=bearer("alice"))).json()["error"]
    assert said == {"code": -32601, "data": {"method": "echo_al", "did_you_mean": "echo_all"}, "message":
                    "Method not found: method 'echo_al' is not served here; did you mean 'echo_all'?"}
    said = (await http.post("/rpc", json=rpc("gpt-pol"), headers=bearer("alice"))).json()["error"]
    assert said["data"] == {"method": "gpt-pol", "did_you_mean": "gpt-pool"}
    # carol may not use echo_all: she is pointed at echo, and never shown the route she cannot use
    said = (await http.post("/rpc", json=rpc("echo_al"), headers=bearer("carol"))).json()["error"]
    assert said["data"] == {"method": "echo_al", "did_you_mean": "echo"}


async def test_an_unknown_model_on_v1_is_a_404_pointing_at_a_model_the_key_may_use(served: Any) -> None:
    _, http = served
    r = await http.post("/v1/chat/completions", json={"model": "mock-gtp", "messages": HI},
                        headers=bearer("alice"))
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "model 'mock-gtp' is not served here; did you mean 'mock-gpt'?",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    r = await http.post("/v1/chat/completions", json={"model": "mock-gpt-mni", "messages": HI},
                        headers=bearer("alice"))
    assert r.json()["error"]["message"].endswith("did you mean 'mock-gpt-mini'?")
    r = await http.post("/v1/chat/completions", json={"model": "mock-gpt-mni", "messages": HI},
                        headers=bearer("carol"))  # she may use mock-gpt alone
    assert r.json()["error"]["message"] == "model 'mock-gpt-mni' is not served here; did you mean 'mock-gpt'?"
    r = await http.post("/v1/messages", json={"model": "mock-claud", "max_tokens": 5, "messages": HI},
                        headers=bearer("carol"))  # not mock-claude: she may not use it
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": "model 'mock-claud' is not served here"}}


async def test_an_unknown_mcp_tool_points_at_a_tool_the_caller_may_call(served: Any) -> None:
    _, http = served
    said = (await McpHttp(http, "/mcp", KEYS["alice"]).call("echo_al", {}))["error"]
    assert said == {"code": -32602, "message": "Unknown tool: echo_al; did you mean 'echo_all'?",
                    "data": {"tool": "echo_al", "did_you_mean": "echo_all"}}
    carol = McpHttp(http, "/mcp", KEYS["carol"])
    said = (await carol.call("echo_al", {}))["error"]  # echo_all is hidden from her: echo is hers
    assert said["data"] == {"tool": "echo_al", "did_you_mean": "echo"}
    said = (await carol.call("echo_all", {}))["error"]  # the hidden tool itself: as if it did not exist
    assert said == {"code": -32602, "message": "Unknown tool: echo_all; did you mean 'echo'?",
                    "data": {"tool": "echo_all", "did_you_mean": "echo"}}


# -- methods -----------------------------------------------------------------------------------
async def test_a_browsers_get_on_mcp_is_a_405_saying_what_the_url_is_for(served: Any) -> None:
    gateway, http = served
    face = gateway.faces["mcp"]
    before = face.sessions_of(None)
    r = await http.get("/mcp", headers={"accept": "text/html"})
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "mcp-session-id" not in r.headers
    assert r.json() == {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": (
        f"This is an MCP endpoint, not a page: point an MCP client (Streamable HTTP) at {http.base_url}/mcp; "
        "it speaks POST")}}
    assert face.sessions_of(None) == before


@pytest.mark.parametrize(("method", "path", "allow", "body"), [
    ("GET", "/v1/chat/completions", "POST", {"error": {
        "message": "Method Not Allowed: GET /v1/chat/completions; send POST",
        "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}}),
    ("GET", "/v1/messages", "POST", {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Method Not Allowed: GET /v1/messages; send POST"}}),
    ("GET", "/rpc", "POST", {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": "Method Not Allowed: GET /rpc; send POST"}}),
    ("DELETE", "/admin/keys", "GET, HEAD, POST", {"error": {
        "message": "Method Not Allowed: DELETE /admin/keys; send GET or POST", "type": "method_not_allowed",
        "code": 405}}),
    ("POST", "/healthz", "GET, HEAD", {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": "Method Not Allowed: POST /healthz; send GET"}}),
])
async def test_a_wrong_method_is_a_json_405_in_the_faces_shape(served: Any, method: str, path: str,
                                                               allow: str, body: dict[str, Any]) -> None:
    _, http = served
    r = await http.request(method, path, headers=bearer("carol"))
    assert (r.status_code, r.headers["allow"], r.headers["content-type"]) == (405, allow, "application/json")
    assert r.json() == body
