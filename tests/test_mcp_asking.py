"""An upstream's questions during a call reach the one client that made it (issue 54, part 1), and
sampling is answered by a chat route of the gateway under the calling key (part 2).

Upstream: ``tests/asking_upstream.py`` (``mcp`` 2.x), whose tools elicit (form and URL),
sample and list roots; as ``up`` it speaks 2026-07-28 (``input_required`` results), as
``leg`` it is held to the handshake era (requests pushed mid-call). Clients: the SDK's,
2026-07-28 and 2025-11-25, over the HTTP face.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import mcp_types as types
import pytest
from mcp import Client, MCPError

from multiplexer.faces.mcp.asking import ClientAsker
from multiplexer.faces.mcp.sampling import FACE, Sampler, chat_body, sampling_result
from multiplexer.faces.mcp.server import McpFace
from multiplexer.gateway.config import McpSamplingConfig, parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import ROOT, free_port, mcp_http_client, until_connected, wait_listening, wait_until

pytestmark = pytest.mark.anyio

ASKING = str(ROOT / "tests" / "asking_upstream.py")
UPSTREAMS = {"up": "auto", "leg": "legacy"}  # route prefix -> the upstream's era (protocol)
MODES = ["auto", "legacy"]  # the client's: 2026-07-28, 2025-11-25
ALICE, BOB, ADMIN = "sk-alice-asking", "sk-bob-asking", "sk-admin-asking"
PER_CALL = Decimal("0.25")


def upstream(protocol: str) -> dict[str, Any]:
    return {"kind": "mcp", "command": sys.executable, "args": [ASKING], "protocol": protocol,
            "restart_backoff_ms": 20, "limits": {"concurrency": 16}}


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


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Gateway, str]]:
    folder = tmp_path_factory.mktemp("asking")
    http = HttpAsking()  # a handshake-era upstream over Streamable HTTP: ``legh``
    try:
        await wait_listening(http.port, http.proc)
        config = {
            "server": {"host": "127.0.0.1", "port": 0, "admin_key": ADMIN,
                       "api_keys": {"alice": {"key": ALICE},
                                    "bob": {"key": BOB, "routes": ["up_*", "leg_*"]}},
                       "mcp": {"ask_timeout_s": 5, "sampling": {"route": "chat", "when": "client_lacks"}}},
            "store": {"path": str(folder / "store.db")},
            "spend": {"flush_interval_s": 0.05},
            "log": {"flush_interval_s": 0.05},
            "providers": {**{name: upstream(protocol) for name, protocol in UPSTREAMS.items()},
                          "legh": {"kind": "mcp", "url": http.url, "protocol": "legacy",
                                   "restart_backoff_ms": 20},
                          "m": {"kind": "mock", "price": {"per_call": str(PER_CALL)}}},
            "routes": {**{f"{name}_*": {"provider": name, "timeout_ms": 20_000}
                          for name in (*UPSTREAMS, "legh")},
                       "chat": {"provider": "m", "operation": "chat"}},
        }
        async with running(parse_config(config)) as (gw, url):
            await until_connected(gw, [*UPSTREAMS, "legh"])
            yield gw, url + "/mcp"
    finally:
        http.stop()


def as_alice(url: str, mode: str, **kw: Any) -> Any:
    return mcp_http_client(url, mode, key=ALICE, **kw)


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
    async with as_alice(url, mode, **answers.callbacks()) as client:
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
    async with as_alice(url, mode) as client:  # declares nothing
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
    async with as_alice(url, "legacy", **answers.callbacks()) as client:
        result = await client.call_tool(f"{up}_greet", {}, meta={"timeout_ms": 300})  # type: ignore[typeddict-unknown-key,arg-type]
    assert text(result) == "hello Ada" and answers.asked == ["elicit:form"]


@pytest.mark.parametrize("up", UPSTREAMS)
async def test_asking_is_bounded_by_ask_timeout_s(gateway: tuple[Gateway, str], up: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gw, url = gateway
    monkeypatch.setattr(gw.config.server.mcp, "ask_timeout_s", 0.2)
    answers = Answers(delay_s=5)
    async with as_alice(url, "legacy", **answers.callbacks()) as client:
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
        async with as_alice(url, "legacy", elicitation_callback=never) as client, \
                anyio.create_task_group() as tg:
            tg.start_soon(client.call_tool, "leg_held", {"marker": str(marker)})
            await asked.wait()
            tg.cancel_scope.cancel()  # its question unanswered, the client closes its session

        async def upstream_cancelled() -> bool:
            return marker.exists() and marker.read_text() == "cancelled"

        await wait_until(upstream_cancelled)


# -- a stdio client: the stdio face's server loop (``serve --stdio`` runs it over its pipes) ---
@asynccontextmanager
async def stdio_face(gw: Gateway) -> AsyncIterator[Any]:
    """A client transport to a new ``McpFace`` of the running gateway, served as ``serve --stdio``
    serves it (``server.run`` on a pair of streams, no HTTP, no identity), over memory streams."""
    face = McpFace(gw)
    to_server, from_client = anyio.create_memory_object_stream[Any](16)
    to_client, from_server = anyio.create_memory_object_stream[Any](16)
    async with face.running(), anyio.create_task_group() as tg:
        tg.start_soon(face.server.run, from_client, to_client, face.server.create_initialization_options())
        yield from_server, to_server
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("mode", MODES)
async def test_stdio_clients_are_asked_too(gateway: tuple[Gateway, str], mode: str) -> None:
    """One client session on the stdio face: each question of both upstream eras reaches it."""
    gw, _ = gateway
    answers = Answers()
    async with Client(stdio_face(gw), mode=mode, **answers.callbacks()) as client:
        for up in UPSTREAMS:
            for tool, args, expected, _ in CASES:
                assert text(await client.call_tool(f"{up}_{tool}", args)) == expected
    assert answers.asked == [c[3] for c in CASES] * len(UPSTREAMS)


@pytest.mark.parametrize("up", ["legh", "leg"])
async def test_concurrent_callers_each_get_only_their_own_question(gateway: tuple[Gateway, str],
                                                                   up: str) -> None:
    """Over HTTP (``legh``) each question travels on its call's stream, so two callers at once are
    each asked their own; over stdio (``leg``) nothing names the call, so with two in flight the
    question is refused (an error), never put to the other caller."""
    _, url = gateway
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
        async with as_alice(url, "legacy", elicitation_callback=answering(name)) as client:
            try:
                got[name] = text(await client.call_tool(f"{up}_greet", {}))
            except MCPError as e:
                got[name] = f"refused: {e.message}"

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, "Ada")
            tg.start_soon(caller, "Bob")
    if up == "legh":
        assert got == {"Ada": "hello Ada", "Bob": "hello Bob"} and sorted(asked) == ["Ada", "Bob"]
    else:
        for name, said in got.items():
            other = "Bob" if name == "Ada" else "Ada"
            assert other not in said, got
        assert any("cannot tell which" in said for said in got.values()), got


# -- sampling through the gateway's routes (issue 54, part 2) -------------------------------
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}


async def spend(url: str) -> dict[tuple[str, str], tuple[int, Decimal]]:
    async with httpx.AsyncClient(base_url=url.removesuffix("/mcp")) as http:
        r = await http.get("/admin/spend?group_by=key,route", headers=AS_ADMIN)
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    return {(row["key"], row["route"]): (row["calls"], Decimal(str(row["cost_usd"]))) for row in rows}


@pytest.mark.parametrize("up", ["up", "leg"])
async def test_a_key_that_may_not_use_the_sampling_route_is_refused(gateway: tuple[Gateway, str],
                                                                    up: str) -> None:
    """The bypass test: sampling is a call of the calling key, checked by admission like any."""
    _, url = gateway
    before = await spend(url)
    async with mcp_http_client(url, "auto", key=BOB) as client:
        try:
            result = await client.call_tool(f"{up}_haiku", {"topic": "sea"})
            refusal = text(result) if result.is_error else f"answered: {text(result)}"
        except Exception as e:  # the upstream's failure, as the SDK raises it
            refusal = str(e)
    assert "Permission denied: this key may not use route 'chat'" in refusal, refusal
    after = await spend(url)
    assert after.get(("bob", "chat")) is None and after.get(("bob", "chat")) == before.get(("bob", "chat"))


@pytest.mark.parametrize("up", ["up", "leg"])
async def test_sampling_is_answered_by_the_route_and_booked_to_the_caller(gateway: tuple[Gateway, str],
                                                                         up: str) -> None:
    _, url = gateway
    calls, cost = (await spend(url)).get(("alice", "chat"), (0, Decimal(0)))
    async with mcp_http_client(url, "auto", key=ALICE) as client:  # declares no sampling
        result = await client.call_tool(f"{up}_haiku", {"topic": "the sea at night"})
    assert not result.is_error, result
    model, _, reply = text(result).partition(": ")
    assert reply and model  # the mock route's reply to the topic, and the model it names
    assert (await spend(url))[("alice", "chat")] == (calls + 1, cost + PER_CALL)
    async with httpx.AsyncClient(base_url=url.removesuffix("/mcp")) as http:  # its source, in the request log

        async def recorded() -> bool:
            r = await http.get("/admin/requests", headers=AS_ADMIN, params={"key": "alice", "route": "chat"})
            return any(row["face"] == FACE for row in r.json()["requests"])

        await wait_until(recorded)


async def test_a_client_with_sampling_is_asked_when_it_lacks_nothing(gateway: tuple[Gateway, str]) -> None:
    _, url = gateway
    asked: list[str] = []

    async def sample(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        asked.append("sample")
        return types.CreateMessageResult(role="assistant", model="client-model",
                                         content=types.TextContent(type="text", text="own"))

    async with mcp_http_client(url, "legacy", key=ALICE, sampling_callback=sample) as client:
        result = await client.call_tool("leg_haiku", {"topic": "sea"})
    assert text(result) == "client-model: own" and asked == ["sample"]


def test_model_hints_pick_the_route_the_table_says(tmp_path: Path) -> None:
    config = parse_config({
        "providers": {"m": {"kind": "mock"}},
        "routes": {name: {"provider": "m", "operation": "chat"}
                   for name in ("chat", "fast-chat", "big-chat")},
    })
    gw = Gateway(config)
    sampler = Sampler(gw, McpSamplingConfig(route="chat"), None)
    assert sampler.route_for(None) == "chat"
    assert sampler.route_for({"hints": [{"name": "big-chat"}]}) == "big-chat"  # a name: that route
    assert sampler.route_for({"hints": [{"name": "nope"}, {"name": "fast"}]}) == "fast-chat"  # a part of one
    assert sampler.route_for({"hints": [{"name": "claude-3"}]}) == "chat"  # none: the configured route


def test_sampling_requests_and_answers_translate() -> None:
    body = chat_body({"messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}],
                      "systemPrompt": "be brief", "maxTokens": 5, "temperature": 0.2, "stopSequences": ["."]})
    assert body == {"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}],
                    "max_tokens": 5, "temperature": 0.2, "stop": ["."]}
    completion = {"model": "m1", "choices": [{"message": {"content": "yo"}, "finish_reason": "length"}]}
    answer = sampling_result(completion, "chat")
    assert answer == {"role": "assistant", "content": {"type": "text", "text": "yo"}, "model": "m1",
                      "stopReason": "maxTokens"}


def test_always_answers_even_a_client_that_samples() -> None:
    class Ctx:
        caps = types.ClientCapabilities(sampling=types.SamplingCapability())
        session = type("S", (), {"client_capabilities": caps})()
        request_id = 1
        protocol_version = "2025-11-25"

    gw = Gateway(parse_config({"providers": {"m": {"kind": "mock"}},
                               "routes": {"chat": {"provider": "m", "operation": "chat"}}}))
    lacks = ClientAsker(Ctx(), 5, Sampler(gw, McpSamplingConfig(route="chat"), None), None)  # type: ignore[arg-type]
    always = ClientAsker(Ctx(), 5, Sampler(gw, McpSamplingConfig(route="chat", when="always"), None),  # type: ignore[arg-type]
                         None)
    assert not lacks.answers_here("sampling/createMessage", {})
    assert always.answers_here("sampling/createMessage", {})
    assert not always.answers_here("roots/list", {})


def test_the_sampling_route_must_exist() -> None:
    with pytest.raises(ValueError, match=r"server\.mcp\.sampling\.route: 'nope' is no route or model group"):
        parse_config({"server": {"mcp": {"sampling": {"route": "nope"}}},
                      "providers": {"m": {"kind": "mock"}}, "routes": {"chat": {"provider": "m"}}})


async def test_a_held_call_resumes_only_for_the_key_that_made_it(gateway: tuple[Gateway, str]) -> None:
    """A 2026-07-28 client's call to a handshake-era upstream, held for its answer: another key's
    retry with its ``requestState`` is refused and answers nothing; its own key's resumes it."""
    _, url = gateway
    answer = {"name": types.ElicitResult(action="accept", content={"name": "Ada"})}
    async with as_alice(url, "auto", **Answers().callbacks()) as alice, \
            mcp_http_client(url, "auto", key=BOB) as bob:
        first = await alice.session.call_tool("leg_greet", {}, allow_input_required=True)
        assert isinstance(first, types.InputRequiredResult), first
        assert first.request_state is not None and first.request_state.startswith("mux-held:")
        (key,) = first.input_requests or {}
        answers: Any = {key: answer["name"]}
        with pytest.raises(MCPError) as caught:
            await bob.session.call_tool("leg_greet", {}, input_responses=answers,
                                        request_state=first.request_state, allow_input_required=True)
        assert "requestState names no call held here" in caught.value.message
        done = await alice.session.call_tool("leg_greet", {}, input_responses=answers,
                                             request_state=first.request_state, allow_input_required=True)
    assert isinstance(done, types.CallToolResult) and text(done) == "hello Ada"


