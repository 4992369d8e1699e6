"""The request log's batch lines: every line of a batch job that ran, whether the gateway ran it
or a vendor's batch API did (``/v1/batches``, Message Batches, ``jobs.submit``, MCP tasks), ends
as one record carrying its batch's id, its status, tokens and cost (a vendor batch's at its batch
price, ``mode: batch``); ``batch_id`` finds them, and a caller's key sees only its own."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.records.request_store import Query
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.remote_helpers import Events, fakes, remote_config_data, user
from tests.test_v1_batches import jsonl, line, until_ended
from tests.test_v1_openai import KEY, ask, v1_config

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "b" * 28
BOB = "sk-log-bob-0123456789"


async def lines_of(gw: Gateway, batch_id: str) -> list[dict[str, Any]]:
    assert gw.requests is not None
    await gw.requests.sink.flush()
    return (await gw.requests.page(Query(batch_id=batch_id)))["requests"]


async def job_lines(f: Any, tmp_path: Path, texts: tuple[str, ...],
                    **provider: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``jobs.submit`` of one chat call per text on the fakes' OpenAI provider (``provider``:
    its settings), run to its end: the job, and the records under its id."""
    data = remote_config_data(f, tmp_path)
    data["providers"]["oai"].update(provider)
    async with running(parse_config(data), port=0) as (gw, url), Client(url) as client:
        events = Events()
        gw.listeners.append(events)
        calls = [{"method": "chat", "params": {"model": "gpt-test", **user(text)}} for text in texts]
        job = await client.call("jobs.submit", {"calls": calls})
        await events.wait("batch_job_ended")
        return job, await lines_of(gw, job["job_id"])


async def test_a_v1_batch_s_vendor_lines_are_recorded_at_the_batch_price(tmp_path: Path) -> None:
    async with fakes() as f:
        data = v1_config(f, tmp_path, admin_key=ADMIN)
        data["server"]["api_keys"]["bob"] = BOB
        async with running(parse_config(data), port=0) as (gw, url), \
                openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
            rows = [line(f"q{i}", {"model": "gpt-4o-mini", "messages": ask("hello there")})
                    for i in range(3)]
            rows.append(line("bad", {"model": "gpt-4o-mini", "messages": ask("please FAIL")}))
            upload = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id,
                                                endpoint="/v1/chat/completions", completion_window="24h")
            assert (await until_ended(client, batch.id)).status == "completed"
            found = await lines_of(gw, batch.id)
            assert sorted((r["status"], r["mode"], r["key"], r["route"], r["model"]) for r in found) == [
                ("error", "batch", "alice", "chat", "gpt-4o-mini")] + [
                ("ok", "batch", "alice", "chat", "gpt-4o-mini")] * 3
            # 2 words in, 3 out at gpt-4o-mini's $0.15 / $0.60 per million, half price in a batch
            one = (2 * Decimal("0.15") + 3 * Decimal("0.6")) / 2 * 1000  # nano-dollars
            ok = [r for r in found if r["status"] == "ok"]
            assert {(r["input_tokens"], r["output_tokens"], r["cost"]) for r in ok} == {(2, 3, int(one))}
            assert all(r["batch_id"] == batch.id and r["face"] == "v1" for r in found)
            bad = next(r for r in found if r["status"] == "error")
            assert "FAIL" in bad["error"] and bad["code"] is not None and bad["cost"] is None

            async with httpx.AsyncClient(base_url=url) as http:  # its owner's rows, no one else's
                mine = await http.get("/ui/api/requests", params={"batch_id": batch.id},
                                      headers={"authorization": f"Bearer {KEY}"})
                theirs = await http.get("/ui/api/requests", params={"batch_id": batch.id},
                                        headers={"authorization": f"Bearer {BOB}"})
                admin = await http.get("/admin/requests", params={"batch_id": batch.id},
                                       headers={"authorization": f"Bearer {ADMIN}"})
            assert len(mine.json()["requests"]) == 4 and theirs.json()["requests"] == []
            assert len(admin.json()["requests"]) == 4


