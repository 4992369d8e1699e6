"""Every way into a running gateway as one request each, for tests/test_entry_points.py.

An ``Entry`` is one request a caller can make: a mounted HTTP route (a ``/rpc`` method or a body
that streams counts as its own entry, since each takes its own path through the faces), an MCP
request handler, or a gateway method. Each is sent by ``send`` against a ``Ctx`` (the caller's
clients and what earlier requests made) and answered as an ``Answer`` that says, in its face's
shape, whether the request was refused and why.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from starlette.routing import Route

from tests.mcp_helpers import McpHttp

Face = Literal["openai", "anthropic", "admin", "rpc", "mcp"]  # admin: the admin API's error shape

CHAT = {"model": "gpt-4o-mini", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
CLAUDE = {"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
NONE_FILE, NONE_BATCH, NONE_MSGBATCH, NONE_TASK = "file-none", "batch_none", "msgbatch_none", "job_none.0"


def mounted(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every route a running gateway's app mounts."""
    starlette = app
    while not hasattr(starlette, "routes"):  # the outer layers (access log, header limit, paths)
        starlette = starlette.app
    return {(m, r.path) for r in starlette.routes if isinstance(r, Route) for m in (r.methods or ())
            if m != "HEAD"}


def batch_input(lines: int = 1) -> bytes:
    """A ``/v1/batches`` input file of chat lines on a route with a price (gpt-4o-mini)."""
    return "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": CHAT}) + "\n" for i in range(lines)).encode()


@dataclass
class Ctx:
    """One caller (``http`` carries its key) and the things its requests name."""

    http: httpx.AsyncClient
    mcp: McpHttp
    file_id: str = NONE_FILE  # an uploaded batch input file of the caller's
    task_id: str = NONE_TASK  # an MCP task of the caller's


@dataclass(frozen=True)
class Answer:
    """A request's answer: its HTTP status, body (JSON, or the text of a stream) and headers."""

    status: int
    body: Any
    headers: httpx.Headers = field(default_factory=httpx.Headers)

    @classmethod
    def of(cls, r: httpx.Response) -> Answer:
        try:
            return cls(r.status_code, r.json(), r.headers)
        except ValueError:
            return cls(r.status_code, r.text, r.headers)

    def error(self, face: Face) -> tuple[int | str | None, dict[str, Any]]:
        """(the refusal's code, what it says) in ``face``'s shape; (None, {}) when not refused.

        HTTP faces: the status and the body's error object; JSON-RPC: -32003 and its ``data``
        (with the ``message``); MCP: the JSON-RPC error, or a tool's ``isError`` result with its
        text as ``message``."""
        body = self.body
        if face in ("openai", "anthropic", "admin"):
            if self.status < 400 or not isinstance(body, dict):
                return None, {}
            return self.status, body["error"] if isinstance(body.get("error"), dict) else body
        if not isinstance(body, dict):
            return None, {}
        if isinstance(body.get("error"), dict):
            e = body["error"]
            return e.get("code"), {"message": e.get("message"), **(e.get("data") or {})}
        result = body.get("result")
        if face == "mcp" and isinstance(result, dict) and result.get("isError"):
            text = " ".join(c.get("text", "") for c in result.get("content", []))
            return "isError", {"message": text}
        return None, {}


Send = Callable[[Ctx], Awaitable[Answer]]


@dataclass(frozen=True)
class Entry:
    """One way in. ``origin`` is what the gateway mounts that it exercises: ``(method, path)`` of
    an HTTP route, ``mcp <handler>``, or ``rpc <gateway method>``."""

    name: str
    face: Face
    origin: tuple[str, str] | str
    send: Send = field(compare=False)


def http(method: str, path: str, face: Face, name: str = "", *, url: str | None = None,
         body: Any = None, files: Any = None, data: Any = None) -> Entry:
    """An entry on the mounted route ``(method, path)``, requesting ``url`` (default ``path``,
    ``{file_id}`` the caller's file) with ``body`` (JSON, or a function of the context)."""

    async def send(ctx: Ctx) -> Answer:
        target = (url or path).format(file_id=ctx.file_id)
        content = body(ctx) if callable(body) else body
        return Answer.of(await ctx.http.request(method, target, json=content, files=files, data=data))

    return Entry(f"{method} {path}{' ' + name if name else ''}", face, (method, path), send)


def dashboard_stream(ctx: Ctx) -> Awaitable[Answer]:
    """``/ui/api/stream`` until its first state (the stream itself never ends)."""

    async def send() -> Answer:
        async with ctx.http.stream("GET", "/ui/api/stream") as r:
            if r.status_code != 200:
                await r.aread()
                return Answer.of(r)
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return Answer(200, json.loads(line[5:]), r.headers)
        raise AssertionError("the stream ended before its first state")

    return send()


def rpc(method: str, params: Any, name: str = "") -> Entry:
    async def send(ctx: Ctx) -> Answer:
        body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
        return Answer.of(await ctx.http.post("/rpc", json=body))

    origin = f"rpc {method}" if method.startswith("jobs.") else ("POST", "/rpc")
    return Entry(f"rpc {name or method}", "rpc", origin, send)


