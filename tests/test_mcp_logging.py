"""Upstream log messages (``notifications/message``) reach the MCP client whose call made them.

Upstreams: ``tests/era_upstream.py`` on ``mcp`` 1.x (handshake eras only; it honours
``logging/setLevel``) and on 2.x (2026-07-28: the level rides each request), each
over stdio and over Streamable HTTP. Clients: the SDK's, in every revision it
speaks, over HTTP and (against a ``serve --stdio`` gateway) over stdio.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import mcp.client.session
import mcp_types as types
import pytest
import yaml
from mcp import Client, StdioServerParameters
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from multiplexer.core.logs import LogFanout, LogSink, rank
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.legacy_sdk import legacy_python
from tests.mcp_helpers import (
    ERA_UPSTREAM,
    MODES,
    ROOT,
    EraServer,
    mcp_http_client,
    until_connected,
    wait_until,
)

pytestmark = pytest.mark.anyio

CLIENT_ERAS = ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26"]
# route prefix -> (SDK major of the upstream, transport)
UPSTREAMS = {"old": ("1", "stdio"), "new": ("2", "stdio"), "oldh": ("1", "http"), "newh": ("2", "http")}
Seen = list[tuple[str, Any, str | None]]


def stdio(python: str) -> dict[str, Any]:
    return {"kind": "mcp", "command": python, "args": [ERA_UPSTREAM], "restart_backoff_ms": 20,
            "idempotent_tools": ["held"], "limits": {"concurrency": 64}}


def http(url: str) -> dict[str, Any]:
    return {"kind": "mcp", "url": url, "restart_backoff_ms": 20, "idempotent_tools": ["held"],
            "limits": {"concurrency": 64}}


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    old_python = legacy_python()
    servers = {"oldh": EraServer(), "newh": EraServer()}
    try:
        await servers["oldh"].start(old_python)
        await servers["newh"].start(sys.executable)
        config = {"server": {"host": "127.0.0.1", "port": 0},
                  "providers": {"old": stdio(old_python), "new": stdio("python"),
                                "oldh": http(servers["oldh"].url), "newh": http(servers["newh"].url)},
                  "routes": {f"{name}_*": {"provider": name} for name in UPSTREAMS}}
        async with running(parse_config(config)) as (gw, url):
            await until_connected(gw, UPSTREAMS)
            for name, (major, _) in UPSTREAMS.items():
                era = gw.providers[name].session.era  # type: ignore[attr-defined]
                assert era == ("2025-11-25" if major == "1" else "2026-07-28")
            yield gw, url + "/mcp"
    finally:
        for server in servers.values():
            server.stop()


class Recorder:
    """A client's ``logging_callback``: what arrived, and an event per message text."""

    def __init__(self) -> None:
        self.seen: Seen = []
        self._waiting: dict[str, anyio.Event] = {}

    async def __call__(self, params: types.LoggingMessageNotificationParams) -> None:
        self.seen.append((params.level, params.data, params.logger))
        if (event := self._waiting.get(str(params.data))) is not None:
            event.set()

    async def wait_for(self, data: str) -> None:
        if any(d == data for _, d, _ in self.seen):
            return
        event = self._waiting.setdefault(data, anyio.Event())
        with anyio.fail_after(10):
            await event.wait()


def client_at(url: str, era: str, monkeypatch: pytest.MonkeyPatch, log_level: str | None = None,
              **kw: Any) -> Any:
    if era not in MODERN_PROTOCOL_VERSIONS:
        monkeypatch.setattr(mcp.client.session, "LATEST_HANDSHAKE_VERSION", era)
        return mcp_http_client(url, "legacy", **kw)
    return mcp_http_client(url, "auto", log_level=log_level, **kw)


def chatty(tag: str, *levels: str) -> Seen:
    """What ``chatty`` logs, at the given levels."""
    return [(level, f"{tag} {level}", "era") for level in levels]


def text(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent)
    return first.text


PAIRS = [(era, up) for era in CLIENT_ERAS for up in UPSTREAMS]


