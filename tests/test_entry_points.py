"""Every way into the gateway is charged to the caller's key, through the one quota decision.

The entry points are enumerated from what the running gateway mounts (its HTTP routes, its MCP
request handlers, its gateway methods), not listed by hand: a face added later without a row
here fails the enumeration, and one that skips admission fails the charge check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import McpHttp, stdio_upstream
from tests.remote_helpers import fakes
from tests.test_v1_openai import KEY, v1_config

pytestmark = pytest.mark.anyio

# Not a caller's request: probes for load balancers and the metrics scraper (no key asked).
UNKEYED = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"),
           ("GET", "/")}  # "/": a redirect to the dashboard's page
# The operator's endpoints: the admin key, not a caller's key (tests/test_admin.py enumerates them).
ADMIN_PREFIXES = ("/admin/", "/ui")
# MCP protocol bookkeeping served from the session or the gateway's own catalog, no upstream work.
MCP_BOOKKEEPING = {"initialize", "ping", "tools/list", "logging/setLevel", "subscriptions/listen",
                   "completion/complete", "resources/subscribe", "resources/unsubscribe",
                   "server/discover"}

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
CLAUDE = {"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
Request = Callable[[httpx.AsyncClient], Awaitable[Any]]

HTTP: dict[tuple[str, str], Request] = {
    ("POST", "/rpc"): lambda h: h.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "echo",
                                                      "params": {"x": 1}}),
    ("POST", "/v1/chat/completions"): lambda h: h.post("/v1/chat/completions", json=CHAT),
    ("POST", "/v1/responses"): lambda h: h.post("/v1/responses", json={"model": "gpt-4o-mini",
                                                                       "input": "hi"}),
    ("POST", "/v1/completions"): lambda h: h.post("/v1/completions", json={"model": "gpt-4o-mini",
                                                                           "prompt": "hi"}),
    ("POST", "/v1/embeddings"): lambda h: h.post("/v1/embeddings", json={
        "model": "text-embedding-3-small", "input": "hi"}),
    ("GET", "/v1/models"): lambda h: h.get("/v1/models"),
    ("GET", "/v1/models/{model:path}"): lambda h: h.get("/v1/models/gpt-4o-mini"),
    ("POST", "/v1/messages"): lambda h: h.post("/v1/messages", json=CLAUDE),
    ("POST", "/v1/messages/count_tokens"): lambda h: h.post("/v1/messages/count_tokens", json={
        "model": "claude-sonnet-4-5", "messages": CLAUDE["messages"]}),
    ("POST", "/v1/files"): lambda h: h.post("/v1/files", data={"purpose": "batch"},
                                            files={"file": ("a.jsonl", b"{}\n")}),
    ("GET", "/v1/files"): lambda h: h.get("/v1/files"),
    ("GET", "/v1/files/{file_id}"): lambda h: h.get("/v1/files/file-none"),
    ("DELETE", "/v1/files/{file_id}"): lambda h: h.delete("/v1/files/file-none"),
    ("GET", "/v1/files/{file_id}/content"): lambda h: h.get("/v1/files/file-none/content"),
    ("POST", "/v1/batches"): lambda h: h.post("/v1/batches", json={
        "input_file_id": "file-none", "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    ("GET", "/v1/batches"): lambda h: h.get("/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"): lambda h: h.get("/v1/batches/batch_none"),
    ("POST", "/v1/batches/{batch_id}/cancel"): lambda h: h.post("/v1/batches/batch_none/cancel"),
    ("POST", "/v1/messages/batches"): lambda h: h.post("/v1/messages/batches", json={"requests": [
        {"custom_id": "a", "params": CLAUDE}]}),
    ("GET", "/v1/messages/batches"): lambda h: h.get("/v1/messages/batches"),
    ("GET", "/v1/messages/batches/{batch_id}"): lambda h: h.get("/v1/messages/batches/msgbatch_x"),
    ("DELETE", "/v1/messages/batches/{batch_id}"): lambda h: h.delete("/v1/messages/batches/msgbatch_x"),
    ("POST", "/v1/messages/batches/{batch_id}/cancel"): lambda h: h.post(
        "/v1/messages/batches/msgbatch_x/cancel"),
    ("GET", "/v1/messages/batches/{batch_id}/results"): lambda h: h.get(
        "/v1/messages/batches/msgbatch_x/results"),
}
JOBS = {
    "jobs.submit": {"calls": [{"method": "chat_batch", "params": CHAT}]},
    "jobs.status": {"job_id": "none"}, "jobs.results": {"job_id": "none"},
    "jobs.cancel": {"job_id": "none"}, "jobs.delete": {"job_id": "none"}, "jobs.list": {},
}


def config(f: Any, tmp_path: Any) -> dict[str, Any]:
    data = v1_config(f, tmp_path)
    data["server"]["quotas"] = {"alice": {"rpm": 100_000, "concurrency": 100}}
    data["providers"]["builtin"] = {"kind": "echo"}
    data["providers"]["tools"] = stdio_upstream()
    data["routes"].update({
        "echo": {"provider": "builtin"},
        "chat_batch": {"provider": "oai", "operation": "chat", "mode": "batch",
                       "batch": {"max_items": 1, "max_wait_ms": 0}},
        "tools_*": {"provider": "tools"},
    })
    return data


class Charges:
    """The identities whose claims reached the one quota decision, in order."""

    def __init__(self, quotas: Any) -> None:
        self.seen: list[str | None] = []
        decide = quotas.decide

        async def spy(claims: Any) -> Any:
            self.seen += [c.identity for c in claims if c is not None]
            return await decide(claims)

        quotas.decide = spy

    async def of(self, request: Awaitable[Any]) -> list[str | None]:
        before = len(self.seen)
        await request
        return self.seen[before:]


def mounted(app: Any) -> set[tuple[str, str]]:
    starlette = app
    while not hasattr(starlette, "routes"):  # the outer layers (access log, header limit, paths)
        starlette = starlette.app
    return {(m, r.path) for r in starlette.routes if isinstance(r, Route) for m in (r.methods or ())
            if m != "HEAD"}


async def test_every_entry_point_is_charged_to_the_callers_key(tmp_path: Any) -> None:
    async with (
        fakes() as f,
        running(parse_config(config(f, tmp_path)), port=0) as (gw, url),
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http,
    ):
        charges = Charges(gw.quotas)
        mcp_path = gw.config.server.mcp.path
        routes = {r for r in mounted(gw.faces["app"]) - UNKEYED - {("POST", mcp_path)}
                  if not r[1].startswith(ADMIN_PREFIXES)}
        assert routes - HTTP.keys() == set(), "a mounted route with no charge check here"
        for (method, path), request in sorted(HTTP.items()):
            assert (method, path) in routes, f"{method} {path} is not mounted any more"
            assert "alice" in await charges.of(request(http)), f"{method} {path} charged nothing"

        assert set(gw.methods) == set(JOBS), "a gateway method with no charge check here"
        for name, params in JOBS.items():
            body = {"jsonrpc": "2.0", "id": 1, "method": name, "params": params}
            assert "alice" in await charges.of(http.post("/rpc", json=body)), f"{name} charged nothing"

        mcp = McpHttp(http, url + mcp_path, KEY)
        created = await mcp.call("chat_batch", CHAT)  # a task: the client opted into tasks
        task_id = created["result"]["taskId"]
        requests: dict[str, Awaitable[Any]] = {
            "tools/call": mcp.call("echo", {"x": 1}),
            "tasks/get": mcp.task("tasks/get", task_id),
            "tasks/cancel": mcp.task("tasks/cancel", task_id),
            "resources/list": mcp.send("resources/list", {}),
            "resources/templates/list": mcp.send("resources/templates/list", {}),
            "resources/read": mcp.send("resources/read", {"uri": "demo://greeting"}, name="demo://greeting"),
            "prompts/list": mcp.send("prompts/list", {}),
            "prompts/get": mcp.send("prompts/get", {"name": "none"}, name="none"),
        }
        handlers = set(gw.faces["mcp"].server._request_handlers) - MCP_BOOKKEEPING
        assert handlers - requests.keys() == set(), "an MCP request with no charge check here"
        for name, request in requests.items():
            assert "alice" in await charges.of(request), f"MCP {name} charged nothing"


async def test_an_mcp_task_is_refused_by_its_keys_quota(tmp_path: Any) -> None:
    """Task creation used to go straight to the job store, past the key's rpm: now the key's
    quota refuses it like any call."""
    async with fakes() as f:
        data = config(f, tmp_path)
        data["server"]["quotas"] = {"alice": {"rpm": 1}}
        async with (
            running(parse_config(data), port=0) as (gw, url),
            httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http,
        ):
            mcp = McpHttp(http, url + gw.config.server.mcp.path, KEY)
            first = await mcp.call("chat_batch", CHAT)
            second = await mcp.call("chat_batch", CHAT)
    assert first["result"]["resultType"] == "task"
    assert second["result"]["isError"] is True
    assert "rpm" in str(second["result"]["content"])
