"""Every client revision the SDK serves, against an upstream of each protocol era, through /mcp.

Upstream ``old`` is ``tests/era_upstream.py`` on ``mcp`` 1.x (handshake eras only,
in its own venv); ``new`` is the same file on the gateway's ``mcp`` 2.x (2026-07-28).
What a client gets is compared with what a server of the client's own revision
would have sent it: the upstream's wire result written through the SDK's surface
for that revision.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp.client.session
import mcp_types as types
import pytest
from mcp import Client, MCPError
from mcp_types.methods import parse_server_result, serialize_server_result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import bind, running, serve_asgi
from tests.era_upstream import media_result
from tests.legacy_sdk import legacy_python
from tests.mcp_helpers import (
    ERA_UPSTREAM,
    EraServer,
    call,
    grow_and_hear_it,
    mcp_http_client,
    paginated_server,
    structured,
    until_connected,
    wait_until,
)

pytestmark = pytest.mark.anyio

CLIENT_ERAS = ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26"]
UPSTREAMS = {"old": ("2025-11-25", "era1"), "new": ("2026-07-28", "era2")}  # route prefix -> (era, scheme)


def upstream(python: str, *args: str) -> dict[str, Any]:
    return {"kind": "mcp", "command": python, "args": [ERA_UPSTREAM, *args], "restart_backoff_ms": 20,
            "limits": {"concurrency": 64}}


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    config = {"server": {"host": "127.0.0.1", "port": 0, "mcp": {"list_ttl_ms": 45_000}},
              "providers": {"old": upstream(legacy_python()), "new": upstream("python")},
              "routes": {"old_*": {"provider": "old"}, "new_*": {"provider": "new"}}}
    async with running(parse_config(config)) as (gw, url):
        await until_connected(gw, ["old", "new"])
        yield gw, url + "/mcp"


@asynccontextmanager
async def client_at(url: str, era: str, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> AsyncIterator[Client]:
    """The SDK's client speaking ``era``: 2026-07-28 by discovery, older ones by the handshake offer."""
    if era not in MODERN_PROTOCOL_VERSIONS:
        monkeypatch.setattr(mcp.client.session, "LATEST_HANDSHAKE_VERSION", era)
    async with mcp_http_client(url, "auto" if era in MODERN_PROTOCOL_VERSIONS else "legacy", **kw) as client:
        assert client.protocol_version == era
        yield client


def as_sent_to(era: str, method: str, wire: dict[str, Any]) -> dict[str, Any]:
    """What a server speaking ``era`` puts on the wire for this result, as the client parses it."""
    if era in MODERN_PROTOCOL_VERSIONS:
        wire = {**wire, "resultType": "complete"}
    parsed = parse_server_result(method, era, serialize_server_result(method, era, wire))
    return dump(parsed)


def dump(result: types.Result) -> dict[str, Any]:
    """A result as compared here: the gateway's own identity stamp is not the upstream's."""
    out = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    meta = {k: v for k, v in (out.pop("_meta", None) or {}).items() if k != types.SERVER_INFO_META_KEY}
    return {**out, **({"_meta": meta} if meta else {})}


PAIRS = [(client, up) for client in CLIENT_ERAS for up in UPSTREAMS]


