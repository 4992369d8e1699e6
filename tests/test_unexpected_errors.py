"""An exception nobody expected, in a provider or in a face, reaches each face's client as an
error in that face's own shape (JSON-RPC on ``/rpc``, MCP on ``/mcp``, OpenAI and Anthropic on
``/v1``), with no detail of it on the wire; it is logged once with its traceback and counted
as an internal error in ``/metrics``, never as ok."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import mcp_types as types
import pytest
from mcp import MCPError

from multiplexer.core.call import Item, Outcome
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import Provider
from multiplexer.core.sink import ChunkSink
from multiplexer.faces.mcp.tools import ERROR_META_KEY
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import UNROUTED, Gateway
from multiplexer.server import running
from tests.mcp_helpers import MODES, mcp_http_client
from tests.sdk_helpers import sdk_clients

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.anyio

SECRET = "secret-path-/var/lib/model"  # in the exception's text: must stay in the log
ASK = [{"role": "user", "content": "hi"}]


class Boom(Provider):
    """Every call, whole or streamed, raises an exception no face expects."""

    def __init__(self) -> None:
        self.name = "boom"

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        raise RuntimeError(SECRET)

    async def stream(self, item: Item, sink: ChunkSink) -> Outcome:
        raise RuntimeError(SECRET)


class Shapeless(Provider):
    """Claims to answer like a local generate model, but its results are not completions: the
    face's shaping of them fails (the ``KeyError: 'choices'`` of the first-mile issue)."""

    def __init__(self) -> None:
        self.name = "shapeless"

    @classmethod
    def answers(cls, route: RouteConfig, settings: Any) -> str:
        return "generate"

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        return [Outcome(result={"not": "a completion"}) for _ in items]


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Gateway, str]]:
    config = parse_config({
        "store": {"path": str(tmp_path_factory.mktemp("unexpected") / "jobs.db")},
        "providers": {"boom": {"kind": "echo"}, "shapeless": {"kind": "echo"}},
        "routes": {"boom_call": {"provider": "boom"},
                   "boom_chat": {"provider": "boom", "operation": "chat"},
                   "boom_messages": {"provider": "boom", "operation": "messages"},
                   "shapeless": {"provider": "shapeless"}},
    })
    gw = Gateway(config, providers={"boom": Boom(), "shapeless": Shapeless()})
    async with running(config, port=0, gateway=gw) as (_, url):
        yield gw, url


class Count:
    """``calls_total`` for one route, as /metrics says it, from when the test began."""

    def __init__(self, gw: Gateway, route: str) -> None:
        self.gw, self.route = gw, route
        self.start = {o: self.now(o) for o in ("ok", "-32603")}

    def now(self, outcome: str) -> float:
        value = self.gw.metrics.registry.get_sample_value(
            "multiplexer_calls_total", {"route": self.route, "outcome": outcome})
        return value or 0.0

    def added(self) -> dict[str, float]:
        return {o: self.now(o) - before for o, before in self.start.items()}


def logged_once(caplog: pytest.LogCaptureFixture, kind: type[BaseException]) -> None:
    """One ERROR record carries the exception with its traceback."""
    records = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], kind)]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None and records[0].exc_info[2] is not None


OPENAI_500 = {"message": "Internal error: RuntimeError", "type": "server_error", "param": None,
              "code": None}
ANTHROPIC_500 = {"type": "error", "error": {"type": "api_error",
                                            "message": "Internal error: RuntimeError"}}


# -- a provider raises ----------------------------------------------------------------------------
async def test_rpc_answers_a_json_rpc_internal_error(gateway, caplog) -> None:
    gw, url = gateway
    count = Count(gw, "boom_call")
    async with httpx.AsyncClient() as http:
        reply = await http.post(url + "/rpc", json={"jsonrpc": "2.0", "method": "boom_call", "id": 7})
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json() == {"jsonrpc": "2.0", "id": 7, "error": {
        "code": -32603, "message": "Internal error", "data": {"detail": "RuntimeError"}}}
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, RuntimeError)


# face -> (the SDK's exception for a 500, the route it asks, the error body it must carry)
V1_500 = {"openai": (openai.InternalServerError, "boom_chat", OPENAI_500),
          "anthropic": (anthropic.InternalServerError, "boom_messages", ANTHROPIC_500)}


