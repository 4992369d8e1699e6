"""Upstream MCP servers (``kind: mcp``): two real upstreams, one stdio child and one over HTTP."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from multiplexer.core.call import Call
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code
from multiplexer.gateway.config import ConfigError, parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import bind, serve_asgi
from providers.mcp_transport import PACKAGES, McpSettings, stdio_parameters
from tests.mcp_helpers import (
    call,
    http_upstream,
    http_upstream_process,
    live_children,
    paginated_server,
    stdio_upstream,
    structured,
    upstream_pid,
    wait_until,
)

pytestmark = pytest.mark.anyio

TOOLS = {"echo", "add", "sleep", "stats", "fail", "pid", "grow", "grow_catalog", "record"}


@pytest.fixture(scope="module")
async def two_upstreams() -> AsyncIterator[Gateway]:
    """One gateway in front of a stdio child (``tools_*``) and an HTTP upstream (``demo_*``)."""
    before = live_children()
    async with http_upstream_process() as http:
        config = parse_config({
            "providers": {"tools": stdio_upstream(), "demo": http_upstream(http.url)},
            "routes": {"tools_*": {"provider": "tools"}, "demo_*": {"provider": "demo"}},
        })
        async with Gateway(config) as gateway:
            yield gateway
    assert live_children() <= before


async def test_tool_lists_are_aggregated_and_namespaced(two_upstreams: Gateway) -> None:
    names = {t.name for t in await two_upstreams.list_tools()}
    assert names == {f"tools_{t}" for t in TOOLS} | {f"demo_{t}" for t in TOOLS}
    add = next(t for t in await two_upstreams.list_tools() if t.name == "demo_add")
    assert add.description == "Adds two numbers"
    assert set(add.input_schema["properties"]) == {"a", "b"}
    assert add.annotations == {"readOnlyHint": True, "idempotentHint": True}


async def test_calls_reach_both_upstreams_and_return_their_call_tool_result(two_upstreams: Gateway) -> None:
    stdio = await call(two_upstreams, "tools_add", {"a": 2, "b": 40})
    http = await call(two_upstreams, "demo_echo", {"text": "over http"})
    # Era-free (no resultType): /rpc sees one shape whichever revision the upstream speaks.
    assert stdio.result == {"content": [{"type": "text", "text": "42"}],
                            "structuredContent": {"result": 42}, "isError": False}
    assert structured(http) == {"result": "over http"}
    failed = await call(two_upstreams, "demo_fail", {"message": "nope"})
    assert failed.ok and failed.result["isError"] is True
    assert "nope" in failed.result["content"][0]["text"]
    unknown = await call(two_upstreams, "tools_no_such_tool", {})
    assert unknown.ok and unknown.result["isError"] is True  # the upstream's own answer, passed on
    bad = await call(two_upstreams, "tools_echo", [1, 2])
    assert bad.error is not None and bad.error.code == Code.INVALID_PARAMS


async def test_200_concurrent_calls_share_one_upstream_session(two_upstreams: Gateway) -> None:
    provider: Any = two_upstreams.providers["tools"]
    pid = await upstream_pid(two_upstreams)
    connects = provider.session.connects
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        results[i] = await call(two_upstreams, "tools_add", {"a": i, "b": 1})

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert [structured(results[i])["result"] for i in range(200)] == [i + 1 for i in range(200)]
    assert provider.session.connects == connects  # no session per call
    assert await upstream_pid(two_upstreams) == pid
    assert len([p for p in psutil.Process().children(recursive=True)
                if "demo_tools.py" in " ".join(p.cmdline()) and "--http" not in p.cmdline()]) == 1


async def test_identical_calls_are_shared_only_for_read_only_or_idempotent_tools(
    two_upstreams: Gateway,
) -> None:
    registry = two_upstreams.metrics.registry

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    sent = sample("multiplexer_upstream_requests_total", provider="demo")
    joined = sample("multiplexer_dedup_hits_total", route="demo_*", kind="inflight")
    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(call, two_upstreams, "demo_echo", {"text": "same"})
    # echo is readOnlyHint: the 20 concurrent identical calls share one upstream call
    assert sample("multiplexer_upstream_requests_total", provider="demo") == sent + 1
    assert sample("multiplexer_dedup_hits_total", route="demo_*", kind="inflight") == joined + 19

    start = structured(await call(two_upstreams, "demo_stats", {}))["finished"]
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(call, two_upstreams, "demo_sleep", {"seconds": 0.05})
    assert structured(await call(two_upstreams, "demo_stats", {}))["finished"] == start + 3


async def test_progress_is_passed_through(two_upstreams: Gateway) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message))

    outcome = await call(two_upstreams, "demo_sleep", {"seconds": 0.02, "steps": 2},
                         progress=progress)
    assert structured(outcome) == {"result": "slept"}
    assert seen == [(1, 2, "step 1 of 2"), (2, 2, "step 2 of 2")]


async def test_progress_of_a_shared_call_reaches_every_caller_that_asked(two_upstreams: Gateway) -> None:
    seen: dict[str, list[float]] = {"a": [], "b": []}

    def sink(name: str):
        async def progress(value: float, total: float | None, message: str | None) -> None:
            seen[name].append(value)
        return progress

    before = structured(await call(two_upstreams, "demo_stats", {}))["finished"]
    args = {"seconds": 0.02, "steps": 3}
    calls = [Call("demo_sleep", args, idempotency_key="k1", progress=sink("a")),
             Call("demo_sleep", args, idempotency_key="k1"),  # shares it, asked for no progress
             Call("demo_sleep", args, idempotency_key="k1", progress=sink("b"))]
    outcomes = await two_upstreams.submit_many(calls)
    assert [structured(o) for o in outcomes] == [{"result": "slept"}] * 3
    assert structured(await call(two_upstreams, "demo_stats", {}))["finished"] == before + 1  # one run
    assert seen == {"a": [1, 2, 3], "b": [1, 2, 3]}


async def test_a_cancelled_call_cancels_the_upstream_request(two_upstreams: Gateway) -> None:
    for route in ("tools_", "demo_"):
        before = structured(await call(two_upstreams, route + "stats", {}))["cancelled"]
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, two_upstreams, route + "sleep", {"seconds": 30})

            async def running(route: str = route) -> bool:
                return structured(await call(two_upstreams, route + "stats", {}))["running"] == 1

            await wait_until(running)  # the upstream runs it: a cancel now has to travel there
            tg.cancel_scope.cancel()

        async def upstream_saw_cancel(route: str = route, before: int = before) -> bool:
            stats = structured(await call(two_upstreams, route + "stats", {}))
            return stats["cancelled"] == before + 1 and stats["running"] == 0

        await wait_until(upstream_saw_cancel)


async def test_timeout_at_the_gateway_cancels_upstream_too(two_upstreams: Gateway) -> None:
    before = structured(await call(two_upstreams, "tools_stats", {}))["cancelled"]
    outcome = await call(two_upstreams, "tools_sleep", {"seconds": 30}, timeout_ms=200)
    assert outcome.error is not None and outcome.error.code == Code.TIMEOUT

    async def cancelled() -> bool:
        return structured(await call(two_upstreams, "tools_stats", {}))["cancelled"] == before + 1

    await wait_until(cancelled)


async def test_killed_stdio_child_fails_in_flight_calls_clearly_and_recovers() -> None:
    before = live_children()
    config = parse_config({"providers": {"tools": stdio_upstream()},
                           "routes": {"tools_*": {"provider": "tools"}}})
    async with Gateway(config) as gateway:
        pid = await upstream_pid(gateway)
        results: dict[str, Any] = {}

        async def run(key: str, tool: str, args: dict[str, Any]) -> None:
            results[key] = await call(gateway, tool, args)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "sleep", "tools_sleep", {"seconds": 30})

            async def sleeping() -> bool:
                return structured(await call(gateway, "tools_stats", {}))["running"] == 1

            await wait_until(sleeping)
            os.kill(pid, signal.SIGKILL)
        error = results["sleep"].error
        assert error is not None and error.code == Code.UPSTREAM_UNAVAILABLE
        assert "lost while the call was in flight" in error.data["detail"]
        assert "not retried" in error.data["detail"]
        assert await upstream_pid(gateway) != pid  # waits for the restart
        assert pid not in live_children()
        assert structured(await call(gateway, "tools_echo", {"text": "back"})) == {"result": "back"}
    assert live_children() <= before


async def test_idempotent_call_caught_by_a_crash_is_retried_on_the_new_session() -> None:
    config = parse_config({
        "providers": {"tools": stdio_upstream(idempotent_tools=["sleep"])},
        "routes": {"tools_*": {"provider": "tools"}},
    })
    async with Gateway(config) as gateway:
        pid = await upstream_pid(gateway)
        results: dict[str, Any] = {}

        async def run() -> None:
            results["sleep"] = await call(gateway, "tools_sleep", {"seconds": 0.5})

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)

            async def sleeping() -> bool:
                return structured(await call(gateway, "tools_stats", {}))["running"] == 1

            await wait_until(sleeping)
            os.kill(pid, signal.SIGKILL)
        assert structured(results["sleep"]) == {"result": "slept"}
        assert gateway.providers["tools"].session.connects == 2  # type: ignore[attr-defined]


async def test_lost_http_session_is_reinitialised() -> None:
    async with http_upstream_process() as http:
        config = parse_config({"providers": {"demo": http_upstream(http.url, protocol="legacy")},
                               "routes": {"demo_*": {"provider": "demo"}}})
        async with Gateway(config) as gateway:
            session: Any = gateway.providers["demo"].session
            assert session.protocol_version == "2025-11-25"
            assert structured(await call(gateway, "demo_add", {"a": 1, "b": 1})) == {"result": 2}
            http.stop()
            await http.start()  # same port, new process: our session id is unknown there
            # sleep is not idempotent, but a 404 means it never ran: safe to send again.
            assert structured(await call(gateway, "demo_sleep", {"seconds": 0})) == {"result": "slept"}
            assert session.connects == 2


async def test_http_upstream_that_is_down_gives_a_clear_error_then_recovers() -> None:
    async with http_upstream_process() as http:
        config = parse_config({"providers": {"demo": http_upstream(http.url)},
                               "routes": {"demo_*": {"provider": "demo"}}})
        async with Gateway(config) as gateway:
            http.stop()
            outcome = await call(gateway, "demo_echo", {"text": "x"})
            assert outcome.error is not None and outcome.error.code == Code.UPSTREAM_UNAVAILABLE
            await http.start()
            assert structured(await call(gateway, "demo_echo", {"text": "y"})) == {"result": "y"}


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
async def test_list_changed_refreshes_the_list_and_is_announced(protocol: str) -> None:
    """2026-07-28 upstreams announce on a listen stream, handshake-era ones in-band."""
    config = parse_config({"providers": {"tools": stdio_upstream(protocol=protocol)},
                           "routes": {"tools_*": {"provider": "tools"}}})
    async with Gateway(config) as gateway:
        events: list[dict[str, Any]] = []
        changed = anyio.Event()

        def listener(event: str, data: dict[str, Any]) -> None:
            events.append(data)
            changed.set()

        gateway.listeners.append(listener)
        assert "tools_shout" not in {t.name for t in await gateway.list_tools()}
        await call(gateway, "tools_grow", {})
        with anyio.fail_after(10):
            await changed.wait()
        assert events[-1]["provider"] == "tools" and "shout" in events[-1]["tools"]
        assert "tools_shout" in {t.name for t in await gateway.list_tools()}
        assert structured(await call(gateway, "tools_shout", {"text": "hi"})) == {"result": "HI"}


async def test_pagination_is_followed_up_to_the_page_cap() -> None:
    server = paginated_server(pages=5, per_page=2)
    app = server.streamable_http_app(streamable_http_path="/mcp")
    sock = bind("127.0.0.1", 0)
    try:
        async with serve_asgi(app, sock, lifespan=True) as url:
            for cap, expected in ((10, 10), (3, 6)):
                config = parse_config({
                    "providers": {"paged": http_upstream(url + "/mcp", max_pages=cap,
                                                         headers={"X-Team": "blue"})},
                    "routes": {"paged_*": {"provider": "paged"}},
                })
                clock = ManualClock()
                async with Gateway(config, clock=clock) as gateway:
                    names = [t.name for t in await gateway.list_tools()]
                    assert len(names) == expected and names[0] == "paged_t0_0"
                    listed = server.calls["list"]  # type: ignore[attr-defined]
                    await clock.advance(59)
                    await gateway.list_tools()  # ttlMs says the listing is still fresh
                    assert server.calls["list"] == listed  # type: ignore[attr-defined]
                    await clock.advance(1)  # on the gateway's clock, the upstream's 60 s are up
                    await gateway.list_tools()
                    assert server.calls["list"] == listed + expected // 2  # type: ignore[attr-defined]
                    outcome = await call(gateway, "paged_t1_1", {})
                    assert outcome.result["content"][0]["text"] == "t1_1"
            assert server.calls["x-team"] == {"blue"}  # type: ignore[attr-defined]
    finally:
        sock.close()


async def test_an_upstream_that_cannot_start_gives_a_clear_error() -> None:
    config = parse_config({
        "providers": {"gone": stdio_upstream(command="/nonexistent/mcp-server", args=[])},
        "routes": {"gone_*": {"provider": "gone"}, "gone_exact": {"provider": "gone", "method": "x"}},
    })
    async with Gateway(config) as gateway:
        assert [t.name for t in await gateway.list_tools()] == ["gone_exact"]
        outcome = await call(gateway, "gone_x", {})
        assert outcome.error is not None and outcome.error.code == Code.UPSTREAM_UNAVAILABLE
        assert "FileNotFoundError" in outcome.error.data["detail"]


def test_settings_need_exactly_one_transport() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        parse_config({"providers": {"x": {"kind": "mcp", "command": "a", "url": "http://b"}}})
    with pytest.raises(ConfigError, match="exactly one"):
        parse_config({"providers": {"x": {"kind": "mcp"}}})


def test_stdio_child_gets_python_resolved_and_an_allow_listed_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MUX_SECRET", "s3cret")
    monkeypatch.setenv("MUX_ALLOWED", "yes")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    params = stdio_parameters(McpSettings(command="python", args=["x.py"], env=["MUX_ALLOWED"],
                                          cwd="/tmp"))
    assert params.command == sys.executable and params.args == ["x.py"] and params.cwd == "/tmp"
    # the folder this gateway's own packages come from goes with it: `-m multiplexer...` imports
    assert params.env == {"MUX_ALLOWED": "yes", "PYTHONPATH": PACKAGES}
    assert Path(PACKAGES, "multiplexer", "__init__.py").is_file()
    monkeypatch.setenv("PYTHONPATH", "/opt/site")  # this interpreter's import path goes with it
    assert stdio_parameters(McpSettings(command="python3", args=["x.py"])).env == {
        "PYTHONPATH": f"/opt/site{os.pathsep}{PACKAGES}"}
    assert stdio_parameters(McpSettings(command="python", env={"PYTHONPATH": "/own"})).env == {
        "PYTHONPATH": f"/own{os.pathsep}{PACKAGES}"}  # a route's own comes first
    explicit = stdio_parameters(McpSettings(command="node", env={"TOKEN": "t"}))
    assert explicit.command == "node" and explicit.env == {"TOKEN": "t"}  # not a Python child
