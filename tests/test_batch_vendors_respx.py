"""Azure OpenAI, Mistral, Groq and Together against respx: request shapes (paths, api-version,
headers, lines), sync calls and streams, and batches with shuffled output, failed lines,
upper-case statuses, crashes mid-submission and the vendors' quotas."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
import respx

from multiplexer.core.call import Outcome
from multiplexer.core.errors import Code
from multiplexer.core.sink import ChunkSink
from providers.azure_openai import AzureOpenAIProvider
from providers.batch.backend import Planned, plan_parts
from providers.mistral import MistralProvider
from providers.openai import OpenAIProvider
from tests.remote_helpers import (
    InstantClock,
    body,
    chat_reply,
    die_after_create,
    embedding_reply,
    item,
    make_provider,
    restart_until_done,
    started,
)
from tests.test_batch_openai_respx import BatchApi, jsonl, ok_line

pytestmark = pytest.mark.anyio
AZ = "http://az.test"
MI = "https://mi.test"


def chats(p: Any, texts: list[str], model: str = "m", mode: str = "batch") -> list[Any]:
    return [item(p, "chat", {"model": model, "messages": [{"role": "user", "content": t}]}, mode=mode)
            for t in texts]


def texts_of(outcomes: list[Outcome]) -> list[Any]:
    return [o.result["choices"][0]["message"]["content"] if o.ok else o.error for o in outcomes]


def shuffled_with_failure(ending: str, lines: list[dict[str, Any]]):
    """Every line answered in a shuffled order, the second one failed (in the error file)."""
    ids = [x["custom_id"] for x in lines]
    out = [ok_line(x["custom_id"], "re: " + x["body"]["messages"][0]["content"])
           for i, x in enumerate(lines) if i != 1]
    out = out[1:] + out[:1]
    err = [{"custom_id": ids[1], "response": {"status_code": 400, "body": {
        "error": {"message": "bad line", "code": "invalid_request"}}}, "error": None}]
    return out, err, {}


# -- Azure OpenAI ---------------------------------------------------------------------------

def azure(tmp_path: Any, **settings: Any) -> Any:
    return make_provider(AzureOpenAIProvider, {"endpoint": AZ, "api_key": "az-secret",
                                               "batch_poll_interval_s": 5, **settings},
                         tmp_path, clock=InstantClock())


class AzureBatches(BatchApi):
    """Azure's Batch API: capitalised statuses in replies (the REST samples)."""

    def poll(self, request: httpx.Request, bid: str) -> httpx.Response:
        reply = super().poll(request, bid)
        data = json.loads(reply.content)
        data["status"] = data["status"].capitalize()
        return httpx.Response(200, json=data)


async def test_azure_sync_chat_embeddings_and_stream_go_to_the_deployment(tmp_path):
    p = azure(tmp_path)
    with respx.mock(base_url=AZ, assert_all_called=False) as mock:
        chat = mock.post("/openai/deployments/gpt-4o/chat/completions").mock(
            return_value=httpx.Response(200, json=chat_reply("hi")))
        embed = mock.post("/openai/deployments/embed-3/embeddings").mock(
            side_effect=lambda r: httpx.Response(200, json=embedding_reply(body(r)["input"])))
        sse = ('data: {"choices":[{"index":0,"delta":{"content":"he"}}]}\n\n'
               'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
               "data: [DONE]\n\n")
        async with started(p):
            out = await p.execute("chat", chats(p, ["x"], model="gpt-4o", mode="sync"))
            vecs = await p.execute("embeddings", [item(p, "embeddings", {"model": "embed-3", "input": t})
                                                  for t in ("a", "b")])
            chat.mock(return_value=httpx.Response(200, text=sse,
                                                  headers={"content-type": "text/event-stream"}))
            send, recv = anyio.create_memory_object_stream[Any](10)
            streamed = await p.stream(chats(p, ["y"], model="gpt-4o", mode="sync")[0], ChunkSink(send))
            send.close()
            chunks = [c async for c in recv]
    assert texts_of(out) == ["hi"] and [v.ok for v in vecs] == [True, True]
    first = chat.calls[0].request
    assert first.url.params["api-version"] == "2024-10-21"
    assert first.headers["api-key"] == "az-secret" and "authorization" not in first.headers
    assert embed.call_count == 1 and body(embed.calls[0].request)["input"] == ["a", "b"]  # packed
    assert streamed.ok and streamed.result["usage"]["total_tokens"] == 2
    assert chunks[0]["choices"][0]["delta"]["content"] == "he"