async def test_the_upstreams_speak_different_eras(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    for prefix, (era, _) in UPSTREAMS.items():
        assert gw.providers[prefix].session.era == era  # type: ignore[attr-defined]
    assert structured(await call(gw, "old_sdk", {})) == {"result": "1"}
    assert structured(await call(gw, "new_sdk", {})) == {"result": "2"}


@pytest.mark.parametrize(("era", "up"), PAIRS)
async def test_tools(gateway: tuple[Gateway, str], era: str, up: str,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = gateway
    scheme = UPSTREAMS[up][1]
    async with client_at(url, era, monkeypatch) as client:
        listed = await client.list_tools()
        names = {t.name for t in listed.tools}
        assert {f"{up}_media", f"{up}_structured", f"{up}_broken", f"{up}_slow"} <= names
        if era in MODERN_PROTOCOL_VERSIONS:  # the gateway's hint: no upstream asked for less than config
            assert (listed.ttl_ms, listed.cache_scope) == (45_000, "public")

        media = await client.call_tool(f"{up}_media", {})
        assert dump(media) == as_sent_to(era, "tools/call", {**media_result(scheme), "isError": False})

        doubled = await client.call_tool(f"{up}_structured", {"n": 21})
        wire = {"content": [{"type": "text", "text": "42"}], "structuredContent": {"double": 42},
                "isError": False}
        assert dump(doubled) == as_sent_to(era, "tools/call", wire)
        if era != "2025-03-26":
            assert doubled.structured_content == {"double": 42}

        broken = await client.call_tool(f"{up}_broken", {})
        assert broken.is_error and broken.content[0].text == "it broke"  # type: ignore[union-attr]


@pytest.mark.parametrize(("era", "up"), PAIRS)
async def test_resources_and_prompts(gateway: tuple[Gateway, str], era: str, up: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = gateway
    scheme = UPSTREAMS[up][1]
    async with client_at(url, era, monkeypatch) as client:
        assert f"{scheme}://notes/1" in {str(r.uri) for r in (await client.list_resources()).resources}
        templates = (await client.list_resource_templates()).resource_templates
        assert scheme + "://items/{item_id}" in {t.uri_template for t in templates}
        read = await client.read_resource(f"{scheme}://notes/1")
        assert [c.text for c in read.contents] == ["first notes"]  # type: ignore[union-attr]
        item = await client.read_resource(f"{scheme}://items/7")
        assert [c.text for c in item.contents] == ["item 7"]  # type: ignore[union-attr]
        with pytest.raises(MCPError) as missing:
            await client.read_resource(f"{scheme}://nowhere")
        assert missing.value.code == (types.INVALID_PARAMS if era in MODERN_PROTOCOL_VERSIONS else -32002)

        assert f"{up}_ask" in {p.name for p in (await client.list_prompts()).prompts}
        prompt = await client.get_prompt(f"{up}_ask", {"topic": "eras"})
        assert [m.content.text for m in prompt.messages] == ["Tell me about eras."]  # type: ignore[union-attr]


@pytest.mark.parametrize(("era", "up"), PAIRS)
async def test_progress_and_cancellation(gateway: tuple[Gateway, str], era: str, up: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gw, url = gateway
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message))

    before = structured(await call(gw, f"{up}_counts", {}))
    async with client_at(url, era, monkeypatch) as client:
        done = await client.call_tool(f"{up}_slow", {"seconds": 0.02, "steps": 2}, progress_callback=progress)
        assert done.content[0].text == "done"  # type: ignore[union-attr]
        assert seen == [(1, 2, "step 1"), (2, 2, "step 2")]

        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call_tool, f"{up}_slow", {"seconds": 30})

            async def running() -> bool:
                return structured(await call(gw, f"{up}_counts", {}))["running"] == 1

            await wait_until(running)  # the upstream runs it: the cancel has to travel there
            tg.cancel_scope.cancel()

    async def cancelled_upstream() -> bool:
        return structured(await call(gw, f"{up}_counts", {})) == {
            "running": 0, "cancelled": before["cancelled"] + 1}

    await wait_until(cancelled_upstream)


@pytest.mark.parametrize(("era", "up"), PAIRS)
async def test_list_changes_reach_the_client(gateway: tuple[Gateway, str], era: str, up: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = gateway
    changed = anyio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with client_at(url, era, monkeypatch, message_handler=on_message) as client:
        grown = await grow_and_hear_it(client, changed, tool=f"{up}_grow")
        assert f"{up}_{grown}" in {t.name for t in (await client.list_tools()).tools}


# -- the era is probed, cached, and probed again ---------------------------------------
async def test_an_http_upstream_keeps_its_era_until_a_handshake_fails() -> None:
    old_python = legacy_python()
    server = EraServer()
    try:
        await server.start(sys.executable)  # 2026-07-28 first
        config = parse_config({
            "providers": {"up": {"kind": "mcp", "url": server.url, "restart_backoff_ms": 20}},
            "routes": {"up_*": {"provider": "up"}}})
        async with Gateway(config) as gw:
            session = gw.providers["up"].session  # type: ignore[attr-defined]
            assert (session.era, session.probes) == ("2026-07-28", 1)
            assert structured(await call(gw, "up_sdk", {})) == {"result": "2"}

            await server.start(old_python)  # the same address now speaks only the handshake eras
            generation = session.generation

            async def reconnected() -> bool:
                return session.generation > generation and session.connected

            sdk = await call(gw, "up_sdk", {})  # fails or finds the new server; either way a reconnect
            await wait_until(reconnected, timeout=30)
            assert (session.era, session.probes) == ("2025-11-25", 2)  # the pinned guess failed: probed
            assert structured(await call(gw, "up_sdk", {})) == {"result": "1"}
            del sdk

            await server.start(old_python)  # restarted, same build: the cached era holds, no probe
            generation = session.generation
            await call(gw, "up_sdk", {})
            await wait_until(reconnected, timeout=30)
            assert (session.era, session.probes) == ("2025-11-25", 2)
            assert structured(await call(gw, "up_sdk", {})) == {"result": "1"}
    finally:
        server.stop()


async def test_a_restarted_stdio_upstream_is_probed_again() -> None:
    config = parse_config({"providers": {"old": upstream(legacy_python())},
                           "routes": {"old_*": {"provider": "old"}}})
    async with Gateway(config) as gw:
        session = gw.providers["old"].session  # type: ignore[attr-defined]
        assert (session.era, session.probes) == ("2025-11-25", 1)
        generation = session.generation
        await call(gw, "old_crash", {})

        async def restarted() -> bool:
            return session.generation > generation and session.connected

        await wait_until(restarted, timeout=30)
        assert (session.era, session.probes) == ("2025-11-25", 2)  # a new process may be a new build
        assert structured(await call(gw, "old_sdk", {})) == {"result": "1"}


async def test_list_hints_are_the_upstreams_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream said its tools keep 60 s and its resources 30 s: a 2026 client hears no more than
    that (config says 120 s)."""
    sock = bind("127.0.0.1", 0)
    try:
        app = paginated_server(pages=1, per_page=2).streamable_http_app(streamable_http_path="/mcp")
        async with serve_asgi(app, sock, lifespan=True) as upstream_url:
            config = {"server": {"host": "127.0.0.1", "port": 0, "mcp": {"list_ttl_ms": 120_000}},
                      "providers": {"paged": {"kind": "mcp", "url": upstream_url + "/mcp"}},
                      "routes": {"paged_*": {"provider": "paged"}}}
            async with running(parse_config(config)) as (_, url), \
                    client_at(url + "/mcp", "2026-07-28", monkeypatch) as client:
                listed = await client.list_tools()
                assert listed.ttl_ms is not None and 50_000 < listed.ttl_ms <= 60_000
                assert [t.name for t in listed.tools] == ["paged_t0_0", "paged_t0_1"]
                resources = await client.list_resources()  # relayed live: the upstream's own hint
                assert (resources.ttl_ms, [str(r.uri) for r in resources.resources]) == (30_000, ["paged://notes"])
    finally:
        sock.close()


async def test_an_upstream_of_a_handshake_era_gives_no_list_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handshake eras have no ``ttlMs`` (the SDK reads its absence as 0): a 2026 client hears the
    config's hint for that upstream's resources, as for its tools, not "stale at once"."""
    sock = bind("127.0.0.1", 0)
    try:
        app = paginated_server(pages=1, per_page=2).streamable_http_app(streamable_http_path="/mcp")
        async with serve_asgi(app, sock, lifespan=True) as upstream_url:
            config = {"server": {"host": "127.0.0.1", "port": 0, "mcp": {"list_ttl_ms": 120_000}},
                      "providers": {"paged": {"kind": "mcp", "url": upstream_url + "/mcp",
                                              "protocol": "legacy"}},
                      "routes": {"paged_*": {"provider": "paged"}}}
            async with running(parse_config(config)) as (gw, url), \
                    client_at(url + "/mcp", "2026-07-28", monkeypatch) as client:
                assert gw.providers["paged"].session.era == "2025-11-25"  # type: ignore[attr-defined]
                assert (await client.list_tools()).ttl_ms == 120_000
                resources = await client.list_resources()
                assert (resources.ttl_ms, [str(r.uri) for r in resources.resources]) == (120_000, ["paged://notes"])
    finally:
        sock.close()
