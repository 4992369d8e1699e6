"""An upstream's questions during a call reach the one client that made it (issue 54, part 1).

Upstream: ``tests/asking_upstream.py`` (``mcp`` 2.x), whose tools elicit (form and URL),
sample and list roots; as ``up`` it speaks 2026-07-28 (``input_required`` results), as
``leg`` it is held to the handshake era (requests pushed mid-call). Clients: the SDK's,
2026-07-28 and 2025-11-25, over the HTTP face.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
import yaml
from mcp import Client, MCPError, StdioServerParameters

from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import ROOT, free_port, mcp_http_client, until_connected, wait_listening, wait_until

pytestmark = pytest.mark.anyio

ASKING = str(ROOT / "tests" / "asking_upstream.py")
UPSTREAMS = {"up": "auto", "leg": "legacy"}  # route prefix -> the upstream's era (protocol)
MODES = ["auto", "legacy"]  # the client's: 2026-07-28, 2025-11-25


def upstream(protocol: str) -> dict[str, Any]:
    return {"kind": "mcp", "command": sys.executable, "args": [ASKING], "protocol": protocol,
            "restart_backoff_ms": 20, "limits": {"concurrency": 16}}


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[tuple[Gateway, str]]:
    config = {"server": {"host": "127.0.0.1", "port": 0, "mcp": {"ask_timeout_s": 5}},
              "providers": {name: upstream(protocol) for name, protocol in UPSTREAMS.items()},
              "routes": {f"{name}_*": {"provider": name, "timeout_ms": 20_000} for name in UPSTREAMS}}
    async with running(parse_config(config)) as (gw, url):
        await until_connected(gw, UPSTREAMS)
        yield gw, url + "/mcp"


class Answers:
    """A client's callbacks: each question it was asked, and a fixed answer to each."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.asked: list[str] = []
        self.delay_s = delay_s

    async def elicit(self, ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        self.asked.append(f"elicit:{getattr(params, 'mode', None) or 'form'}")
        await anyio.sleep(self.delay_s)
        if isinstance(params, types.ElicitRequestURLParams):
            return types.ElicitResult(action="accept")
        return types.ElicitResult(action="accept", content={"name": "Ada"})

    async def sample(self, ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        self.asked.append("sample")
        return types.CreateMessageResult(role="assistant", model="client-model",
                                         content=types.TextContent(type="text", text="waves"))

    async def roots(self, ctx: Any) -> types.ListRootsResult:
        self.asked.append("roots")
        return types.ListRootsResult(roots=[types.Root(uri="file:///work/a")])  # type: ignore[arg-type]

    def callbacks(self) -> dict[str, Any]:
        return {"elicitation_callback": self.elicit, "sampling_callback": self.sample,
                "list_roots_callback": self.roots}


def text(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent), result
    return first.text


CASES = [("greet", {}, "hello Ada", "elicit:form"),
         ("haiku", {"topic": "sea"}, "client-model: waves", "sample"),
         ("where", {}, "file:///work/a", "roots"), ("visit", {}, "accept", "elicit:url")]


@pytest.mark.parametrize("up", UPSTREAMS)
@pytest.mark.parametrize("mode", MODES)
async def test_each_question_reaches_the_calling_client(gateway: tuple[Gateway, str], up: str,
                                                        mode: str) -> None:
    _, url = gateway
    answers = Answers()
    async with mcp_http_client(url, mode, **answers.callbacks()) as client:
        for tool, args, expected, asked in CASES:
            result = await client.call_tool(f"{up}_{tool}", args)
            assert not result.is_error, result
            assert text(result) == expected
            assert answers.asked[-1] == asked
    assert answers.asked == [c[3] for c in CASES]


@pytest.mark.parametrize("up", UPSTREAMS)
@pytest.mark.parametrize("mode", MODES)
async def test_a_client_without_the_capability_gets_the_error_naming_it(
        gateway: tuple[Gateway, str], up: str, mode: str) -> None:
    _, url = gateway
    async with mcp_http_client(url, mode) as client:  # declares nothing
        with pytest.raises(MCPError) as caught:
            result = await client.call_tool(f"{up}_greet", {})
            raise AssertionError(f"answered: {result}")
    assert caught.value.code == types.MISSING_REQUIRED_CLIENT_CAPABILITY or "elicitation" in str(caught.value)
    assert "elicitation" in caught.value.message


@pytest.mark.parametrize("up", UPSTREAMS)
async def test_the_deadline_pauses_while_the_client_is_asked(gateway: tuple[Gateway, str], up: str) -> None:
    """The call may take 0.3 s; its client takes 0.6 s to answer, which is not counted."""
    _, url = gateway
    answers = Answers(delay_s=0.6)
    async with mcp_http_client(url, "legacy", **answers.callbacks()) as client:
        result = await client.call_tool(f"{up}_greet", {}, meta={"timeout_ms": 300})  # type: ignore[typeddict-unknown-key,arg-type]
    assert text(result) == "hello Ada" and answers.asked == ["elicit:form"]


@pytest.mark.parametrize("up", UPSTREAMS)
async def test_asking_is_bounded_by_ask_timeout_s(gateway: tuple[Gateway, str], up: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gw, url = gateway
    monkeypatch.setattr(gw.config.server.mcp, "ask_timeout_s", 0.2)
    answers = Answers(delay_s=5)
    async with mcp_http_client(url, "legacy", **answers.callbacks()) as client:
        with anyio.fail_after(4):
            try:
                result = await client.call_tool(f"{up}_greet", {})
                said = text(result) if result.is_error else f"answered: {text(result)}"
            except MCPError as e:
                said = e.message
    assert "did not answer in time" in said, said


async def test_a_client_that_goes_mid_question_ends_the_upstream_call(gateway: tuple[Gateway, str],
                                                                      tmp_path: Path) -> None:
    _, url = gateway
    marker = tmp_path / "held"
    asked = anyio.Event()

    async def never(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.set()
        await anyio.sleep_forever()
        raise AssertionError

    with anyio.fail_after(10):
        async with mcp_http_client(url, "legacy", elicitation_callback=never) as client, \
                anyio.create_task_group() as tg:
            tg.start_soon(client.call_tool, "leg_held", {"marker": str(marker)})
            await asked.wait()
            tg.cancel_scope.cancel()  # its question unanswered, the client closes its session

        async def upstream_cancelled() -> bool:
            return marker.exists() and marker.read_text() == "cancelled"

        await wait_until(upstream_cancelled)


# -- a stdio client: the gateway as ``multiplexer serve --stdio`` -------------------------
@pytest.fixture
def stdio_gateway(tmp_path: Path) -> StdioServerParameters:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({
        "providers": {name: upstream(protocol) for name, protocol in UPSTREAMS.items()},
        "routes": {f"{name}_*": {"provider": name} for name in UPSTREAMS},
        "store": {"path": str(tmp_path / "store.db")},
    }))
    return StdioServerParameters(command=sys.executable,
                                 args=["-m", "multiplexer", "serve", "--stdio", "--config", str(path)],
                                 cwd=str(ROOT), env={"PYTHONPATH": str(ROOT)})


async def test_stdio_clients_are_asked_too(stdio_gateway: StdioServerParameters) -> None:
    """A handshake-era client of ``serve --stdio`` (one gateway process): each question of both
    upstreams reaches it (a 2026-07-28 one takes the HTTP face's path, tested above)."""
    answers = Answers()
    async with Client(stdio_gateway, mode="legacy", **answers.callbacks()) as client:
        for up in UPSTREAMS:
            for tool, args, expected, _ in CASES:
                assert text(await client.call_tool(f"{up}_{tool}", args)) == expected
    assert answers.asked == [c[3] for c in CASES] * len(UPSTREAMS)


class HttpAsking:
    """``tests/asking_upstream.py --http`` on a port of its own."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc = subprocess.Popen([sys.executable, ASKING, "--http", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize(("protocol", "transport"), [("legacy", "http"), ("legacy", "stdio")])
async def test_concurrent_callers_each_get_only_their_own_question(protocol: str, transport: str) -> None:
    """Over HTTP each question travels on its call's stream, so two callers at once are each asked
    their own; over stdio nothing names the call, so with two in flight neither is asked (an
    error), never the other's."""
    server = HttpAsking() if transport == "http" else None
    try:
        provider = upstream(protocol)
        if server is not None:
            await wait_listening(server.port, server.proc)
            provider = {"kind": "mcp", "url": server.url, "protocol": protocol, "restart_backoff_ms": 20}
        config = {"server": {"host": "127.0.0.1", "port": 0, "mcp": {"ask_timeout_s": 5}},
                  "providers": {"u": provider}, "routes": {"u_*": {"provider": "u"}}}
        async with running(parse_config(config)) as (gw, url):
            await until_connected(gw, ["u"])
            both_asked = anyio.Event()
            asked: list[str] = []
            got: dict[str, str] = {}

            def answering(name: str) -> Any:
                async def elicit(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
                    asked.append(name)
                    if len(asked) == 2:
                        both_asked.set()
                    with anyio.move_on_after(0.3):  # over stdio the other is never asked
                        await both_asked.wait()
                    return types.ElicitResult(action="accept", content={"name": name})
                return elicit

            async def caller(name: str) -> None:
                async with mcp_http_client(url + "/mcp", "legacy", elicitation_callback=answering(name)) as c:
                    try:
                        got[name] = text(await c.call_tool("u_greet", {}))
                    except MCPError as e:
                        got[name] = f"refused: {e.message}"

            with anyio.fail_after(15):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(caller, "Ada")
                    tg.start_soon(caller, "Bob")
    finally:
        if server is not None:
            server.stop()
    if transport == "http":
        assert got == {"Ada": "hello Ada", "Bob": "hello Bob"} and sorted(asked) == ["Ada", "Bob"]
    else:
        for name, said in got.items():
            other = "Bob" if name == "Ada" else "Ada"
            assert other not in said, got
        assert any("cannot tell which" in said for said in got.values()), got