async def test_azure_v1_api_uses_openai_paths_without_deployments(tmp_path):
    p = azure(tmp_path, api_version="v1")
    with respx.mock(base_url=AZ, assert_all_called=False) as mock:
        chat = mock.post("/openai/v1/chat/completions").mock(
            return_value=httpx.Response(200, json=chat_reply("v1")))
        async with started(p):
            out = await p.execute("chat", chats(p, ["x"], model="gpt-4o", mode="sync"))
    assert texts_of(out) == ["v1"]
    sent = chat.calls[0].request
    assert "api-version" not in sent.url.params and body(sent)["model"] == "gpt-4o"


async def test_azure_batch_lines_carry_the_deployment_and_statuses_are_capitalised(tmp_path):
    p = azure(tmp_path)
    with respx.mock(base_url=AZ + "/openai", assert_all_called=False) as mock:
        api = AzureBatches(mock, ["completed"], shape=shuffled_with_failure)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c", "d"], model="gpt-4o-batch"))
    assert [o.ok for o in out] == [True, False, True, True]
    assert texts_of([out[0], out[2], out[3]]) == ["re: a", "re: c", "re: d"]
    assert out[1].error.data["detail"] == "bad line" and out[1].error.data["upstream_status"] == 400
    assert {x["body"]["model"] for x in api.lines["file-in-1"]} == {"gpt-4o-batch"}
    assert {x["url"] for x in api.lines["file-in-1"]} == {"/v1/chat/completions"}
    spec = api.creates[0]
    assert spec["endpoint"] == "/chat/completions" and spec["completion_window"] == "24h"
    assert api.upload_route.calls[0].request.url.params["api-version"] == "2024-10-21"
    assert api.create_route.calls[0].request.headers["api-key"] == "az-secret"


async def test_azure_full_quota_waits_instead_of_failing(tmp_path):
    p = azure(tmp_path)
    with respx.mock(base_url=AZ + "/openai", assert_all_called=False) as mock:
        api = AzureBatches(mock, ["completed"])
        full = httpx.Response(400, json={"error": {"code": "token_limit_exceeded", "message":
                                                   "Enqueued token limit reached"}})
        api.create_route.mock(side_effect=[full, full, api.create])
        mock.get("/batches").mock(return_value=httpx.Response(200, json={"data": [], "has_more": False}))
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"], model="gpt-4o-batch"))
    assert texts_of(out) == ["re: a", "re: b"]
    assert api.upload_route.call_count == 1 and len(api.creates) == 1  # one file, one batch
    assert p.ctx.clock.sleeps[:2] == [5.0, 10.0]  # backed off, not counted as failed tries


async def test_azure_crash_after_create_is_found_by_listing_with_the_api_version(tmp_path):
    items = chats(azure(tmp_path), ["a", "b"], model="gpt-4o-batch")
    with respx.mock(base_url=AZ + "/openai", assert_all_called=False) as mock:
        api = AzureBatches(mock, ["completed"])
        await die_after_create(api, azure(tmp_path), items)
        listing = mock.get("/batches").mock(side_effect=lambda r: httpx.Response(200, json={
            "data": [{"id": "batch_1", "metadata": api.creates[0]["metadata"], "status": "In_progress"}],
            "has_more": False}))
        part, rows = await restart_until_done(azure(tmp_path))
    assert part.state == "submitting" and len(api.creates) == 1
    params = listing.calls[0].request.url.params
    assert params["api-version"] == "2024-10-21" and params["limit"] == "100"
    assert [r[2]["choices"][0]["message"]["content"] for r in rows] == ["re: a", "re: b"]


