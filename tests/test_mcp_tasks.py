"""Long calls as MCP tasks (io.modelcontextprotocol/tasks) against the fake OpenAI batch API.

The client is plain HTTP speaking 2026-07-28, so every header and field the
extension names is visible here; the SDK's own client has no tasks runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.mcp_helpers import TASKS, McpHttp, mcp_http_client, wait_until
from tests.quota_helpers import Claims, batch_claim, request_claim
from tests.remote_helpers import Fakes, fakes, remote_config_data, reply_text, user

pytestmark = pytest.mark.anyio

KEYS = {"alice": "key-alice", "bob": "key-bob"}


def config(f: Fakes, tmp_path: Path) -> dict[str, Any]:
    data = remote_config_data(f, tmp_path)
    data["server"] = {"host": "127.0.0.1", "port": 0, "api_keys": KEYS}
    data["routes"]["chat_task"] = {"provider": "oai", "operation": "chat", "task": True,
                                   "params": {"model": "gpt-test"}}
    for name, cap in (("chat_pair", 2), ("chat_slow", 10)):  # tasks share a job until cap or 60 s
        data["routes"][name] = {"provider": "oai", "operation": "chat", "mode": "batch",
                                "params": {"model": "gpt-test"},
                                "batch": {"max_items": cap, "max_wait_ms": 60_000}}
    return data


async def finished(client: McpHttp, task_id: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def ended() -> bool:
        seen.update((await client.task("tasks/get", task_id))["result"])
        return seen["status"] != "working"

    await wait_until(ended, timeout=30)
    return seen


def text_of(result: dict[str, Any]) -> str:
    return str(reply_text(result["structuredContent"]))


async def test_batch_calls_become_tasks_for_clients_that_opt_in(tmp_path: Path) -> None:
    async with fakes(polls_to_complete=10**9) as f, running(parse_config(config(f, tmp_path))) as (gw, base):
        url = base + "/mcp"
        async with httpx.AsyncClient(timeout=30) as http:
            alice, bob = McpHttp(http, url, KEYS["alice"]), McpHttp(http, url, KEYS["bob"])
            discovered = await alice.send("server/discover", {})
            assert TASKS in discovered["result"]["capabilities"]["extensions"]

            created = (await alice.call("chat_batch", user("hello")))["result"]
            assert created["resultType"] == "task" and created["status"] == "working"
            assert created["pollIntervalMs"] >= 1000 and created["ttlMs"] == 7 * 24 * 3600 * 1000
            task_id = created["taskId"]
            store = gw.faces["jobs"].store()
            job_id, _, idx = task_id.rpartition(".")
            assert store.page(job_id, int(idx), 1)[0][:2] == (int(idx), "queued")  # stored before the answer
            assert (await alice.task("tasks/get", task_id))["result"]["status"] == "working"

            # Bearer handles bound to the key: another key, a made-up id, a missing Mcp-Name.
            theirs = (await bob.task("tasks/get", task_id))["error"]
            unknown = (await alice.task("tasks/get", "job_0000000000000000.0"))["error"]
            assert (theirs["code"], theirs["message"]) == (unknown["code"], unknown["message"]) == (
                -32602, "Unknown task")
            assert (await alice.task("tasks/get", task_id, name=None))["error"]["code"] == -32020

            f.openai.polls_to_complete = 1  # the remote batch ends
            done = await finished(alice, task_id)
            assert done["status"] == "completed" and done["resultType"] == "complete"
            assert not done["result"]["isError"] and text_of(done["result"]) == "echo: hello"

            failing = (await alice.call("chat_task", user("this should FAIL")))["result"]
            assert failing["resultType"] == "task"  # task: true on a sync route
            failed = await finished(alice, failing["taskId"])
            assert failed["status"] == "completed" and failed["result"]["isError"] is True
            assert "FAIL" in failed["result"]["content"][0]["text"]

            # Without the opt-in: the blocking call, as before.
            plain = (await McpHttp(http, url, KEYS["alice"], tasks=False).call("chat_batch", user("plain")))
            assert plain["result"]["resultType"] == "complete" and text_of(plain["result"]) == "echo: plain"
            assert (await alice.call("chat_task", user("x")))["result"]["resultType"] == "task"
            assert (await McpHttp(http, url, KEYS["bob"], tasks=False).call("chat_task", user("sync")))[
                "result"]["resultType"] == "complete"

        # A handshake-era client cannot opt in: the SDK client gets the call's result.
        async with mcp_http_client(url, "legacy", key=KEYS["alice"]) as legacy:
            result = await legacy.call_tool("chat_batch", user("old"))
            assert reply_text(result.structured_content) == "echo: old"


async def test_tasks_share_batches_cancel_alone_and_survive_a_restart(tmp_path: Path) -> None:
    async with fakes(polls_to_complete=10**9) as f:
        cfg = parse_config(config(f, tmp_path))
        async with running(cfg) as (_, base), httpx.AsyncClient(timeout=30) as http:
            alice = McpHttp(http, base + "/mcp", KEYS["alice"])
            stopped = (await alice.call("chat_pair", user("stop me")))["result"]["taskId"]
            kept = (await alice.call("chat_pair", user("keep me")))["result"]["taskId"]
            assert stopped.rpartition(".")[0] == kept.rpartition(".")[0]  # one job: the cap sealed it

            async def one_batch() -> bool:
                return len(f.openai.batches) == 1

            await wait_until(one_batch)
            assert (await McpHttp(http, base + "/mcp", KEYS["bob"]).task("tasks/cancel", stopped))[
                "error"]["message"] == "Unknown task"
            ack = (await alice.task("tasks/cancel", stopped))["result"]
            assert ack["resultType"] == "complete" and set(ack) <= {"resultType", "_meta"}  # empty
            assert (await alice.task("tasks/get", stopped))["result"]["status"] == "cancelled"
            assert (await alice.task("tasks/get", kept))["result"]["status"] == "working"
            (shared,) = f.openai.batches.values()
            assert shared.status not in ("cancelling", "cancelled")  # the other task still needs it

            alone = (await alice.call("chat_batch", user("alone")))["result"]["taskId"]

            async def two_batches() -> bool:  # its window (50 ms) sealed it: it has a batch of its own
                return len(f.openai.batches) == 2

            await wait_until(two_batches)
            await alice.task("tasks/cancel", alone)  # so that batch is cancelled upstream
            assert (await finished(alice, alone))["status"] == "cancelled"
            assert any(b.status in ("cancelling", "cancelled") for b in f.openai.batches.values())

            left_open = (await alice.call("chat_slow", user("in the window")))["result"]["taskId"]

        f.openai.polls_to_complete = 1
        async with running(cfg) as (gw, base), httpx.AsyncClient(timeout=30) as http:
            alice = McpHttp(http, base + "/mcp", KEYS["alice"])
            done = await finished(alice, kept)  # the new gateway picked the stored job up again
            assert done["status"] == "completed" and text_of(done["result"]) == "echo: keep me"
            await cancel_survived(alice, gw, stopped)
            sealed = await finished(alice, left_open)  # its window died with the old gateway
            assert sealed["status"] == "completed" and text_of(sealed["result"]) == "echo: in the window"


async def cancel_survived(client: McpHttp, gw: Gateway, task_id: str) -> None:
    """The task is still cancelled, and its line of the finished shared batch was never stored."""
    got = (await client.task("tasks/get", task_id))["result"]
    assert (got["status"], "result" in got) == ("cancelled", False)
    store = gw.faces["jobs"].store()
    job_id, _, idx = task_id.rpartition(".")

    async def ended() -> bool:  # the batch ran on for the task that shares it, and ended
        job = store.job(job_id)
        return job is not None and job.state == "done"

    await wait_until(ended)
    ((_, state, result, error, _),) = store.page(job_id, int(idx), 1)
    assert (state, result, error["code"], error["data"]) == (
        "failed", None, -32004, {"detail": "task cancelled"})


async def test_a_cancel_is_seen_by_every_replica_and_after_a_restart_on_postgres(tmp_path: Path) -> None:
    """Two replicas on one PostgreSQL store: a cancel on one is what the other reports, and
    what a gateway started after both stopped reports; the shared batch still serves the other task."""
    from tests.pg_helpers import throwaway_db

    with throwaway_db() as db:
        async with fakes(polls_to_complete=10**9) as f:
            data = config(f, tmp_path)
            data["store"] = {"url": db}  # the stopped replicas hand the batch back: no lease to wait out
            cfg = parse_config(data)
            async with running(cfg) as (_, one), running(cfg) as (_, two), \
                    httpx.AsyncClient(timeout=30) as http:
                first, second = (McpHttp(http, base + "/mcp", KEYS["alice"]) for base in (one, two))
                stopped = (await first.call("chat_pair", user("stop me")))["result"]["taskId"]
                kept = (await first.call("chat_pair", user("keep me")))["result"]["taskId"]

                async def one_batch() -> bool:
                    return len(f.openai.batches) == 1

                await wait_until(one_batch)
                await first.task("tasks/cancel", stopped)
                assert (await second.task("tasks/get", stopped))["result"]["status"] == "cancelled"
                assert (await second.task("tasks/get", kept))["result"]["status"] == "working"
                (shared,) = f.openai.batches.values()
                assert shared.status not in ("cancelling", "cancelled")

            f.openai.polls_to_complete = 1
            async with running(cfg) as (gw, base), httpx.AsyncClient(timeout=30) as http:
                alice = McpHttp(http, base + "/mcp", KEYS["alice"])
                done = await finished(alice, kept)
                assert done["status"] == "completed" and text_of(done["result"]) == "echo: keep me"
                await cancel_survived(alice, gw, stopped)


async def test_tasks_on_a_concurrency_1_key_each_request_charged_once(tmp_path: Path) -> None:
    """A task's creation is its key's one charge (the job it is stored in is no second call of the
    key) plus its one call against batch_calls_per_day; tasks/get and tasks/cancel one each."""
    async with fakes(polls_to_complete=10**9) as f:
        data = config(f, tmp_path)
        data["server"]["quotas"] = {"alice": {"concurrency": 1, "batch_calls_per_day": 2}}
        async with running(parse_config(data)) as (gw, base), httpx.AsyncClient(timeout=30) as http:
            alice, claims, one = McpHttp(http, base + "/mcp", KEYS["alice"]), Claims(gw.quotas), [
                request_claim("alice")]
            created, asked = await claims.of(alice.call("chat_batch", user("hello")))
            assert created["result"]["resultType"] == "task" and asked == [*one, batch_claim("alice", 1)]
            task_id = created["result"]["taskId"]
            got, asked = await claims.of(alice.task("tasks/get", task_id))
            assert got["result"]["status"] == "working" and asked == one
            f.openai.polls_to_complete = 1
            assert text_of((await finished(alice, task_id))["result"]) == "echo: hello"

            second = (await alice.call("chat_batch", user("stop")))["result"]["taskId"]
            ack, asked = await claims.of(alice.task("tasks/cancel", second))
            assert "error" not in ack and asked == one
            assert (await alice.task("tasks/get", second))["result"]["status"] == "cancelled"

            third = (await alice.call("chat_batch", user("one too many")))["result"]
            assert third["isError"] is True and "batch_calls_per_day" in str(third["content"])


def test_task_is_a_route_key() -> None:
    routes = parse_config({"providers": {"e": {"kind": "echo"}},
                           "routes": {"a": {"provider": "e", "task": True}}}).routes
    assert routes["a"].task is True and Gateway  # config accepts it; only batch providers act on it


async def test_a_task_whose_batch_expires_failed(tmp_path: Path) -> None:
    """Expired twice (the gateway resubmits once): the call never ran, so the task failed with the error."""
    async with fakes(force_status="expired", expire_after_items=0) as f, \
            running(parse_config(config(f, tmp_path))) as (_, base), httpx.AsyncClient(timeout=30) as http:
        alice = McpHttp(http, base + "/mcp", KEYS["alice"])
        task_id = (await alice.call("chat_batch", user("late")))["result"]["taskId"]
        failed = await finished(alice, task_id)
        assert failed["status"] == "failed" and "result" not in failed
        assert failed["error"]["data"]["expired"] is True and isinstance(failed["error"]["code"], int)