async def test_a_message_batch_s_vendor_lines_carry_its_id(tmp_path: Path) -> None:
    anthropic = pytest.importorskip("anthropic")
    async with fakes() as f, running(parse_config(v1_config(f, tmp_path)), port=0) as (gw, url), \
            anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0) as client:
        requests = [{"custom_id": f"m{i}", "params": {"model": "claude-sonnet-4-5", "max_tokens": 16,
                                                        "messages": ask(f"hi {i}")}} for i in range(2)]
        batch = await client.messages.batches.create(requests=requests)
        events = Events()
        gw.listeners.append(events)
        while (await client.messages.batches.retrieve(batch.id)).processing_status != "ended":
            await events.wait("batch_job_ended")
        found = await lines_of(gw, batch.id)
        assert [(r["status"], r["mode"], r["route"]) for r in found] == [("ok", "batch", "claude")] * 2
        assert all(r["input_tokens"] and r["output_tokens"] for r in found)


async def test_jobs_submit_lines_are_recorded_whether_a_batch_api_or_the_sync_endpoint_ran_them(
        tmp_path: Path) -> None:
    for batch_api in (True, False):
        async with fakes() as f:
            job, found = await job_lines(f, tmp_path / str(batch_api), ("a", "b", "FAIL c"),
                                         batch_api=batch_api)
        submit = [r for r in found if r["method"] == "jobs.submit"]  # the call that made the job
        assert [(r["face"], r["status"]) for r in submit] == [("rpc", "ok")]
        found = [r for r in found if r not in submit]
        assert sorted((r["status"], r["mode"], r["face"], r["method"]) for r in found) == [
            ("error", "batch" if batch_api else "sync", "jobs", "chat")] + [
            ("ok", "batch" if batch_api else "sync", "jobs", "chat")] * 2, batch_api
        assert all(r["batch_id"] == job["job_id"] and r["model"] == "gpt-test" for r in found)
        assert all(r["input_tokens"] is not None for r in found if r["status"] == "ok")


async def test_an_mcp_task_s_line_is_recorded_under_its_job(tmp_path: Path) -> None:
    from tests.mcp_helpers import McpHttp
    from tests.test_mcp_tasks import KEYS, config, finished

    async with fakes() as f, running(parse_config(config(f, tmp_path))) as (gw, base), \
            httpx.AsyncClient(timeout=30) as http:
        events = Events()
        gw.listeners.append(events)  # after the log's own: it has queued the lines when this hears
        alice = McpHttp(http, base + "/mcp", KEYS["alice"])
        created = (await alice.call("chat_task", user("hello")))["result"]
        assert (await finished(alice, created["taskId"]))["status"] == "completed"
        await events.wait("batch_results")  # a task reads completed once its result is stored,
        # which is before the provider tells the listeners what the line cost
        job_id = created["taskId"].rpartition(".")[0]
        found = [r for r in await lines_of(gw, job_id) if r["face"] == "mcp"]
        assert [(r["method"], r["status"], r["mode"], r["key"]) for r in found] == [
            ("chat_task", "ok", "batch", "alice")]


@pytest.mark.parametrize("ending", ["failed", "expired"])
async def test_lines_a_vendor_batch_ended_without_running_are_recorded_as_errors(
        tmp_path: Path, ending: str) -> None:
    """A line the vendor never ran still ends for its caller (an error in its job's results), so
    it ends as a record too: every line of a batch that failed whole; the lines an expired batch
    left, once no resubmission is allowed. The lines that ran are recorded as before."""
    knobs = {"force_status": "failed"} if ending == "failed" else {"expire_after_items": 1}
    async with fakes(**knobs) as f:
        if ending == "expired":
            f.openai.force_status = "expired"
        job, found = await job_lines(f, tmp_path, ("a", "b", "c"), batch_api=True,
                                     batch_resubmit_expired=False)
    found = [r for r in found if r["method"] != "jobs.submit"]
    statuses = sorted(r["status"] for r in found)
    assert statuses == (["error"] * 3 if ending == "failed" else ["error", "error", "ok"])
    assert all(r["mode"] == "batch" and r["face"] == "jobs" and r["batch_id"] == job["job_id"]
               for r in found)
    errors = [r for r in found if r["status"] == "error"]
    assert all(r["cost"] is None and r["code"] is not None for r in errors)
    assert all(("expired" if ending == "expired" else "fail") in r["error"].lower() for r in errors)