async def test_azure_embeddings_on_a_batch_route_run_as_sync_calls(tmp_path):
    p = azure(tmp_path)
    with respx.mock(base_url=AZ, assert_all_called=False) as mock:
        embed = mock.post("/openai/deployments/embed-3/embeddings").mock(
            side_effect=lambda r: httpx.Response(200, json=embedding_reply([body(r)["input"]])))
        files = mock.post("/openai/files")
        async with started(p):
            out = await p.execute("embeddings", [item(p, "embeddings", {"model": "embed-3", "input": t},
                                                      mode="batch") for t in ("a", "b")])
    assert [o.ok for o in out] == [True, True] and embed.call_count == 2 and files.call_count == 0


# -- Mistral ----------------------------------------------------------------------------------

def mistral(tmp_path: Any, **settings: Any) -> Any:
    return make_provider(MistralProvider, {"base_url": MI, "api_key": "mi-secret",
                                           "batch_poll_interval_s": 5, **settings},
                         tmp_path, clock=InstantClock())


class MistralJobs:
    """A scripted /v1/batch/jobs: QUEUED, RUNNING, then the ending; output shuffled."""

    def __init__(self, mock: respx.MockRouter, endings: list[str], fail: int | None = None,
                 answered: int | None = None, polls: int = 2) -> None:
        self.endings, self.fail, self.answered, self.polls = list(endings), fail, answered, polls
        self.uploads: list[bytes] = []
        self.lines: dict[str, list[dict[str, Any]]] = {}
        self.creates: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.files: dict[str, bytes] = {}
        self.upload_route = mock.post("/v1/files").mock(side_effect=self.upload)
        self.create_route = mock.post("/v1/batch/jobs").mock(side_effect=self.create)
        self.list_route = mock.get("/v1/batch/jobs").mock(side_effect=self.list)
        mock.get(path__regex=r"/v1/batch/jobs/(?P<jid>[^/]+)$").mock(side_effect=self.poll)
        self.cancel_route = mock.post(path__regex=r"/v1/batch/jobs/(?P<jid>[^/]+)/cancel$").mock(
            side_effect=self.cancel)
        mock.get(path__regex=r"/v1/files/(?P<fid>[^/]+)/content$").mock(
            side_effect=lambda r, fid: httpx.Response(200, content=self.files[fid]))

    def upload(self, request: httpx.Request) -> httpx.Response:
        self.uploads.append(request.content)
        fid = f"file-{len(self.uploads)}"
        rows = request.content.replace(b"\r\n", b"\n").split(b"\n")
        self.lines[fid] = [json.loads(x) for x in rows if x.startswith(b'{"custom_id"')]
        return httpx.Response(200, json={"id": fid, "object": "file", "purpose": "batch"})

    def create(self, request: httpx.Request) -> httpx.Response:
        spec = json.loads(request.content)
        self.creates.append(spec)
        jid = f"job-{len(self.creates)}"
        self.jobs[jid] = {"id": jid, "status": "QUEUED", "polls": 0, "spec": spec,
                          "ending": self.endings.pop(0), "created_at": 1_700_000_000 + 1000}
        return httpx.Response(200, json={"id": jid, "status": "QUEUED", "metadata": spec["metadata"]})

    def list(self, request: httpx.Request) -> httpx.Response:
        data = [{"id": j["id"], "status": j["status"], "metadata": j["spec"]["metadata"],
                 "created_at": j["created_at"]} for j in self.jobs.values()]
        return httpx.Response(200, json={"object": "list", "data": data, "total": len(data)})

    def poll(self, request: httpx.Request, jid: str) -> httpx.Response:
        job = self.jobs[jid]
        job["polls"] += 1
        if job["status"] == "CANCELLATION_REQUESTED":
            job["status"] = "CANCELLED"
        elif job["polls"] >= self.polls:
            job["status"] = job["ending"]
            lines = self.lines[job["spec"]["input_files"][0]]
            done = lines if self.answered is None else lines[:self.answered]
            out = [{"custom_id": x["custom_id"], "response": {"status_code": 200, "body": chat_reply(
                "re: " + x["body"]["messages"][0]["content"])}}
                for i, x in enumerate(done) if i != self.fail]
            err = [{"custom_id": x["custom_id"], "response": {"status_code": 422, "body": {
                "object": "error", "message": "bad body", "code": "3001"}}}
                for i, x in enumerate(done) if i == self.fail]
            if out:
                self.files[f"{jid}-out"] = jsonl(list(reversed(out)))
                job["output_file"] = f"{jid}-out"
            if err:
                self.files[f"{jid}-err"] = jsonl(err)
                job["error_file"] = f"{jid}-err"
        else:
            job["status"] = "RUNNING"
        reply = {k: v for k, v in job.items() if k not in ("polls", "spec", "ending")}
        return httpx.Response(200, json={**reply, "total_requests": 3, "succeeded_requests": 0})

    def cancel(self, request: httpx.Request, jid: str) -> httpx.Response:
        self.jobs[jid]["status"] = "CANCELLATION_REQUESTED"
        return httpx.Response(200, json={"id": jid, "status": "CANCELLATION_REQUESTED"})