def mcp(handler: str, params: Callable[[Ctx], dict[str, Any]], name: str = "",
        routing: Callable[[Ctx], str | None] = lambda ctx: None) -> Entry:
    async def send(ctx: Ctx) -> Answer:
        return Answer(200, await ctx.mcp.send(handler, params(ctx), name=routing(ctx)))

    return Entry(f"mcp {handler}{' ' + name if name else ''}", "mcp", f"mcp {handler}", send)


def tool(name: str, arguments: dict[str, Any], what: str = "") -> Entry:
    return mcp("tools/call", lambda _: {"name": name, "arguments": arguments}, what or name,
               lambda _: name)


def task(handler: str) -> Entry:
    return mcp(handler, lambda ctx: {"taskId": ctx.task_id}, routing=lambda ctx: ctx.task_id)


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True}


RESPONSES = {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 8}
COMPLETIONS = {"model": "gpt-4o-mini", "prompt": "hi", "max_tokens": 8}
EMBED = {"model": "text-embedding-3-small", "input": "hi"}
JOB = {"calls": [{"method": "chat_batch", "params": CHAT}]}
MESSAGE_BATCH = {"requests": [{"custom_id": "a", "params": CLAUDE}]}
GREET = {"name": "tools_greet", "arguments": {"name": "ana"}}

ENTRIES: list[Entry] = [
    rpc("echo", {"x": 1}),
    rpc("chat", CHAT),
    rpc("jobs.submit", JOB),
    *(rpc(m, {"job_id": "none"}) for m in ("jobs.status", "jobs.results", "jobs.cancel", "jobs.delete")),
    rpc("jobs.list", {}),
    http("POST", "/v1/chat/completions", "openai", body=CHAT),
    http("POST", "/v1/chat/completions", "openai", "stream", body=streamed(CHAT)),
    http("POST", "/v1/responses", "openai", body=RESPONSES),
    http("POST", "/v1/responses", "openai", "stream", body=streamed(RESPONSES)),
    http("POST", "/v1/completions", "openai", body=COMPLETIONS),
    http("POST", "/v1/completions", "openai", "stream", body=streamed(COMPLETIONS)),
    http("POST", "/v1/embeddings", "openai", body=EMBED),
    http("GET", "/v1/models", "openai"),
    http("GET", "/v1/models/{model:path}", "openai", url="/v1/models/gpt-4o-mini"),
    http("POST", "/v1/messages", "anthropic", body=CLAUDE),
    http("POST", "/v1/messages", "anthropic", "stream", body=streamed(CLAUDE)),
    http("POST", "/v1/messages/count_tokens", "anthropic",
         body={"model": CLAUDE["model"], "messages": CLAUDE["messages"]}),
    http("POST", "/v1/files", "openai", data={"purpose": "batch"},
         files={"file": ("in.jsonl", batch_input())}),
    http("GET", "/v1/files", "openai"),
    http("GET", "/v1/files/{file_id}", "openai"),
    http("GET", "/v1/files/{file_id}/content", "openai"),
    http("DELETE", "/v1/files/{file_id}", "openai", url=f"/v1/files/{NONE_FILE}"),
    http("POST", "/v1/batches", "openai", body=lambda ctx: {
        "input_file_id": ctx.file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    http("GET", "/v1/batches", "openai"),
    http("GET", "/v1/batches/{batch_id}", "openai", url=f"/v1/batches/{NONE_BATCH}"),
    http("POST", "/v1/batches/{batch_id}/cancel", "openai", url=f"/v1/batches/{NONE_BATCH}/cancel"),
    http("POST", "/v1/messages/batches", "anthropic", body=MESSAGE_BATCH),
    http("GET", "/v1/messages/batches", "anthropic"),
    http("GET", "/v1/messages/batches/{batch_id}", "anthropic", url=f"/v1/messages/batches/{NONE_MSGBATCH}"),
    http("DELETE", "/v1/messages/batches/{batch_id}", "anthropic",
         url=f"/v1/messages/batches/{NONE_MSGBATCH}"),
    http("POST", "/v1/messages/batches/{batch_id}/cancel", "anthropic",
         url=f"/v1/messages/batches/{NONE_MSGBATCH}/cancel"),
    http("GET", "/v1/messages/batches/{batch_id}/results", "anthropic",
         url=f"/v1/messages/batches/{NONE_MSGBATCH}/results"),
    http("GET", "/ui/api/state", "admin"),
    http("GET", "/ui/api/requests", "admin"),
    http("GET", "/ui/api/requests/{request_id}", "admin", url="/ui/api/requests/1"),
    Entry("GET /ui/api/stream", "admin", ("GET", "/ui/api/stream"), dashboard_stream),
    tool("echo", {"x": 1}),
    tool("chat", CHAT),
    tool("tools_echo", {"text": "hi"}),
    tool("chat_batch", CHAT, "chat_batch (a task)"),
    task("tasks/get"),
    task("tasks/cancel"),
    mcp("resources/list", lambda _: {}),
    mcp("resources/templates/list", lambda _: {}),
    mcp("resources/read", lambda _: {"uri": "example://readme"}, routing=lambda _: "example://readme"),
    mcp("prompts/list", lambda _: {}),
    mcp("prompts/get", lambda _: GREET, routing=lambda _: "tools_greet"),
]
BY_NAME = {e.name: e for e in ENTRIES}
assert len(BY_NAME) == len(ENTRIES), "two entries of one name"
