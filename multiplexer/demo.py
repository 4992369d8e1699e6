"""``multiplexer demo``: serve the config on a port, show a few calls answered, stop."""

from __future__ import annotations

import json
from typing import Any

import httpx

from multiplexer.core.errors import RpcError
from multiplexer.gateway.config import Config
from multiplexer.sdk.client import Client
from multiplexer.server import running

SAMPLES: list[tuple[str, Any]] = [
    ("echo", {"hello": "world"}),
    ("sum", {"values": [1, 2, 3.5]}),
    ("embed_local", {"input": ["a cat sat on the mat", "the gateway batches calls"]}),
    ("tools_add", {"a": 2, "b": 40}),
    ("no_such_method", {}),
]


def _show(value: Any) -> str:
    text = json.dumps(value)
    if "embedding" in text:
        data = value.get("data", []) if isinstance(value, dict) else []
        dims = len(data[0]["embedding"]) if data else 0
        return f"{len(data)} embeddings of {dims} dims, usage={value.get('usage')}"
    return text if len(text) < 160 else text[:157] + "..."


async def _mcp_demo(url: str) -> None:
    """The same gateway through the MCP SDK's own client over Streamable HTTP."""
    try:
        import httpx2
        from mcp import Client as McpClient
        from mcp.client.streamable_http import streamable_http_client
    except ImportError:
        return
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=120)) as http, \
            McpClient(streamable_http_client(url, http_client=http)) as mcp:
        tools = (await mcp.list_tools()).tools
        print(f"  MCP {url}: protocol {mcp.protocol_version}, {len(tools)} tools "
              f"({', '.join(t.name for t in tools[:6])}{', ...' if len(tools) > 6 else ''})")
        name, args = ("tools_add", {"a": 2, "b": 40}) if any(
            t.name == "tools_add" for t in tools) else ("sum", {"values": [1, 2]})
        result = await mcp.call_tool(name, args)
        print(f"  MCP tools/call {name}({json.dumps(args)}) -> {result.structured_content}")
        resources = (await mcp.list_resources()).resources
        prompts = (await mcp.list_prompts()).prompts
        if resources or prompts:
            print(f"  MCP upstream resources {[str(r.uri) for r in resources]}, "
                  f"prompts {[p.name for p in prompts]}")


def _model_of(config: Config, names: set[str], operation: str) -> str | None:
    """The first ``/v1`` model a served route of this operation lists (None: no such route)."""
    for name, route in config.routes.items():
        if name in names and route.operation == operation and route.models:
            return route.models[0]
    return None


async def _v1_demo(url: str, config: Config, names: set[str]) -> None:
    """Requests shaped as the OpenAI and Anthropic SDKs send them, for the models the routes list
    (the default config: the mock stand-ins for chat and messages, the local MiniLM embeddings)."""
    ask = [{"role": "user", "content": "what does a gateway batch?"}]
    async with httpx.AsyncClient(timeout=120) as http:
        if (model := _model_of(config, names, "chat")) is not None:
            reply = await http.post(f"{url}/v1/chat/completions", json={"model": model, "messages": ask})
            print(f"  POST /v1/chat/completions (model {model}) -> {_said(reply, 'chat')}")
            words = []
            async with http.stream("POST", f"{url}/v1/chat/completions",
                                   json={"model": model, "messages": ask, "stream": True}) as events:
                async for line in events.aiter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                        words += [delta] if delta else []
            print(f"  ... streamed: {len(words)} chunks, {''.join(words)[:60]!r}")
        if (model := _model_of(config, names, "messages")) is not None:
            reply = await http.post(f"{url}/v1/messages", json={"model": model, "max_tokens": 64,
                                                                "messages": ask})
            print(f"  POST /v1/messages (model {model}) -> {_said(reply, 'messages')}")
        route = config.routes.get("embed_local")
        if route is not None and "embed_local" in names and route.models:
            model = route.models[0]
            reply = await http.post(f"{url}/v1/embeddings", json={"model": model, "input": "hello"})
            body = reply.json()
            shown = _show(body) if reply.status_code == 200 else f"HTTP {reply.status_code} {body}"
            print(f"  POST /v1/embeddings (model {model}) -> {shown}")


def _said(reply: httpx.Response, api: str) -> str:
    """What a chat completion or a message says, or the HTTP error; and what it cost, where the
    model has a price (the default config's mock has an example one)."""
    body = reply.json()
    if reply.status_code != 200:
        return f"HTTP {reply.status_code} {body}"
    text = (body["choices"][0]["message"]["content"] if api == "chat"
            else "".join(b.get("text", "") for b in body["content"]))
    cost = reply.headers.get("x-multiplexer-cost-usd")
    return f"{text[:60]!r}, usage={body.get('usage')}" + (f", cost ${cost}" if cost else "")


async def run_demo(config: Config, port: int = 0) -> int:
    async with running(config, port=port) as (gateway, url):
        print(f"multiplexer serving {url} (/v1, /rpc, /mcp, /healthz, /metrics)")
        names = {t.name for t in await gateway.list_tools()}
        samples = [(m, p) for m, p in SAMPLES if m in names or m == "no_such_method"]
        async with Client(url) as client:
            results = await client.call_many(samples)
            for (method, params), result in zip(samples, results, strict=True):
                shown = (f"error {result.code} {result.message}" if isinstance(result, RpcError)
                         else _show(result))
                print(f"  {method}({json.dumps(params)[:60]}) -> {shown}")
            many = await client.call_many([("sum", {"values": [i, i]}) for i in range(1000)])
            ok = sum(1 for i, r in enumerate(many) if r == 2 * i)
            print(f"  call_many: 1000 sum calls, {ok} correct, in input order")
        await _v1_demo(url, config, names)
        await _mcp_demo(f"{url}{config.server.mcp.path}")
        print("demo done; run `multiplexer serve` to keep the gateway up")
    return 0