@pytest.mark.parametrize(("era", "up"), PAIRS)
async def test_logs_reach_the_caller_at_the_level_it_asked(gateway: tuple[Gateway, str], era: str, up: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = gateway
    major = UPSTREAMS[up][0]
    asked, plain = Recorder(), Recorder()
    if era in MODERN_PROTOCOL_VERSIONS:
        async with client_at(url, era, monkeypatch, "warning", logging_callback=asked) as client:
            assert client.protocol_version == era
            level = text(await client.call_tool(f"{up}_chatty", {"tag": "w"}))
        assert asked.seen == chatty("w", "warning", "error")
        if major == "2":  # the gateway put the caller's level on the upstream request
            assert level == "warning"
        else:  # one level per handshake connection: at least as verbose as this caller's
            assert rank(level) <= rank("warning")

        async with client_at(url, era, monkeypatch, logging_callback=plain) as client:
            level = text(await client.call_tool(f"{up}_chatty", {"tag": "n"}))
        assert plain.seen == []  # no level asked, no log messages
        if major == "2":
            assert level == "none"  # nor asked of the upstream
    else:
        async with client_at(url, era, monkeypatch, logging_callback=asked) as client:
            assert client.protocol_version == era
            await client.call_tool(f"{up}_chatty", {"tag": "d"})  # no logging/setLevel: every level
            await client.set_logging_level("warning")  # type: ignore[attr-defined]
            level = text(await client.call_tool(f"{up}_chatty", {"tag": "w"}))
        every = chatty("d", "debug", "info", "warning", "error")
        assert asked.seen == every + chatty("w", "warning", "error")
        if major == "2":  # the connection's level, put on the upstream request
            assert level == "warning"
        else:
            assert rank(level) <= rank("warning")


@pytest.mark.parametrize("up", UPSTREAMS)
async def test_callers_sharing_one_execution_each_get_its_logs(gateway: tuple[Gateway, str], up: str,
                                                               tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The second identical call joins the first's upstream run and hears its logs from then on."""
    gw, url = gateway
    release = tmp_path / "release"
    args = {"tag": f"shared-{up}", "path": str(release)}
    first, second = Recorder(), Recorder()
    joined = gw.metrics.dedup_hits.labels(f"{up}_*", "inflight")
    before = joined._value.get()

    async def has_joined() -> bool:
        return joined._value.get() == before + 1

    async with client_at(url, "2026-07-28", monkeypatch, "info", logging_callback=first) as one, \
            client_at(url, "2025-11-25", monkeypatch, logging_callback=second) as two, \
            anyio.create_task_group() as tg:
        tg.start_soon(one.call_tool, f"{up}_held", args)
        await first.wait_for(f"shared-{up} start")
        tg.start_soon(two.call_tool, f"{up}_held", args)
        await wait_until(has_joined)
        release.touch()
    assert first.seen == [("info", f"shared-{up} start", "era"), ("warning", f"shared-{up} end", "era")]
    assert second.seen == [("warning", f"shared-{up} end", "era")]


@pytest.mark.parametrize("up", UPSTREAMS)
async def test_concurrent_calls_never_get_each_others_logs(gateway: tuple[Gateway, str], up: str,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP each log travels on its call's stream. Over stdio nothing says whose it is: a
    message is delivered only while one call that may log is in flight, else dropped."""
    gw, url = gateway
    a_done, b_done = tmp_path / "a", tmp_path / "b"
    a, b = Recorder(), Recorder()
    dropped = gw.metrics.events.labels(f"mcp:{up}", "log_dropped")
    before = dropped._value.get()
    on_stdio = UPSTREAMS[up][1] == "stdio"

    async def dropped_now(n: int) -> None:
        async def reached() -> bool:
            return dropped._value.get() == before + n

        await wait_until(reached)

    async with client_at(url, "2026-07-28", monkeypatch, "info", logging_callback=a) as ca, \
            client_at(url, "2026-07-28", monkeypatch, "info", logging_callback=b) as cb, \
            anyio.create_task_group() as tg:
        a_returned = anyio.Event()

        async def call_a() -> None:
            await ca.call_tool(f"{up}_held", {"tag": "a", "path": str(a_done)})
            a_returned.set()

        tg.start_soon(call_a)
        await a.wait_for("a start")  # alone in flight: delivered
        tg.start_soon(cb.call_tool, f"{up}_held", {"tag": "b", "path": str(b_done)})
        if on_stdio:
            await dropped_now(1)  # "b start", with both in flight
        else:
            await b.wait_for("b start")
        a_done.touch()
        with anyio.fail_after(10):
            await a_returned.wait()
        if on_stdio:  # "a end" came before a's reply, with b still in flight
            assert dropped._value.get() == before + 2
        b_done.touch()
    if on_stdio:
        assert (a.seen, b.seen) == ([("info", "a start", "era")], [("warning", "b end", "era")])
    else:
        assert a.seen == [("info", "a start", "era"), ("warning", "a end", "era")]
        assert b.seen == [("info", "b start", "era"), ("warning", "b end", "era")]
        assert dropped._value.get() == before


# -- a stdio client: the gateway as ``multiplexer serve --stdio`` -------------------------
@pytest.fixture
def stdio_gateway(tmp_path: Path) -> StdioServerParameters:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {"old": stdio(legacy_python()), "new": stdio(sys.executable)},
        "routes": {"old_*": {"provider": "old"}, "new_*": {"provider": "new"}},
        "store": {"path": str(tmp_path / "store.db")},
    }))
    return StdioServerParameters(command=sys.executable,
                                 args=["-m", "multiplexer", "serve", "--stdio", "--config", str(path)],
                                 cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("mode", MODES)
async def test_stdio_clients_get_their_calls_logs(stdio_gateway: StdioServerParameters, mode: str) -> None:
    """Each client session (one gateway process) calls both upstreams: ``old`` then ``new``."""
    ups = ("old", "new")
    asked, plain = Recorder(), Recorder()
    if mode == "auto":  # 2026-07-28
        async with Client(stdio_gateway, mode=mode, log_level="error", logging_callback=asked) as client:
            assert client.protocol_version == "2026-07-28"
            for up in ups:
                await client.call_tool(f"{up}_chatty", {"tag": up})
        async with Client(stdio_gateway, mode=mode, logging_callback=plain) as client:
            for up in ups:
                await client.call_tool(f"{up}_chatty", {"tag": up})
        assert (asked.seen, plain.seen) == (chatty("old", "error") + chatty("new", "error"), [])
    else:
        async with Client(stdio_gateway, mode=mode, logging_callback=asked) as client:
            for up in ups:  # no level asked yet: everything
                await client.call_tool(f"{up}_chatty", {"tag": "all"})
            await client.set_logging_level("error")  # type: ignore[attr-defined]
            for up in ups:
                await client.call_tool(f"{up}_chatty", {"tag": up})
        every = chatty("all", "debug", "info", "warning", "error")
        assert asked.seen == every + every + chatty("old", "error") + chatty("new", "error")


async def test_a_fanout_filters_per_caller_and_drops_a_caller_that_left() -> None:
    got: list[tuple[str, Any]] = []

    async def deliver(level: str, data: Any, logger: str | None) -> None:
        got.append((level, data))

    async def gone(level: str, data: Any, logger: str | None) -> None:
        raise anyio.BrokenResourceError

    warning, left, debug = LogSink("warning", deliver), LogSink("info", gone), LogSink("debug", deliver)
    fanout = LogFanout([warning, left])
    assert fanout.level == "info"  # what the upstream is asked for: the most verbose wish
    fanout.add(debug)
    assert fanout.level == "debug"
    await fanout("info", "i", None)
    assert got == [("info", "i")] and fanout.sinks == [warning, debug]
    await fanout("error", "e", "x")
    assert got == [("info", "i"), ("error", "e"), ("error", "e")]
    fanout.remove(debug)
    fanout.remove(warning)
    assert fanout.level is None  # nobody asks: the upstream is asked for none