async def test_mistral_sync_chat_embeddings_and_stream(tmp_path):
    p = mistral(tmp_path)
    with respx.mock(base_url=MI, assert_all_called=False) as mock:
        chat = mock.post("/v1/chat/completions").mock(return_value=httpx.Response(200, json=chat_reply("ok")))
        embed = mock.post("/v1/embeddings").mock(
            side_effect=lambda r: httpx.Response(200, json=embedding_reply(body(r)["input"])))
        sse = ('data: {"choices":[{"index":0,"delta":{"content":"he"},"finish_reason":null}]}\n\n'
               'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}],'
               '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
               "data: [DONE]\n\n")
        async with started(p):
            out = await p.execute("chat", chats(p, ["x"], mode="sync"))
            vecs = await p.execute("embeddings", [
                item(p, "embeddings", {"model": "mistral-embed", "input": t}) for t in ("a", "b")])
            chat.mock(return_value=httpx.Response(200, text=sse,
                                                  headers={"content-type": "text/event-stream"}))
            send, recv = anyio.create_memory_object_stream[Any](10)
            streamed = await p.stream(chats(p, ["y"], mode="sync")[0], ChunkSink(send))
            send.close()
            chunks = [c async for c in recv]
    assert texts_of(out) == ["ok"] and [v.ok for v in vecs] == [True, True] and embed.call_count == 1
    assert chat.calls[0].request.headers["authorization"] == "Bearer mi-secret"
    sent = body(chat.calls[1].request)
    assert sent["stream"] is True and "stream_options" not in sent
    assert streamed.ok and streamed.result["usage"]["total_tokens"] == 2 and len(chunks) == 2


async def test_mistral_batch_job_shape_statuses_and_failed_lines(tmp_path):
    p = mistral(tmp_path)
    with respx.mock(base_url=MI, assert_all_called=False) as mock:
        api = MistralJobs(mock, ["SUCCESS"], fail=1)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c"], model="mistral-small"))
    assert [o.ok for o in out] == [True, False, True]
    assert texts_of([out[0], out[2]]) == ["re: a", "re: c"]
    assert out[1].error.data["detail"] == "bad body" and out[1].error.data["upstream_status"] == 422
    lines = api.lines["file-1"]
    assert all(set(x) == {"custom_id", "body"} for x in lines)  # no method / url on Mistral lines
    assert b'name="purpose"\r\n\r\nbatch' in api.uploads[0]
    spec = api.creates[0]
    assert spec["input_files"] == ["file-1"] and spec["endpoint"] == "/v1/chat/completions"
    assert spec["model"] == "mistral-small" and spec["timeout_hours"] == 24
    assert "multiplexer_part" in spec["metadata"]


async def test_mistral_timeout_resubmits_what_did_not_run(tmp_path):
    p = mistral(tmp_path)
    with respx.mock(base_url=MI, assert_all_called=False) as mock:
        api = MistralJobs(mock, ["TIMEOUT_EXCEEDED", "SUCCESS"], answered=1)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"]))
    assert texts_of(out) == ["re: a", "re: b"] and len(api.creates) == 2
    assert [x["body"]["messages"][0]["content"] for x in api.lines["file-2"]] == ["b"]