@pytest.mark.parametrize(("up", "mode"), [("leg", "legacy"), ("up", "auto"), ("up", "legacy")])
async def test_sampling_with_tools_reaches_only_a_client_that_declared_them(gateway: tuple[Gateway, str],
                                                                            up: str, mode: str) -> None:
    _, url = gateway

    async def sample(ctx: Any, params: types.CreateMessageRequestParams
                     ) -> types.CreateMessageResultWithTools:
        assert params.tools and params.tools[0].name == "lookup"
        return types.CreateMessageResultWithTools(role="assistant", model="tooling-model",
                                                  content=[types.TextContent(type="text", text="ok")])

    tools = types.SamplingCapability(tools=types.SamplingToolsCapability())
    async with as_alice(url, mode, sampling_callback=sample, sampling_capabilities=tools) as client:
        assert text(await client.call_tool(f"{up}_tooled", {})) == "tooling-model: 1 block(s)"
    async with as_alice(url, mode, sampling_callback=sample) as client:  # sampling, without tools
        with pytest.raises(MCPError) as caught:
            result = await client.call_tool(f"{up}_tooled", {})
            raise AssertionError(f"answered: {result}")
    assert "sampling.tools" in caught.value.message


async def test_the_deadline_pauses_for_a_call_that_waited_its_turn_too(gateway: tuple[Gateway, str]) -> None:
    """The same with the lane busy, so the call is handed to a lane worker and its caller waits
    on its ticket (not run in its own task): the ticket's deadline moves with the pause."""
    _, url = gateway
    first, second = Answers(delay_s=1.0), Answers(delay_s=0.6)
    async with as_alice(url, "legacy", **first.callbacks()) as busy, \
            as_alice(url, "legacy", **second.callbacks()) as client, anyio.create_task_group() as tg:
        tg.start_soon(busy.call_tool, "legh_greet", {})
        await wait_until(lambda_async(lambda: bool(first.asked)))
        result = await client.call_tool("legh_greet", {}, meta={"timeout_ms": 300})  # type: ignore[typeddict-unknown-key,arg-type]
    assert text(result) == "hello Ada" and second.asked == ["elicit:form"]


def lambda_async(check: Any) -> Any:
    async def predicate() -> bool:
        return bool(check())
    return predicate
