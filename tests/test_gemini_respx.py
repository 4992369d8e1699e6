"""``kind: gemini`` against respx: request shapes of generateContent, streams, packed embeddings,
and the Batch API through the job manager (inline and file, both state spellings, per-item
errors, a crash after the create, the enqueued-token and job-count limits)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
import respx

from multiplexer.core.errors import Code
from providers.batch.gemini_batch import parse_display, state_word
from providers.gemini import GeminiProvider
from tests.remote_helpers import InstantClock, body, die_after_create, item, make_provider, started

pytestmark = pytest.mark.anyio
BASE = "http://gem.test"
MODEL = "gemini-x"


def provider(tmp_path, **settings):
    return make_provider(
        GeminiProvider,
        {"base_url": BASE, "api_key": "k", "batch_poll_interval_s": 5, **settings},
        tmp_path,
        clock=InstantClock(),
    )


def native(text: str) -> dict[str, Any]:
    return {"model": MODEL, "contents": [{"role": "user", "parts": [{"text": text}]}]}


def answer(text: str) -> dict[str, Any]:
    return {
        "candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 2, "candidatesTokenCount": 3, "totalTokenCount": 5},
    }


def text_of(outcome) -> Any:
    if not outcome.ok:
        return outcome.error
    return outcome.result["candidates"][0]["content"]["parts"][0]["text"]


async def test_generate_content_goes_to_the_models_url_with_the_key_header(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE) as mock:
        route = mock.post(f"/v1beta/models/{MODEL}:generateContent").mock(
            return_value=httpx.Response(200, json=answer("hi"))
        )
        async with started(p):
            out = await p.execute("chat", [item(p, "chat", native("hello"))])
    assert text_of(out[0]) == "hi"
    sent = route.calls[0].request
    assert sent.headers["x-goog-api-key"] == "k"
    assert body(sent) == {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}


async def test_an_upstream_error_keeps_its_status_and_message(tmp_path):
    p = provider(tmp_path)
    error = {"error": {"code": 400, "message": "API key not valid", "status": "INVALID_ARGUMENT"}}
    with respx.mock(base_url=BASE) as mock:
        mock.post(f"/v1beta/models/{MODEL}:generateContent").mock(
            return_value=httpx.Response(400, json=error)
        )
        async with started(p):
            out = await p.execute("chat", [item(p, "chat", native("x"))])
    assert out[0].error.data["upstream_status"] == 400 and out[0].error.data["detail"] == "API key not valid"


@pytest.mark.parametrize(
    "params, param",
    [
        ({"model": MODEL}, "contents"),
        ({"contents": [{"parts": [{"text": "x"}]}]}, "model"),
    ],
)
def test_bad_native_bodies_are_refused_at_admission(tmp_path, params, param):
    p = provider(tmp_path)
    with pytest.raises(Exception) as e:
        item(p, "chat", params)
    assert e.value.data["param"] == param


async def test_embeddings_are_packed_and_a_refused_request_is_split_per_caller(tmp_path):
    p = provider(tmp_path, max_inputs=3)
    seen: list[list[str]] = []

    def embed(request: httpx.Request) -> httpx.Response:
        requests = body(request)["requests"]
        texts = [r["content"]["parts"][0]["text"] for r in requests]
        seen.append(texts)
        assert {r["model"] for r in requests} == {"models/e"}
        if any("FAIL" in t for t in texts):
            return httpx.Response(400, json={"error": {"code": 400, "message": "bad input", "status": "X"}})
        return httpx.Response(200, json={"embeddings": [{"values": [float(len(t))]} for t in texts]})

    calls = [
        {"model": "e", "content": {"parts": [{"text": "a"}]}},
        {"model": "e", "requests": [{"content": {"parts": [{"text": t}]}} for t in ("bb", "ccc")]},
        {"model": "e", "content": {"parts": [{"text": "FAIL"}]}},
        {"model": "e", "content": {"parts": [{"text": "dddd"}]}},
    ]
    with respx.mock(base_url=BASE) as mock:
        mock.post("/v1beta/models/e:batchEmbedContents").mock(side_effect=embed)
        async with started(p):
            out = await p.execute("embeddings", [item(p, "embeddings", c) for c in calls])
    assert out[0].result == {"embedding": {"values": [1.0]}}
    assert out[1].result == {"embeddings": [{"values": [2.0]}, {"values": [3.0]}]}
    assert out[2].error.data["detail"] == "bad input"
    assert out[3].result == {"embedding": {"values": [4.0]}}
    assert seen[:2] == [["a", "bb", "ccc"], ["FAIL", "dddd"]]  # packed by max_inputs
    assert sorted(seen[2:]) == [["FAIL"], ["dddd"]]  # the refused request again, per caller


async def test_a_stream_that_stops_before_its_finish_reason_is_an_error(tmp_path):
    from multiplexer.core.provider import STREAM
    from multiplexer.core.sink import ChunkSink

    p = provider(tmp_path)
    events = b'data: {"candidates": [{"content": {"parts": [{"text": "He"}]}}]}\n\n'
    send, recv = anyio.create_memory_object_stream(100)
    it = item(p, "chat", native("x"))
    with respx.mock(base_url=BASE) as mock:
        route = mock.post(f"/v1beta/models/{MODEL}:streamGenerateContent").mock(
            return_value=httpx.Response(200, content=events, headers={"content-type": "text/event-stream"})
        )
        async with started(p):
            it.options[STREAM] = ChunkSink(send)
            out = await p.stream(it, it.options[STREAM])
    assert route.calls[0].request.url.params["alt"] == "sse"
    assert out.error.code == Code.UPSTREAM_UNAVAILABLE and "before its last event" in out.error.data["detail"]
    assert recv.receive_nowait()["candidates"][0]["content"]["parts"][0]["text"] == "He"


def test_only_calls_at_temperature_zero_with_one_candidate_may_share_an_execution(tmp_path):
    p = provider(tmp_path)

    def shared(config: dict[str, Any] | None) -> bool:
        params = native("x") if config is None else {**native("x"), "generationConfig": config}
        return p.dedup_safe(item(p, "chat", params))

    assert shared({"temperature": 0}) and shared({"temperature": 0.0, "candidateCount": 1})
    assert not shared(None) and not shared({"temperature": 0.3})
    assert not shared({"temperature": 0, "candidateCount": 2})
    assert p.dedup_safe(item(p, "embeddings", {"model": "e", "content": {"parts": [{"text": "a"}]}}))


# -- the Batch API ------------------------------------------------------------------------------
class BatchApi:
    """A scripted Gemini Batch API: each created batch ends as ``endings`` says (a state word),
    after ``polls`` polls; answers echo ``re: <text>``, texts holding FAIL error."""

    def __init__(
        self,
        mock: respx.MockRouter,
        endings: list[str],
        *,
        polls: int = 2,
        prefix: str = "BATCH_STATE_",
        keys_inline: bool = False,
        until_creates: int = 0,
    ) -> None:
        self.endings, self.polls, self.prefix, self.keys_inline = list(endings), polls, prefix, keys_inline
        self.until_creates = until_creates  # no batch ends before this many were created
        self.creates: list[dict[str, Any]] = []
        self.starts: list[httpx.Request] = []
        self.files: dict[str, bytes] = {}
        self.ops: dict[str, dict[str, Any]] = {}
        self.create_route = mock.post(path__regex=r"/v1beta/models/[^/]+:batchGenerateContent$").mock(
            side_effect=self.create
        )
        mock.post("/upload/v1beta/files").mock(side_effect=self.upload)
        mock.get(path__regex=r"/v1beta/batches/[^/:]+$").mock(side_effect=self.poll)
        mock.post(path__regex=r"/v1beta/batches/[^/:]+:cancel$").mock(side_effect=self.cancel)
        mock.get(path__regex=r"/download/v1beta/files/[^/:]+:download$").mock(side_effect=self.download)
        self.list_route = mock.get("/v1beta/batches").mock(side_effect=self.list)

    def upload(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-goog-upload-command") == "start":
            self.starts.append(request)
            return httpx.Response(
                200, headers={"x-goog-upload-url": f"{BASE}/upload/v1beta/files?upload_id=u1"}
            )
        assert request.headers["x-goog-upload-command"] == "upload, finalize"
        assert request.headers["x-goog-upload-offset"] == "0"
        name = f"files/in{len(self.files)}"
        self.files[name] = request.content
        return httpx.Response(200, json={"file": {"name": name}})

    def create(self, request: httpx.Request) -> httpx.Response:
        spec = body(request)["batch"]
        self.creates.append(spec)
        name = f"batches/b{len(self.creates)}"
        source = spec["inputConfig"]
        if "requests" in source:
            lines = [(None, r["request"]) for r in source["requests"]["requests"]]
        else:
            lines = [
                (row["key"], row["request"])
                for row in map(json.loads, self.files[source["fileName"]].splitlines())
            ]
        self.ops[name] = {
            "spec": spec,
            "lines": lines,
            "polls": 0,
            "ending": self.endings.pop(0),
            "state": None,
        }
        return httpx.Response(
            200,
            json={
                "name": name,
                "metadata": {"displayName": spec["displayName"], "state": self.prefix + "PENDING"},
            },
        )

    def op(self, name: str) -> dict[str, Any]:
        o = self.ops[name]
        meta = {
            "displayName": o["spec"]["displayName"],
            "model": f"models/{MODEL}",
            "state": self.prefix + (o["state"] or "RUNNING"),
        }
        out: dict[str, Any] = {"name": name, "metadata": meta}
        if o["state"] is None:
            return out
        out["done"] = True
        if o["state"] == "FAILED":
            out["error"] = {"code": 3, "message": "the input file is malformed"}
            return out
        if o["state"] in ("EXPIRED", "CANCELLED"):
            return out
        rows = []
        for i, (key, request) in enumerate(o["lines"]):
            text = request["contents"][0]["parts"][0]["text"]
            row: dict[str, Any] = (
                {"error": {"code": 400, "message": f"bad {text}"}}
                if "FAIL" in text
                else {"response": answer("re: " + text)}
            )
            if key is not None:
                row["key"] = key
            elif self.keys_inline:
                row["metadata"] = {
                    "key": o["spec"]["inputConfig"]["requests"]["requests"][i]["metadata"]["key"]
                }
            rows.append(row)
        if o["lines"][0][0] is None:
            out["response"] = {"inlinedResponses": {"inlinedResponses": rows}}
        else:
            self.files[f"files/out-{name[8:]}"] = b"".join(
                json.dumps(r).encode() + b"\n" for r in reversed(rows)
            )
            out["response"] = {"responsesFile": f"files/out-{name[8:]}"}
        return out

    def poll(self, request: httpx.Request) -> httpx.Response:
        name = request.url.path.removeprefix("/v1beta/")
        o = self.ops[name]
        o["polls"] += 1
        if o["state"] is None and (
            (o["polls"] >= self.polls and len(self.creates) >= self.until_creates) or o.get("cancel")
        ):
            o["state"] = "CANCELLED" if o.get("cancel") else o["ending"]
        return httpx.Response(200, json=self.op(name))

    def cancel(self, request: httpx.Request) -> httpx.Response:
        self.ops[request.url.path.removeprefix("/v1beta/").removesuffix(":cancel")]["cancel"] = True
        return httpx.Response(200, json={})

    def download(self, request: httpx.Request) -> httpx.Response:
        assert request.url.params["alt"] == "media"
        name = request.url.path.removeprefix("/download/v1beta/").removesuffix(":download")
        return httpx.Response(200, content=self.files[name])

    def list(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"operations": [self.op(n) for n in self.ops]})


def chats(p, texts):
    return [item(p, "chat", native(t), mode="batch") for t in texts]


def test_both_state_spellings_read_the_same():
    assert state_word("BATCH_STATE_SUCCEEDED") == state_word("JOB_STATE_SUCCEEDED") == "SUCCEEDED"
    assert state_word({"name": "JOB_STATE_RUNNING"}) == "RUNNING"
    assert parse_display("multiplexer:job_1.ab:42") == ("job_1.ab", 42) and parse_display("mine") is None


@pytest.mark.parametrize("prefix", ["BATCH_STATE_", "JOB_STATE_"])
@pytest.mark.parametrize("keys_inline", [False, True])
async def test_a_small_part_goes_inline_and_results_match_by_position(tmp_path, prefix, keys_inline):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["SUCCEEDED"], prefix=prefix, keys_inline=keys_inline)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "FAIL b", "c"]))
    assert [text_of(o) for o in out[::2]] == ["re: a", "re: c"]
    assert out[1].error.data["upstream_status"] == 400 and out[1].error.data["detail"] == "bad FAIL b"
    spec = api.creates[0]
    assert parse_display(spec["displayName"])[0].startswith("job_") and not api.starts
    first = spec["inputConfig"]["requests"]["requests"][0]
    assert first["request"] == {"contents": [{"role": "user", "parts": [{"text": "a"}]}]}  # model in the URL
    assert first["metadata"]["key"].endswith("-0")


async def test_a_large_part_goes_up_through_the_resumable_upload_and_matches_by_key(tmp_path):
    p = provider(tmp_path, batch_inline_max_bytes=0)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["SUCCEEDED"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "FAIL c"]))
    assert [text_of(o) for o in out[:2]] == ["re: a", "re: b"] and out[2].error.data["detail"] == "bad FAIL c"
    start = api.starts[0]
    assert start.headers["x-goog-upload-protocol"] == "resumable"
    assert int(start.headers["x-goog-upload-header-content-length"]) == len(api.files["files/in0"])
    assert api.creates[0]["inputConfig"] == {"fileName": "files/in0"}
    lines = [json.loads(x) for x in api.files["files/in0"].splitlines()]
    assert [set(x) for x in lines] == [{"key", "request"}] * 3 and "model" not in lines[0]["request"]


async def test_a_failed_batch_fails_its_items_with_the_reason(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        BatchApi(mock, ["FAILED"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"]))
    assert all(o.error.data["detail"] == "the input file is malformed" for o in out)


async def test_a_crash_after_the_create_finds_the_batch_by_its_display_name(tmp_path):
    first = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["SUCCEEDED"])
        await die_after_create(api, first, chats(first, ["a", "b"]))
        from tests.remote_helpers import restart_until_done

        part, rows = await restart_until_done(provider(tmp_path))
    assert part.state == "submitting" and part.remote_id is None
    assert len(api.creates) == 1 and api.list_route.called  # found by listing, not created twice
    assert [r[2]["candidates"][0]["content"]["parts"][0]["text"] for r in rows] == ["re: a", "re: b"]


@pytest.mark.parametrize("settings, expected", [
    ({"batch_enqueued_tokens": {MODEL: 40}}, ["create", "done", "create", "done"]),
    ({"batch_enqueued_tokens": {"*": 40}}, ["create", "done", "create", "done"]),
    ({"batch_max_jobs": 1}, ["create", "done", "create", "done"]),
    ({"batch_enqueued_tokens": {MODEL: 1000}}, ["create", "create", "done", "done"]),
])
async def test_parts_wait_for_the_models_enqueued_tokens_and_the_job_count(tmp_path, settings, expected):
    """Two parts of one model, each near the tier's enqueued-token limit (or one job at a time):
    the second is created only once the first has ended; under the limit both go at once."""
    p = provider(tmp_path, batch_max_requests=2, **settings)
    order: list[str] = []
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        # under the limit both parts go at once: the first may not end before the second is
        # created, however slowly this host schedules the second's create
        api = BatchApi(mock, ["SUCCEEDED", "SUCCEEDED"], until_creates=2 if expected[1] == "create" else 0)
        create, poll = api.create, api.poll

        def noted_create(request):
            order.append("create")
            return create(request)

        def noted_poll(request):
            response = poll(request)
            if response.json().get("done"):
                order.append("done")
            return response

        api.create_route.mock(side_effect=noted_create)
        mock.get(path__regex=r"/v1beta/batches/[^/:]+$").mock(side_effect=noted_poll)
        async with started(p):
            out = await p.execute("chat", chats(p, ["aaaa aaaa", "bbbb bbbb", "cccc cccc", "dddd dddd"]))
    assert [text_of(o) for o in out] == ["re: aaaa aaaa", "re: bbbb bbbb", "re: cccc cccc", "re: dddd dddd"]
    assert order == expected


async def test_cancel_reaches_the_remote_batch(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["CANCELLED"], polls=10**9)
        async with started(p), anyio.create_task_group() as tg:
            results: list[Any] = []

            async def run() -> None:
                results.extend(await p.execute("chat", chats(p, ["a", "b"])))

            tg.start_soon(run)
            while not api.creates:
                await anyio.sleep(0.01)
            st = p.jobs.store()
            job_id = (await st.run(st.open_parts, "p"))[0].job_id
            await st.run(st.set_job_state, job_id, "cancelling")
            await p.jobs.cancel(job_id)
    assert all(o.error.code == Code.CANCELLED for o in results)
    assert api.ops["batches/b1"]["state"] == "CANCELLED"


async def test_a_cancel_stops_a_part_waiting_for_enqueued_tokens_before_its_create(tmp_path):
    p = provider(tmp_path, batch_max_requests=1, batch_enqueued_tokens={"*": 10})
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["CANCELLED", "CANCELLED"], polls=10**9)
        async with started(p), anyio.create_task_group() as tg:
            results: list[Any] = []

            async def run() -> None:
                results.extend(await p.execute("chat", chats(p, ["a", "b"])))

            tg.start_soon(run)
            while not api.creates:
                await anyio.sleep(0.01)
            st = p.jobs.store()
            job_id = (await st.run(st.open_parts, "p"))[0].job_id
            await st.run(st.set_job_state, job_id, "cancelling")
            await p.jobs.cancel(job_id)
    assert [o.error.code for o in results] == [Code.CANCELLED, Code.CANCELLED]
    assert len(api.creates) == 1  # the waiting part was never created
