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


async def _v1_demo(url: str, config: Config, names: set[str]) -> None:
    """An OpenAI-shaped embeddings request, as the OpenAI SDK would send it, for the model of
    ``embed_local`` (the default config's local embed route) when that route is served."""
    route = config.routes.get("embed_local")
    if route is None or "embed_local" not in names or not route.models:
        return
    model = route.models[0]
    async with httpx.AsyncClient(timeout=120) as http:
        reply = await http.post(f"{url}/v1/embeddings", json={"model": model, "input": "hello"})
    body = reply.json()
    if reply.status_code == 200:
        print(f"  POST /v1/embeddings (model {model}) -> {_show(body)}")
    else:
        print(f"  POST /v1/embeddings (model {model}) -> HTTP {reply.status_code} {body}")


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
