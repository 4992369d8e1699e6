"""Upstream resources and prompts through the gateway's MCP face, over Streamable HTTP and stdio.

Two copies of ``multiplexer/defaults/demo_tools.py`` sit behind ``tools_*`` and ``more_*``: their
prompts appear under both prefixes, and the resource URI both list is served by the first.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
import yaml
from mcp import Client, MCPError, StdioServerParameters
from mcp.server import Server

from multiplexer.core.errors import Code
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import bind, running, serve_asgi
from tests.mcp_helpers import (
    MODES,
    ROOT,
    UPSTREAM,
    http_upstream,
    live_children,
    mcp_http_client,
    stdio_upstream,
    upstream_pid,
)

pytestmark = pytest.mark.anyio

README = "example://readme"
ITEMS = "example://items/{item_id}"
GREETING = "Hello, Ada! Say something nice."


def two_upstreams() -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "providers": {"tools": stdio_upstream(), "more": stdio_upstream(), "builtin": {"kind": "echo"}},
        "routes": {"tools_*": {"provider": "tools"}, "more_*": {"provider": "more"},
                   "echo": {"provider": "builtin"}},
    }


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    before = live_children()
    async with running(parse_config(two_upstreams())) as (gw, url):
        yield gw, url + "/mcp"
    assert live_children() <= before


def text_of(result: types.ReadResourceResult) -> str:
    assert len(result.contents) == 1
    content = result.contents[0]
    assert isinstance(content, types.TextResourceContents)
    return content.text


async def assert_greets(client: Client, prompt: str) -> None:
    result = await client.get_prompt(prompt, {"name": "Ada"})
    assert result.description == "Greets someone by name"
    assert [(m.role, m.content.type) for m in result.messages] == [("user", "text")]
    assert result.messages[0].content.text == GREETING  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", MODES)
async def test_listings_are_merged_and_prompts_prefixed(gateway: tuple[Gateway, str], mode: str) -> None:
    _, url = gateway
    async with mcp_http_client(url, mode) as client:
        assert client.protocol_version == MODES[mode]
        caps = client.server_capabilities
        assert caps.resources is not None and caps.prompts is not None and caps.tools is not None
        assert caps.resources.list_changed and caps.prompts.list_changed  # forwarded
        assert not caps.resources.subscribe  # resource subscriptions are not
        resources = (await client.list_resources()).resources
        assert [(r.uri, r.name, r.mime_type) for r in resources] == [(README, "readme", "text/plain")]
        templates = (await client.list_resource_templates()).resource_templates
        assert [(t.uri_template, t.name, t.mime_type) for t in templates] == [
            (ITEMS, "item", "application/json")]
        prompts = (await client.list_prompts()).prompts
        assert [p.name for p in prompts] == ["tools_greet", "more_greet"]
        assert [(a.name, a.required) for a in prompts[1].arguments or []] == [("name", True)]
        assert {"tools_echo", "more_echo", "echo"} <= {t.name for t in (await client.list_tools()).tools}


@pytest.mark.parametrize("mode", MODES)
async def test_reads_and_prompts_reach_their_upstream(gateway: tuple[Gateway, str], mode: str) -> None:
    gw, url = gateway
    first = await upstream_pid(gw, "tools_pid")
    async with mcp_http_client(url, mode) as client:
        await client.list_resources()
        readme = await client.read_resource(README, cache_mode="bypass")
        assert text_of(readme) == f"upstream-example, pid {first}"  # both list it: the first serves it
        assert readme.contents[0].uri == README and readme.contents[0].mime_type == "text/plain"
        item = await client.read_resource("example://items/42", cache_mode="bypass")
        assert json.loads(text_of(item)) == {"id": "42", "label": "item 42"}
        assert item.contents[0].uri == "example://items/42"
        assert item.contents[0].mime_type == "application/json"
        await assert_greets(client, "tools_greet")
        await assert_greets(client, "more_greet")


@pytest.mark.parametrize("mode", MODES)
async def test_resource_and_prompt_list_changes_reach_connected_clients(mode: str) -> None:
    heard: dict[str, anyio.Event] = {"resources": anyio.Event(), "prompts": anyio.Event()}

    async def on_message(message: Any) -> None:  # handshake-era clients hear it in band
        if isinstance(message, types.ResourceListChangedNotification):
            heard["resources"].set()
        elif isinstance(message, types.PromptListChangedNotification):
            heard["prompts"].set()

    async with (
        running(parse_config(two_upstreams())) as (_, base),  # its own upstreams: this test grows one
        mcp_http_client(base + "/mcp", mode, message_handler=on_message) as client,
    ):
        assert "more_farewell" not in {p.name for p in (await client.list_prompts()).prompts}
        if client.protocol_version == "2026-07-28":
            async with client.listen(resources_list_changed=True, prompts_list_changed=True) as events:
                await client.call_tool("more_grow_catalog", {})
                with anyio.fail_after(10):
                    async for event in events:
                        heard["resources" if "Resources" in type(event).__name__ else "prompts"].set()
                        if all(e.is_set() for e in heard.values()):
                            break
        else:
            await client.call_tool("more_grow_catalog", {})
            with anyio.fail_after(10):
                for event in heard.values():
                    await event.wait()
        resources = (await client.list_resources(cache_mode="bypass")).resources
        prompts = (await client.list_prompts(cache_mode="bypass")).prompts
        assert "example://news" in {str(r.uri) for r in resources}
        names = {p.name for p in prompts}
        assert "more_farewell" in names and "tools_farewell" not in names
        news = await client.read_resource("example://news", cache_mode="bypass")
        assert text_of(news) == "the catalog grew"
        bye = await client.get_prompt("more_farewell", {"name": "Ada"})
        assert bye.messages[0].content.text == "Goodbye, Ada."  # type: ignore[union-attr]


async def test_a_duplicate_uri_read_before_any_listing_goes_to_the_first_upstream() -> None:
    async with running(parse_config(two_upstreams())) as (gw, base):
        first, second = await upstream_pid(gw, "tools_pid"), await upstream_pid(gw, "more_pid")
        assert first != second
        async with mcp_http_client(base + "/mcp") as client:
            assert text_of(await client.read_resource(README)) == f"upstream-example, pid {first}"


@pytest.mark.parametrize("mode", MODES)
async def test_unknown_resources_and_prompts_are_mcp_errors(gateway: tuple[Gateway, str], mode: str) -> None:
    _, url = gateway
    async with mcp_http_client(url, mode) as client:
        with pytest.raises(MCPError) as unknown_uri:
            await client.read_resource("example://nope")
        # "Not found" in the client's revision: -32602 since 2026-07-28, -32002 before.
        assert unknown_uri.value.code == (types.INVALID_PARAMS if mode == "auto" else -32002)
        assert unknown_uri.value.message == "Unknown resource: example://nope"
        assert unknown_uri.value.data == {"uri": "example://nope"}

        with pytest.raises(MCPError) as no_route:
            await client.get_prompt("nobody_greet", {"name": "Ada"})
        assert no_route.value.code == types.INVALID_PARAMS
        assert no_route.value.message == "Unknown prompt: nobody_greet"

        # The upstream's own answers, passed on as it sent them (the SDK's MCPServer hides the detail).
        with pytest.raises(MCPError) as unknown_prompt:
            await client.get_prompt("tools_nope", {})
        assert (unknown_prompt.value.code, unknown_prompt.value.message) == (
            types.INTERNAL_ERROR, "Internal server error")
        with pytest.raises(MCPError) as missing_argument:
            await client.get_prompt("more_greet", {})
        assert missing_argument.value.code == types.INTERNAL_ERROR


def paged_server(seen: list[str]) -> Server[Any]:
    """A low-level upstream without prompts: resources over three pages, templates on a cursor cycle."""

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool(name="noop", input_schema={"type": "object"})])

    async def list_resources(ctx: Any, params: types.PaginatedRequestParams | None
                             ) -> types.ListResourcesResult:
        page = int(params.cursor) if params and params.cursor else 0
        return types.ListResourcesResult(resources=[types.Resource(name=f"r{page}", uri=f"paged://r/{page}")],
                                         next_cursor=str(page + 1) if page < 2 else None)

    async def list_templates(ctx: Any, params: types.PaginatedRequestParams | None
                             ) -> types.ListResourceTemplatesResult:
        cursor = params.cursor if params and params.cursor else "first"
        template = types.ResourceTemplate(name=cursor, uri_template=f"paged://t/{cursor}/{{id}}")
        return types.ListResourceTemplatesResult(resource_templates=[template], next_cursor="again")

    async def read_resource(ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        if not uri.startswith("paged://r/"):
            raise MCPError(types.INVALID_PARAMS, f"no such resource here: {uri}")
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, text=f"paged {uri}")])

    async def record(ctx: Any, call_next: Any) -> Any:
        seen.append(ctx.method)
        return await call_next(ctx)

    server: Server[Any] = Server("paged", on_list_tools=list_tools, on_list_resources=list_resources,
                                 on_list_resource_templates=list_templates, on_read_resource=read_resource)
    server.middleware.append(record)
    return server


async def test_pages_capabilities_and_route_order_across_upstreams() -> None:
    seen: list[str] = []
    app = paged_server(seen).streamable_http_app(streamable_http_path="/mcp")
    sock = bind("127.0.0.1", 0)
    try:
        async with serve_asgi(app, sock, lifespan=True) as upstream:
            config = parse_config({
                "server": {"host": "127.0.0.1", "port": 0},
                "providers": {"paged": http_upstream(upstream + "/mcp"), "tools": stdio_upstream()},
                "routes": {"paged_*": {"provider": "paged"}, "tools_*": {"provider": "tools"}},
            })
            async with running(config) as (_, base), mcp_http_client(base + "/mcp") as client:
                resources = (await client.list_resources()).resources
                assert [r.uri for r in resources] == ["paged://r/0", "paged://r/1", "paged://r/2", README]
                templates = (await client.list_resource_templates()).resource_templates
                assert [t.uri_template for t in templates] == [  # the cycle ends the paging
                    "paged://t/first/{id}", "paged://t/again/{id}", ITEMS]
                assert seen.count("resources/templates/list") == 2
                assert [p.name for p in (await client.list_prompts()).prompts] == ["tools_greet"]

                assert text_of(await client.read_resource("paged://r/1")) == "paged paged://r/1"
                reads = seen.count("resources/read")
                item = await client.read_resource("example://items/7")  # paged is asked first, then tools
                assert json.loads(text_of(item))["id"] == "7" and seen.count("resources/read") == reads + 1

                with pytest.raises(MCPError) as no_prompts:
                    await client.get_prompt("paged_greet", {"name": "Ada"})
                assert no_prompts.value.code == types.INVALID_PARAMS
                assert "prompts/list" not in seen and "prompts/get" not in seen  # not advertised: not asked
    finally:
        sock.close()


@pytest.mark.parametrize("mode", MODES)
async def test_an_upstream_that_is_down_gives_upstream_unavailable(mode: str) -> None:
    config = parse_config({
        "server": {"host": "127.0.0.1", "port": 0},
        "providers": {"gone": stdio_upstream(command="/nonexistent/mcp-server", args=[]),
                      "tools": stdio_upstream()},
        "routes": {"gone_*": {"provider": "gone"}, "tools_*": {"provider": "tools"}},
    })
    async with running(config) as (_, base), mcp_http_client(base + "/mcp", mode) as client:
        # Listings leave the broken upstream out; reads it cannot answer still reach the next one.
        assert [r.uri for r in (await client.list_resources()).resources] == [README]
        assert [p.name for p in (await client.list_prompts()).prompts] == ["tools_greet"]
        assert json.loads(text_of(await client.read_resource("example://items/1")))["id"] == "1"
        with pytest.raises(MCPError) as prompt:
            await client.get_prompt("gone_greet", {"name": "Ada"})
        assert prompt.value.code == Code.UPSTREAM_UNAVAILABLE
        assert prompt.value.message == "Upstream unavailable"
        assert prompt.value.data["provider"] == "gone"
        with pytest.raises(MCPError) as read:  # tools has no such URI, but gone might have: not "unknown"
            await client.read_resource("example://nope")
        assert read.value.code == Code.UPSTREAM_UNAVAILABLE and read.value.data["provider"] == "gone"


@pytest.mark.parametrize("mode", MODES)
async def test_stdio_gateway_lists_reads_and_gets(tmp_path: Path, mode: str) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "providers": {"tools": {"kind": "mcp", "command": "python", "args": [UPSTREAM]}},
        "routes": {"tools_*": {"provider": "tools"}},
        "store": {"path": str(tmp_path / "store.db")},
    }))
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "multiplexer", "serve", "--stdio", "--config", str(config)],
                                   cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)})
    async with Client(params, mode=mode) as client:
        assert client.protocol_version == MODES[mode]
        assert [r.uri for r in (await client.list_resources()).resources] == [README]
        templates = (await client.list_resource_templates()).resource_templates
        assert [t.uri_template for t in templates] == [ITEMS]
        assert [p.name for p in (await client.list_prompts()).prompts] == ["tools_greet"]
        assert text_of(await client.read_resource(README)).startswith("upstream-example, pid ")
        item = await client.read_resource("example://items/abc")
        assert json.loads(text_of(item)) == {"id": "abc", "label": "item abc"}
        await assert_greets(client, "tools_greet")
        with pytest.raises(MCPError) as unknown:
            await client.read_resource("example://nope")
        assert unknown.value.code == (types.INVALID_PARAMS if mode == "auto" else -32002)
        assert "example://nope" in unknown.value.message


async def test_reads_and_prompt_gets_count_against_the_callers_quota() -> None:
    """They skip the lanes but not the key's quota: a key cannot read its way past its rpm."""
    config = two_upstreams()
    config["server"].update(api_keys={"alice": "key-a", "bob": "key-b"}, quotas={"alice": {"rpm": 3}})
    async with running(parse_config(config)) as (_, base):
        async with mcp_http_client(base + "/mcp", key="key-a") as alice:
            await alice.list_resources(cache_mode="bypass")
            await alice.read_resource(README, cache_mode="bypass")
            await assert_greets(alice, "tools_greet")
            with pytest.raises(MCPError) as refused:
                await alice.read_resource(README, cache_mode="bypass")
        async with mcp_http_client(base + "/mcp", key="key-b") as bob:  # another key is not held back
            read = await bob.read_resource(README, cache_mode="bypass")
        assert text_of(read).startswith("upstream-example")
    assert refused.value.error.code == Code.RATE_LIMITED
    assert refused.value.error.data["limit"] == "rpm" and refused.value.error.data["retry_after"] > 0