async def test_mistral_crash_after_create_is_found_by_its_metadata(tmp_path):
    p = mistral(tmp_path)
    items = chats(p, ["a", "b", "c"])
    with respx.mock(base_url=MI, assert_all_called=False) as mock:
        api = MistralJobs(mock, ["SUCCESS"])
        await die_after_create(api, p, items)
        part, rows = await restart_until_done(mistral(tmp_path))
    assert part.state == "submitting" and len(api.creates) == 1 and api.list_route.call_count == 1
    assert [r[2]["choices"][0]["message"]["content"] for r in rows] == ["re: a", "re: b", "re: c"]


async def test_mistral_cancel_reaches_the_job(tmp_path):
    p = mistral(tmp_path)
    with respx.mock(base_url=MI, assert_all_called=False) as mock:
        api = MistralJobs(mock, ["SUCCESS"], polls=10**9)
        async with started(p), anyio.create_task_group() as tg:
            results: list[Any] = []

            async def run() -> None:
                results.extend(await p.jobs.run_items(chats(p, ["a", "b"])))

            tg.start_soon(run)
            while not api.creates:
                await anyio.sleep(0)
            st = p.jobs.store()
            job_id = (await st.run(st.open_parts, "p"))[0].job_id
            await st.run(st.set_job_state, job_id, "cancelling")
            await p.jobs.cancel(job_id)
    assert api.cancel_route.call_count == 1
    assert all(not o.ok and o.error.code == Code.CANCELLED for o in results)


# -- Groq and Together through kind: openai ------------------------------------------------

GQ = "http://groq.test/openai/v1"
TG = "http://together.test/v1"


def openai_vendor(tmp_path: Any, base: str, batch_api: dict[str, Any]) -> Any:
    return make_provider(OpenAIProvider, {"base_url": base, "api_key": "k", "batch_poll_interval_s": 5,
                                          "batch_api": batch_api}, tmp_path, clock=InstantClock())


class TogetherBatches(BatchApi):
    """Together: the create reply wrapped in ``job``, upper-case statuses, no metadata kept."""

    def create(self, request: httpx.Request) -> httpx.Response:
        reply = json.loads(super().create(request).content)
        self.batches[reply["id"]]["spec"].setdefault("metadata", None)
        return httpx.Response(200, json={"job": {**reply, "status": "VALIDATING"}})

    def poll(self, request: httpx.Request, bid: str) -> httpx.Response:
        data = json.loads(super().poll(request, bid).content)
        data.pop("metadata", None)
        return httpx.Response(200, json={**data, "status": data["status"].upper()})


