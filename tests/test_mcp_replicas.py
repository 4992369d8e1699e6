"""Handshake-era MCP sessions on any replica: three gateways sharing one Redis behind a round-robin
balancer written here (``tests/rr_proxy.py``: each request to the next replica), driven by the
official Python SDK client.

Every session works whichever replica each of its requests reaches (a replica that never saw it
rebuilds it from Redis); a list change heard on one replica reaches the client streaming from
another; a server-to-client request is answered through whichever replica the answer reaches;
DELETE ends the session on every replica; a session opened with one key is not found with another;
a SIGKILLed replica loses no session.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import httpx
import mcp_types as types
import pytest
import redis.asyncio as aioredis
import yaml
from anyio.abc import TaskStatus
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from multiplexer.faces.mcp.replica_sessions import ReplicaSessionManager, session_manager
from multiplexer.faces.mcp.server import McpFace
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import (
    ROOT,
    free_port,
    http_upstream,
    http_upstream_process,
    mcp_http_client,
    wait_listening,
    wait_until,
)
from tests.redis_helpers import drop_keys, prefix, redis_url
from tests.rr_proxy import RoundRobin, round_robin

pytestmark = pytest.mark.anyio

LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
KEYS = {"a": "key-a-" + "x" * 20, "b": "key-b-" + "y" * 20}
Replica = tuple[Gateway, str]


def config(state_prefix: str, upstream: str | None = None, asking: str | None = None,
           **mcp: Any) -> dict[str, Any]:
    providers: dict[str, Any] = {"e": {"kind": "echo"}}
    routes: dict[str, Any] = {"echo": {"provider": "e"}}
    if upstream is not None:
        providers["tools"] = http_upstream(upstream)
        routes["tools_*"] = {"provider": "tools"}
    if asking is not None:  # tests/asking_upstream.py, spoken to in each era
        for name, protocol in (("up", "auto"), ("leg", "legacy")):
            providers[name] = {"kind": "mcp", "url": asking, "protocol": protocol, "restart_backoff_ms": 20}
            routes[f"{name}_*"] = {"provider": name, "timeout_ms": 20_000}
    return {
        "server": {"host": "127.0.0.1", "port": 0, "api_keys": KEYS, "mcp": mcp},
        "state": {"url": redis_url(), "prefix": state_prefix},
        "providers": providers,
        "routes": routes,
    }


@asynccontextmanager
async def deployment(n: int = 3, upstream: str | None = None, asking: str | None = None, **mcp: Any
                     ) -> AsyncIterator[tuple[list[Replica], str, RoundRobin, str]]:
    """``n`` replicas of one config (one ``state.prefix``) behind the balancer: (replicas, its
    /mcp URL, the balancer, the prefix)."""
    pre = prefix()
    gateways = [running(parse_config(config(pre, upstream, asking, **mcp))) for _ in range(n)]
    async with together(gateways) as replicas, round_robin([url for _, url in replicas]) as (base, proxy):
        yield replicas, base + "/mcp", proxy, pre


@asynccontextmanager
async def together(contexts: list[AbstractAsyncContextManager[Replica]]) -> AsyncIterator[list[Replica]]:
    """Several gateways started and stopped at once (each stop waits out its server's tick)."""
    values: list[Replica] = []
    stop = anyio.Event()

    async def hold(context: AbstractAsyncContextManager[Replica], *,
                   task_status: TaskStatus[Replica] = anyio.TASK_STATUS_IGNORED) -> None:
        async with context as value:
            task_status.started(value)
            await stop.wait()

    async with anyio.create_task_group() as tg:
        for context in contexts:
            values.append(await tg.start(hold, context))
        try:
            yield values
        finally:
            stop.set()


def manager_of(gw: Gateway) -> ReplicaSessionManager:
    manager = gw.faces["mcp:sessions"]
    assert isinstance(manager, ReplicaSessionManager)
    return manager


def face_of(gw: Gateway) -> McpFace:
    face = gw.faces["mcp"]
    assert isinstance(face, McpFace)
    return face


async def streaming(replicas: list[Replica], sid: str) -> int:
    """The replica that holds the client's GET stream (waited for: the client opens it itself)."""
    found: list[int] = []

    async def held() -> bool:
        found[:] = [i for i, (gw, _) in enumerate(replicas)
                    if (c := manager_of(gw).copies.get(sid)) is not None and c.streams]
        return len(found) == 1

    await wait_until(held, timeout=10)
    return found[0]


def held(replicas: list[Replica]) -> set[str]:
    """The session ids the replicas hold copies of."""
    return {sid for gw, _ in replicas for sid in manager_of(gw).copies}


def one_session(replicas: list[Replica], before: set[str]) -> str:
    """The one session opened since ``before`` (the module's replicas serve every test)."""
    ids = held(replicas) - before
    assert len(ids) == 1, ids
    return ids.pop()


async def list_roots(ctx: Any) -> types.ListRootsResult:
    return types.ListRootsResult(roots=[types.Root(uri="file:///work", name="work")])


async def ask_on_call(ctx: Any, call_next: Any) -> Any:
    """Middleware: the tool ``ask`` asks the client for its roots on its own response stream (as a
    relayed elicitation is asked) and answers with the first."""
    if ctx.method == "tools/call" and (ctx.params or {}).get("name") == "ask":
        roots = await ctx.session.list_roots()
        return {"content": [{"type": "text", "text": str(roots.roots[0].uri)}], "isError": False}
    return await call_next(ctx)


Deployment = tuple[list[Replica], str, RoundRobin, str]


SPARE: dict[str, Any] = {}  # the fourth replica: a process the module's last test kills


@pytest.fixture(scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    """Three replicas behind the balancer, with two MCP upstreams (``demo_tools.py`` and
    ``asking_upstream.py`` over HTTP), for the module's tests that leave them as they were; and a
    fourth replica of the same deployment as a ``multiplexer serve`` process, started now so that
    its start-up overlaps the tests before the one that kills it."""
    port = free_port()
    asking_port = free_port()
    asking = subprocess.Popen([sys.executable, str(ROOT / "tests" / "asking_upstream.py"), "--http",
                               "--port", str(asking_port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    spare: subprocess.Popen[bytes] | None = None
    try:
        async with http_upstream_process() as upstream:
            await wait_listening(asking_port, asking)
            asking_url = f"http://127.0.0.1:{asking_port}/mcp"
            async with deployment(upstream=upstream.url, asking=asking_url, ask_timeout_s=5) as made:
                data = config(made[3], upstream.url, asking_url, ask_timeout_s=5)
                data["server"]["port"] = port
                tmp = tmp_path_factory.mktemp("spare")
                data["store"] = {"path": str(tmp / "store.db")}
                (tmp / "replica.yaml").write_text(yaml.safe_dump(data))
                spare = subprocess.Popen([sys.executable, "-m", "multiplexer", "serve", "--config",
                                          str(tmp / "replica.yaml")],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                SPARE.update(proc=spare, url=f"http://127.0.0.1:{port}")
                for gw, _ in made[0]:
                    face_of(gw).server.middleware.insert(0, ask_on_call)
                yield made
                if spare.poll() is None:
                    spare.kill()
                    spare.wait()
    finally:
        for proc in (asking, spare):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    drop_keys([made[3]])  # its gateways have stopped (each test's own cleanup ran while they wrote)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_every_session_works_through_a_round_robin_balancer(mode: str, shared: Deployment) -> None:
    replicas, url, proxy, _ = shared
    before = len(proxy.served)
    rebuilt = [manager_of(gw).rebuilt for gw, _ in replicas]
    progress: list[float] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    async def session(n: int) -> None:
        async with mcp_http_client(url, mode, key=KEYS["a"]) as client:
            assert client.protocol_version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
            names = {t.name for t in (await client.list_tools()).tools}
            assert {"echo", "tools_sleep"} <= names
            for i in range(4):
                result = await client.call_tool("echo", {"session": n, "i": i})
                assert result.structured_content == {"session": n, "i": i}
            slept = await client.call_tool("tools_sleep", {"seconds": 0.01, "steps": 2},
                                           progress_callback=on_progress)
            assert slept.structured_content == {"result": "slept"}

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(session, n)
    assert set(proxy.served[before:]) == {0, 1, 2}
    assert len(progress) == 8  # two steps of each session's sleep, from whichever replica ran it
    if mode == "legacy":  # every replica served (and so rebuilt) sessions it did not open
        assert all(manager_of(gw).rebuilt > n for (gw, _), n in zip(replicas, rebuilt, strict=True))


async def test_without_shared_state_the_sdk_manager_serves_as_before() -> None:
    async with running(parse_config({"server": {"host": "127.0.0.1", "port": 0},
                                     "providers": {"e": {"kind": "echo"}},
                                     "routes": {"echo": {"provider": "e"}}})) as (gw, _):
        assert type(gw.faces["mcp:sessions"]) is StreamableHTTPSessionManager
        assert type(session_manager(face_of(gw), "x")) is StreamableHTTPSessionManager


async def test_a_list_change_on_one_replica_reaches_the_client_streaming_from_another(
        shared: Deployment) -> None:
    replicas, url, _, _ = shared
    before = held(replicas)
    heard = anyio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            heard.set()

    async with mcp_http_client(url, "legacy", key=KEYS["a"], message_handler=on_message) as client:
        for i in range(3):  # every replica serves one of these, so each holds a copy
            await client.call_tool("echo", {"i": i})
        sid = one_session(replicas, before)
        holder = await streaming(replicas, sid)
        other = (holder + 1) % 3
        assert sid in manager_of(replicas[other][0]).copies
        replicas[other][0].notify("tools_changed", {})  # heard by that replica only
        with anyio.fail_after(5):
            await heard.wait()


async def test_server_requests_are_answered_through_whichever_replica_the_answer_reaches(
        shared: Deployment) -> None:
    """A request to the client on a call's own stream (as a relayed elicitation is) and one on the
    standalone stream from a replica that does not hold it: the client's answer is a POST that the
    balancer may send anywhere, and it reaches the replica waiting for it."""
    replicas, url, _, _ = shared
    before = held(replicas)
    forwarded = sum(manager_of(gw).forwarded for gw, _ in replicas)
    asked: list[int] = []

    async def counted(ctx: Any) -> types.ListRootsResult:
        asked.append(1)
        return await list_roots(ctx)

    async with mcp_http_client(url, "legacy", key=KEYS["a"], list_roots_callback=counted) as client:
        for _ in range(6):  # asked from each replica; answers land on the next one
            result = await client.call_tool("ask", {})
            assert isinstance(result.content[0], types.TextContent)
            assert result.content[0].text == "file:///work"
        sid = one_session(replicas, before)
        holder = await streaming(replicas, sid)
        other = manager_of(replicas[(holder + 1) % 3][0]).copies[sid]
        with anyio.fail_after(5):
            roots = await other.connection.send_request(types.ListRootsRequest())
        assert str(roots.roots[0].uri) == "file:///work"
    assert len(asked) == 7
    assert sum(manager_of(gw).forwarded for gw, _ in replicas) > forwarded


async def test_the_session_record_carries_capabilities_and_log_level_to_every_replica(
        shared: Deployment) -> None:
    replicas, url, _, pre = shared
    before = held(replicas)
    async with mcp_http_client(url, "legacy", key=KEYS["a"], list_roots_callback=list_roots) as client:
        for i in range(3):  # every replica holds a copy before the level is set on one of them
            await client.call_tool("echo", {"i": i})
        sid = one_session(replicas, before)
        await client.set_logging_level("error")
        await client.call_tool("echo", {})

        async def everywhere() -> bool:
            return all(face_of(gw)._log_levels.get(id(manager_of(gw).copies[sid].connection))
                       == "error" for gw, _ in replicas)

        await wait_until(everywhere, timeout=5)
        for gw, _ in replicas:
            connection = manager_of(gw).copies[sid].connection
            assert connection.protocol_version == "2025-11-25"
            assert connection.client_params is not None
            assert connection.client_params.client_info.name
            assert connection.client_capabilities is not None
            assert connection.client_capabilities.roots is not None
        async with aioredis.Redis.from_url(redis_url()) as r:
            keys = [k async for k in r.scan_iter(match=f"{pre}:mcp:*:s:{sid}")]
            assert len(keys) == 1
            record = await r.hgetall(keys[0])
            assert record[b"level"] == b"error"
            assert json.loads(record[b"owner"])["client_id"] == "a"
            assert 0 < await r.pttl(keys[0]) <= 1800_000  # server.mcp.session_idle_s


async def test_delete_ends_the_session_on_every_replica(shared: Deployment) -> None:
    replicas, url, _, pre = shared
    before = held(replicas)
    async with httpx.AsyncClient() as http:
        async with mcp_http_client(url, "legacy", key=KEYS["a"]) as client:
            for i in range(3):
                await client.call_tool("echo", {"i": i})
            sid = one_session(replicas, before)
            assert all(sid in manager_of(gw).copies for gw, _ in replicas)
        # the client's DELETE went to one replica; every copy ends, and so does the record

        async def gone() -> bool:
            return not any(sid in manager_of(gw).copies for gw, _ in replicas)

        await wait_until(gone, timeout=5)
        async with aioredis.Redis.from_url(redis_url()) as r:
            assert [k async for k in r.scan_iter(match=f"{pre}:mcp:*:s:{sid}")] == []
        for _, base in replicas:
            r = await http.post(base + "/mcp", json=LIST, headers=_headers(KEYS["a"], sid))
            assert r.status_code == 404


def _headers(key: str, sid: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "mcp-session-id": sid,
            "mcp-protocol-version": "2025-11-25", "accept": "application/json, text/event-stream"}


async def test_a_session_is_not_found_with_another_key_on_any_replica(shared: Deployment) -> None:
    replicas, url, _, _ = shared
    before = held(replicas)
    async with httpx.AsyncClient() as http, mcp_http_client(url, "legacy", key=KEYS["a"]) as client:
        await client.call_tool("echo", {})
        sid = one_session(replicas, before)
        for _, base in replicas:  # those holding a copy and those that would rebuild it
            r = await http.post(base + "/mcp", json=LIST, headers=_headers(KEYS["b"], sid))
            assert r.status_code == 404
        await client.call_tool("echo", {})  # and it still works for its own key


async def test_an_expired_record_ends_the_session_where_it_is_not_held(shared: Deployment) -> None:
    replicas, _, _, pre = shared
    before = held(replicas)
    (_, first), (_, second) = replicas[:2]
    async with httpx.AsyncClient() as http, \
            mcp_http_client(first + "/mcp", "legacy", key=KEYS["a"]) as client:
        await client.call_tool("echo", {})
        sid = one_session(replicas, before)
        async with aioredis.Redis.from_url(redis_url()) as r:
            keys = [k async for k in r.scan_iter(match=f"{pre}:mcp:*:s:{sid}")]
            await r.pexpire(keys[0], 1)  # as if idle for server.mcp.session_idle_s everywhere
            await wait_until(lambda: _absent(r, keys[0]), timeout=2)
        got = await http.post(second + "/mcp", json=LIST, headers=_headers(KEYS["a"], sid))
        assert got.status_code == 404


async def _absent(r: Any, key: bytes) -> bool:
    return not await r.exists(key)


async def test_a_2025_03_26_batch_is_served_by_a_replica_that_did_not_open_its_session(
        shared: Deployment) -> None:
    """The one revision with JSON-RPC arrays, known from the session's record (no header says it)."""
    replicas, _, _, _ = shared
    accept = {"accept": "application/json, text/event-stream", "authorization": f"Bearer {KEYS['a']}"}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    (_, first), (_, second) = replicas[:2]
    async with httpx.AsyncClient() as http:
        opened = await http.post(first + "/mcp", json=init, headers=accept)
        session = {**accept, "mcp-session-id": opened.headers["mcp-session-id"]}
        await http.post(first + "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                        headers=session)
        r = await http.post(second + "/mcp", headers=session, json=[
            {"jsonrpc": "2.0", "id": n, "method": "tools/call",
             "params": {"name": "echo", "arguments": {"x": n}}} for n in (1, 2)])
        await http.delete(first + "/mcp", headers=session)
    assert r.status_code == 200
    assert [x["result"]["structuredContent"] for x in r.json()] == [{"x": 1}, {"x": 2}]


async def test_concurrent_first_requests_on_a_replica_share_one_rebuilt_copy(shared: Deployment) -> None:
    replicas, _, _, _ = shared
    (_, first), (gw, second) = replicas[:2]
    accept = {"accept": "application/json, text/event-stream", "authorization": f"Bearer {KEYS['a']}"}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    rebuilt = manager_of(gw).rebuilt
    async with httpx.AsyncClient() as http:
        opened = await http.post(first + "/mcp", json=init, headers=accept)
        sid = opened.headers["mcp-session-id"]
        codes: list[int] = []

        async def call(n: int) -> None:
            body = {"jsonrpc": "2.0", "id": n, "method": "tools/call",
                    "params": {"name": "echo", "arguments": {"n": n}}}
            codes.append((await http.post(second + "/mcp", json=body, headers=_headers(KEYS["a"], sid)))
                         .status_code)

        async with anyio.create_task_group() as tg:
            for n in range(8):
                tg.start_soon(call, n)
        await http.delete(first + "/mcp", headers=_headers(KEYS["a"], sid))
    assert codes == [200] * 8
    assert manager_of(gw).rebuilt == rebuilt + 1


async def test_every_question_reaches_its_client_whichever_replica_each_request_reaches(
        shared: Deployment) -> None:
    """An upstream's questions mid-call (elicitation in both modes, sampling, roots), relayed to
    clients of both eras from upstreams of both eras: a handshake-era client answers with a POST
    that may reach any replica; a 2026-07-28 client retries its call with the answers (the call
    is held open on the replica that runs it, against a handshake-era upstream), and the retry
    may reach any replica too."""
    from tests.test_mcp_asking import CASES, Answers, text

    replicas, url, proxy, _ = shared
    before = len(proxy.served)
    forwarded = sum(manager_of(gw).forwarded for gw, _ in replicas)
    for mode in ("legacy", "auto"):
        for up in ("up", "leg"):
            answers = Answers()
            async with mcp_http_client(url, mode, key=KEYS["a"], **answers.callbacks()) as client:
                for tool, args, expected, _ in CASES:
                    with anyio.fail_after(10):
                        result = await client.call_tool(f"{up}_{tool}", args)
                    assert text(result) == expected, (mode, up, tool)
            assert answers.asked == [c[3] for c in CASES]
    assert set(proxy.served[before:]) == {0, 1, 2}
    assert sum(manager_of(gw).forwarded for gw, _ in replicas) > forwarded


async def test_a_killed_replica_loses_no_session(shared: Deployment) -> None:
    """A replica of the deployment that is a ``multiplexer serve`` process, SIGKILLed while
    sessions are open: the balancer skips it and every session goes on through the others."""
    replicas, _, _, _ = shared
    spare: subprocess.Popen[bytes] = SPARE["proc"]
    async with httpx.AsyncClient() as http:
        async def healthy() -> bool:
            try:
                return (await http.get(SPARE["url"] + "/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_until(healthy, timeout=60, poll=0.05)
    async with AsyncExitStack() as stack:
        base, proxy = await stack.enter_async_context(
            round_robin([replicas[0][1], replicas[1][1], SPARE["url"]]))
        clients = [await stack.enter_async_context(
            mcp_http_client(base + "/mcp", "legacy", key=KEYS["a"])) for _ in range(3)]
        for n, client in enumerate(clients):
            await client.call_tool("echo", {"n": n})
        assert 2 in proxy.served  # the process replica opened or served sessions
        spare.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(spare.wait, 10)
        for _ in range(3):
            for n, client in enumerate(clients):
                result = await client.call_tool("echo", {"n": n, "after": True})
                assert result.structured_content == {"n": n, "after": True}


async def test_with_redis_down_a_new_session_stays_on_its_replica_and_outlives_the_outage() -> None:
    """Opened while Redis is unreachable: served where it was opened (another replica cannot know
    it: 404), counted as degraded, and not ended by the replica's next touch once Redis is back
    (it has no record there to touch)."""
    from tests.redis_helpers import own_redis

    with own_redis() as server:
        data = config(prefix(), session_idle_s=1.0)  # a touch every 0.1 s
        data["state"]["url"] = server.url
        gateways = [running(parse_config(data)) for _ in range(2)]
        async with together(gateways) as replicas, httpx.AsyncClient() as http:
            (gw, first), (_, second) = replicas
            server.stop()
            async with mcp_http_client(first + "/mcp", "legacy", key=KEYS["a"]) as client:
                await client.call_tool("echo", {})
                (sid,) = manager_of(gw).copies
                assert not manager_of(gw).copies[sid].shared
                got = await http.post(second + "/mcp", json=LIST, headers=_headers(KEYS["a"], sid))
                assert got.status_code == 404
                assert "mcp_sessions" in gw.metrics.render().decode()
                server.start()
                for n in range(5):  # past several touch intervals, Redis answering again
                    result = await client.call_tool("echo", {"n": n})
                    assert result.structured_content == {"n": n}
                    await anyio.sleep(0.05)