async def ask_v1(c: Any, face: str, model: str, stream: bool = False) -> None:
    if face == "openai":
        await c.openai.chat.completions.create(model=model, messages=ASK, stream=stream)
    else:
        await c.anthropic.messages.create(model=model, max_tokens=8, messages=ASK, stream=stream)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("face", V1_500)
async def test_v1_faces_answer_a_500_in_their_apis_shape(gateway, caplog, face, stream) -> None:
    gw, url = gateway
    error, route, body = V1_500[face]
    count = Count(gw, route)
    async with sdk_clients(url) as c:
        with pytest.raises(error) as failed:
            await ask_v1(c, face, route, stream)
    assert failed.value.status_code == 500 and failed.value.body == body
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, RuntimeError)


@pytest.mark.parametrize("mode", MODES)
async def test_mcp_face_answers_a_tool_error(gateway, caplog, mode) -> None:
    gw, url = gateway
    count = Count(gw, "boom_call")
    async with mcp_http_client(url + "/mcp", mode) as client:
        result = await client.call_tool("boom_call", {})
    assert result.is_error and result.meta is not None
    assert result.meta[ERROR_META_KEY] == {"code": -32603, "message": "Internal error",
                                           "data": {"detail": "RuntimeError"}}
    assert SECRET not in str(result.model_dump())
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, RuntimeError)


async def test_a_result_the_face_cannot_shape_is_an_error_not_ok(gateway, caplog) -> None:
    gw, url = gateway
    count = Count(gw, "shapeless")
    async with sdk_clients(url) as c:
        with pytest.raises(openai.InternalServerError) as failed:
            await c.openai.chat.completions.create(model="shapeless", messages=ASK)
    assert failed.value.body == {**OPENAI_500, "message": "Internal error: KeyError"}
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, KeyError)


# -- a face's own code raises ----------------------------------------------------------------------
class FaceBug(Exception):
    """Raised from inside a face's own code by the tests below."""


def broken(*args: Any, **kwargs: Any) -> Any:
    raise FaceBug(SECRET)


FACE_BUG = "Internal error: FaceBug in the gateway (details in its log)"


async def test_rpc_face_bug_is_a_json_rpc_error_with_status_500(gateway, caplog, monkeypatch) -> None:
    gw, url = gateway
    count = Count(gw, UNROUTED)
    monkeypatch.setattr("multiplexer.faces.rpc.decode", broken)
    async with httpx.AsyncClient() as http:
        reply = await http.post(url + "/rpc", json={"jsonrpc": "2.0", "method": "boom_call", "id": 1})
    assert reply.status_code == 500 and reply.headers["content-type"] == "application/json"
    assert reply.json() == {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32603, "message": "Internal error",
        "data": {"detail": "FaceBug in the gateway (details in its log)"}}}
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, FaceBug)


@pytest.mark.parametrize("face", ["openai", "embeddings", "anthropic"])  # embeddings: the direct path
async def test_v1_face_bug_is_a_500_in_the_apis_shape(gateway, caplog, monkeypatch, face) -> None:
    gw, url = gateway
    count = Count(gw, UNROUTED)
    monkeypatch.setattr(f"multiplexer.faces.v1.{'anthropic' if face == 'anthropic' else 'openai'}.plan",
                        broken)
    error, route, body = V1_500["anthropic" if face == "anthropic" else "openai"]
    async with sdk_clients(url) as c:
        with pytest.raises(error) as failed:
            if face == "embeddings":
                await c.openai.embeddings.create(model=route, input="x")
            else:
                await ask_v1(c, face, route)
    if face == "anthropic":
        assert failed.value.body == {"type": "error", "error": {"type": "api_error", "message": FACE_BUG}}
    else:
        assert failed.value.body == {**body, "message": FACE_BUG}
        assert failed.value.response.headers["x-request-id"].startswith("req_")
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, FaceBug)


@pytest.mark.parametrize("mode", MODES)
async def test_mcp_face_bug_is_an_mcp_internal_error(gateway, caplog, monkeypatch, mode) -> None:
    gw, url = gateway
    count = Count(gw, UNROUTED)
    monkeypatch.setattr("multiplexer.faces.mcp.server.call_from", broken)
    async with mcp_http_client(url + "/mcp", mode) as client:
        with pytest.raises(MCPError) as failed:
            await client.call_tool("boom_call", {})
    assert failed.value.code == types.INTERNAL_ERROR and failed.value.message == "Internal error"
    assert SECRET not in str(failed.value.error.model_dump())
    assert count.added() == {"ok": 0, "-32603": 1}
    logged_once(caplog, FaceBug)