async def test_groq_window_line_limit_and_cursor_listing(tmp_path):
    p = openai_vendor(tmp_path, GQ, {"completion_window": "7d", "max_lines": 2})
    items = chats(p, ["a", "b", "c"])
    with respx.mock(base_url=GQ, assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"] * 3)
        await die_after_create(api, p, items)
        first = api.creates[0]["metadata"]
        pages = [httpx.Response(200, json={"data": [{"id": "other", "metadata": {}}],
                                           "paging": {"next_cursor": "c1"}}),
                 httpx.Response(200, json={"data": [{"id": "batch_1", "metadata": first},
                                                    {"id": "batch_2", "metadata": api.creates[1]["metadata"]
                                                     if len(api.creates) > 1 else {}}],
                                           "paging": {}})]
        listing = mock.get("/batches").mock(side_effect=pages + pages)
        await restart_until_done(openai_vendor(tmp_path, GQ, {"completion_window": "7d",
                                                               "max_lines": 2}))
    assert {c["completion_window"] for c in api.creates} == {"7d"}
    assert sorted(len(lines) for lines in api.lines.values()) == [1, 2]  # 50,000 -> max_lines
    assert listing.calls[1].request.url.params["cursor"] == "c1"  # followed Groq's cursor
    assert "batch_1" in {c.request.url.path.rsplit("/", 1)[-1] for c in api.poll_route.calls}


async def test_together_purpose_wrapped_reply_and_upper_case_statuses(tmp_path):
    p = openai_vendor(tmp_path, TG, {"file_purpose": "batch-api", "metadata": False})
    with respx.mock(base_url=TG, assert_all_called=False) as mock:
        api = TogetherBatches(mock, ["completed"], shape=shuffled_with_failure)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c"]))
    assert [o.ok for o in out] == [True, False, True]
    assert b'name="purpose"\r\n\r\nbatch-api' in api.uploads[0]
    assert "metadata" not in body(api.create_route.calls[0].request)


async def test_together_crash_after_create_is_found_by_the_file_name(tmp_path):
    p = openai_vendor(tmp_path, TG, {"file_purpose": "batch-api", "metadata": False})
    items = chats(p, ["a", "b"])
    with respx.mock(base_url=TG, assert_all_called=False) as mock:
        api = TogetherBatches(mock, ["completed"])
        await die_after_create(api, p, items)
        name = api.upload_route.calls[0].request.content.split(b'filename="')[1].split(b'"')[0].decode()
        files = mock.get("/files").mock(return_value=httpx.Response(200, json={"data": [
            {"id": "file-x", "filename": "other.jsonl"}, {"id": "file-in-1", "filename": name}]}))
        mock.get("/batches").mock(return_value=httpx.Response(200, json=[
            {"id": "batch_1", "input_file_id": "file-in-1", "status": "IN_PROGRESS"}]))
        _, rows = await restart_until_done(openai_vendor(tmp_path, TG, {"file_purpose": "batch-api",
                                                                         "metadata": False}))
    assert files.call_count == 1 and len(api.creates) == 1
    assert [r[2]["choices"][0]["message"]["content"] for r in rows] == ["re: a", "re: b"]


# -- quotas: enqueued tokens and active batches ------------------------------------------------

def test_plan_keeps_each_part_under_the_token_quota():
    planned = [Planned(i, "m", 10, 40) for i in range(5)]
    assert plan_parts(planned, 100, 10**6, max_tokens=100) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("quota", [{"max_enqueued_tokens": 25}, {"max_active_batches": 1}])
async def test_a_part_waits_for_the_quota_then_goes(tmp_path, quota):
    """Two parts (max_lines 2); the quota admits one batch at a time: the second is created only
    after the first ended, and every call is answered."""
    p = openai_vendor(tmp_path, "http://oai.test/v1", {"max_lines": 2, **quota})
    with respx.mock(base_url="http://oai.test/v1", assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"] * 4)
        open_at_create: list[int] = []
        plain_create = api.create

        def create(request: httpx.Request) -> httpx.Response:
            open_at_create.append(sum(1 for b in api.batches.values() if b["polls"] < api.polls))
            return plain_create(request)

        api.create_route.mock(side_effect=create)
        async with started(p):
            texts = ["one two three four five six seven eight nine ten"] * 4
            out = await p.execute("chat", chats(p, texts))
    assert [o.ok for o in out] == [True] * 4
    assert len(open_at_create) >= 2 and set(open_at_create) == {0}  # each waited for the last
    assert p.ctx.metrics.events.labels("p", "batch_waits_for_quota")._value.get() >= 1


def test_azure_settings_refuse_what_azure_refuses():
    from multiplexer.gateway.config import ConfigError, parse_config

    for provider, message in (
            ({"endpoint": "https://r.openai.azure.com", "batch_api": {"completion_window": "48h"}},
             "completion_window 24h only"),
            ({"endpoint": "r.openai.azure.com"}, "is not an http"),
            ({}, "endpoint: Field required")):
        with pytest.raises(ConfigError, match=message):
            parse_config({"providers": {"az": {"kind": "azure_openai", **provider}}, "routes": {}})


async def test_a_vendor_that_keeps_no_metadata_is_never_guessed_at(tmp_path):
    """batch_api.metadata left on for a vendor whose listing shows none: after a crash mid-submit
    the part ends as unknown (its calls fail clearly) rather than being submitted a second time."""
    p = openai_vendor(tmp_path, TG, {})
    items = chats(p, ["a"])
    with respx.mock(base_url=TG, assert_all_called=False) as mock:
        api = TogetherBatches(mock, ["completed"])
        await die_after_create(api, p, items)
        mock.get("/batches").mock(return_value=httpx.Response(200, json=[
            {"id": "batch_1", "input_file_id": "file-in-1", "status": "IN_PROGRESS"}]))
        _, rows = await restart_until_done(openai_vendor(tmp_path, TG, {}))
    assert len(api.creates) == 1
    assert rows[0][1] == "failed" and "not resubmitted" in rows[0][3]["data"]["detail"]
