"""The error catalogue (docs/operations.md, "Error codes") against a gateway on 127.0.0.1: every
refusal it documents is brought about, and each says the words its row quotes for its fix. A
refusal code whose row quotes none, a quoted fix no refusal here brings about, and a row for a
code the gateway does not have all fail, so the table and the messages cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.errors import Code, RpcError
from multiplexer.faces.v1.common import status_of
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running

pytestmark = pytest.mark.anyio

PAGE = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
# The codes that end a call that was taken, not refuse a request: their rows say "not a refusal".
FAILURES = {Code.INTERNAL_ERROR, Code.UPSTREAM_ERROR, Code.TIMEOUT, Code.CANCELLED, Code.UPSTREAM_UNAVAILABLE}


def catalogue() -> dict[int, list[str]]:
    """Each documented code and the words quoted (as "`...`") in its "what to do" column."""
    text = PAGE.read_text()
    section = text[text.index("## Error codes"):]
    section = section[:section.index("\n## ", 1)]
    rows: dict[int, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not re.fullmatch(r"-32\d{3}", cells[0]):
            continue
        fix = cells[-1]
        assert len(cells) == 4 and int(cells[0]) not in rows, line
        rows[int(cells[0])] = [] if fix.startswith("not a refusal") else re.findall(r'"`([^`]+)`"', fix)
    return rows


def test_every_code_is_documented_and_every_refusal_quotes_its_fix() -> None:
    rows = catalogue()
    assert set(rows) == {int(c) for c in Code}
    for code, quoted in rows.items():
        assert bool(quoted) == (code not in FAILURES), (code, quoted)


# -- a gateway with a key for each refusal ------------------------------------------------------
KEYS = {"alice": "sk-cat-alice-0123456789", "rita": "sk-cat-rita-0123456789",
        "bea": "sk-cat-bea-0123456789", "tom": "sk-cat-tom-0123456789", "dan": "sk-cat-dan-0123456789"}
HI = [{"role": "user", "content": "hi"}]


def config(tmp_path: Path) -> dict[str, Any]:
    slow = {"kind": "mock", "latency_ms": 30_000, "batch": {"max_items": 1},
            "limits": {"concurrency": 1, "max_queue": 1}}
    return {
        "server": {"max_body_bytes": 2048, "max_header_bytes": 2048, "max_batch_items": 2,
                   "grace_period_s": 0.1,
                   "api_keys": {"alice": {"key": KEYS["alice"]}, "rita": {"key": KEYS["rita"], "rpm": 1},
                                "bea": {"key": KEYS["bea"], "budget_usd": {"daily": "0.000000001"}},
                                "tom": {"key": KEYS["tom"], "budget_usd": {"total": "0.000000001"}},
                                "dan": {"key": KEYS["dan"], "routes": ["echo"]}}},
        "store": {"path": str(tmp_path / "catalogue.db")},
        "providers": {"e": {"kind": "echo"}, "m": {"kind": "mock", "price": {"per_call": "0.01"}},
                      "slow": slow, "ending": {"kind": "mock"}},
        "routes": {"echo": {"provider": "e"},
                   "chat": {"provider": "m", "operation": "chat", "models": ["mock-gpt"]},
                   "slow": {"provider": "slow", "operation": "chat", "models": ["slow-gpt"]},
                   "ending": {"provider": "ending", "operation": "chat", "models": ["ending-gpt"]}},
    }


@dataclass
class Served:
    gateway: Gateway
    http: httpx.AsyncClient

    async def rpc(self, key: str | None, method: str, params: Any = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEYS[key]}"} if key else {}
        body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}
        return await self.http.post("/rpc", json=body, headers=headers)

    async def chat(self, key: str, model: str, text: str = "hi") -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        return await self.http.post("/v1/chat/completions", json=body,
                                    headers={"authorization": f"Bearer {KEYS[key]}"})


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    config_ = parse_config(config(tmp_path_factory.mktemp("catalogue")))
    async with running(config_, port=0) as (gateway, url), \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield Served(gateway, http)


# -- how each refusal is brought about ----------------------------------------------------------
async def second(first: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """The second of two identical requests: the first spends what the key had."""
    assert (await first()).status_code == 200
    return await first()


async def overloaded(s: Served) -> httpx.Response:
    """One call holds the slow provider's one slot, one fills its queue of one: a third is refused."""
    async with anyio.create_task_group() as tg:
        for text in ("one", "two"):
            tg.start_soon(s.chat, "alice", "slow-gpt", text)
        with anyio.fail_after(10):
            while not any(lane.name == "slow" and lane.queue.full() for lane in s.gateway.lanes.values()):
                await anyio.sleep(0.01)
        refused = await s.chat("alice", "slow-gpt", "three")
        tg.cancel_scope.cancel()  # the two held calls end with their clients
    return refused


async def shutting_down(s: Served) -> httpx.Response:
    """A lane the gateway has begun to close (its first step on SIGTERM) takes no more calls."""
    assert (await s.chat("alice", "ending-gpt")).status_code == 200
    for lane in s.gateway.lanes.values():
        if lane.name == "ending":
            lane.close()
    return await s.chat("alice", "ending-gpt")


@dataclass(frozen=True)
class Trigger:
    code: int
    says: str  # the words its row quotes
    send: Callable[[Served], Awaitable[httpx.Response]]


def spent(s: Served, key: str) -> Awaitable[httpx.Response]:
    """A key's second chat: its first spent all of its budget."""
    return second(lambda: s.rpc(key, "chat", {"messages": HI}))


def big(s: Served) -> Awaitable[httpx.Response]:
    return s.http.post("/rpc", content=b"[" + b" " * 4096 + b"]",
                       headers={"authorization": f"Bearer {KEYS['alice']}"})


async def quarantined(s: Served) -> httpx.Response:
    """A gateway of its own in front of an upstream that changed a pinned tool's description."""
    from tests.mcp_helpers import call
    from tests.pin_helpers import KEYS as PIN_KEYS
    from tests.pin_helpers import config_data, upstream_url

    async with upstream_url() as url:
        data = config_data(url, Path(str(s.gateway.config.store.path)).parent)
        data["server"].pop("admin_key")
        async with running(parse_config(data), port=0) as (gateway, base), httpx.AsyncClient() as http:
            changed = anyio.Event()
            gateway.listeners.append(lambda event, d: changed.set() if event == "tool_pin" and
                                     d["action"] == "changed" else None)
            assert (await call(gateway, "rug_rug", {})).ok
            with anyio.fail_after(10):
                await changed.wait()
            body = {"jsonrpc": "2.0", "id": 1, "method": "rug_lookup", "params": {"word": "x"}}
            return await http.post(base + "/rpc", json=body,
                                   headers={"authorization": f"Bearer {PIN_KEYS['alice']}"})


TRIGGERS = [
    Trigger(Code.PARSE_ERROR, "line 1 column", lambda s: s.http.post(
        "/rpc", content=b"{nope", headers={"authorization": f"Bearer {KEYS['alice']}"})),
    Trigger(Code.INVALID_REQUEST, "server.max_batch_items", lambda s: s.http.post(
        "/rpc", json=[{"jsonrpc": "2.0", "id": i, "method": "echo"} for i in range(3)],
        headers={"authorization": f"Bearer {KEYS['alice']}"})),
    Trigger(Code.INVALID_REQUEST, "send POST", lambda s: s.http.get("/rpc")),
    Trigger(Code.METHOD_NOT_FOUND, "did you mean", lambda s: s.rpc("alice", "ecoh")),
    Trigger(Code.INVALID_PARAMS, "must be", lambda s: s.rpc("alice", "chat", {"messages": "hi"})),
    Trigger(Code.OVERLOADED, "retry after", overloaded),
    Trigger(Code.RATE_LIMITED, "retry after", lambda s: second(lambda: s.chat("rita", "mock-gpt"))),
    Trigger(Code.RATE_LIMITED, "resets at", lambda s: spent(s, "bea")),
    Trigger(Code.RATE_LIMITED, "never resets", lambda s: spent(s, "tom")),
    Trigger(Code.RATE_LIMITED, "may not use", lambda s: s.rpc("dan", "chat", {"messages": HI})),
    Trigger(Code.UNAUTHORIZED, "send Authorization: Bearer <key>", lambda s: s.rpc(None, "echo")),
    Trigger(Code.TOO_LARGE, "server.max_body_bytes", big),
    Trigger(Code.TOO_LARGE, "server.max_header_bytes", lambda s: s.http.post(
        "/rpc", json={}, headers={"x-filler": "a" * 4096})),
    Trigger(Code.SHUTTING_DOWN, "retry after", shutting_down),
    Trigger(Code.NOT_FOUND, "lists yours", lambda s: s.http.get(
        "/v1/files/file-nope", headers={"authorization": f"Bearer {KEYS['alice']}"})),
    Trigger(Code.TOOL_QUARANTINED, "an admin approves the new definition", quarantined),
]


def test_every_quoted_fix_has_a_refusal_that_brings_it_about() -> None:
    rows = catalogue()
    covered = {(t.code, t.says) for t in TRIGGERS}
    documented = {(code, words) for code, quoted in rows.items() for words in quoted}
    assert covered == documented


def said(r: httpx.Response) -> tuple[int | None, str]:
    """The refusal's code (JSON-RPC bodies carry it) and its text as the caller reads it: a JSON-RPC
    error's message and ``detail``, a ``/v1`` error's message."""
    body = r.json()
    if "jsonrpc" in body:
        error = body["error"]
        detail = (error.get("data") or {}).get("detail")
        return error["code"], f"{error['message']}: {detail}" if detail else error["message"]
    return None, body["error"]["message"]  # OpenAI's and Anthropic's shapes alike


@pytest.mark.parametrize("trigger", TRIGGERS, ids=[f"{t.code} {t.says}" for t in TRIGGERS])
async def test_each_refusal_says_its_fix(served: Served, trigger: Trigger) -> None:
    r = await trigger.send(served)
    assert r.headers["content-type"].startswith("application/json"), r.text
    code, text = said(r)
    if code is None:  # a /v1 shape: its status is the one the code maps to
        assert r.status_code == status_of(RpcError(trigger.code, "")), (r.status_code, text)
    else:
        assert code == trigger.code, text
    assert trigger.says in text, text
