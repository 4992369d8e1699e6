"""OpenAI Batch API through the job manager, against respx: request shapes and every ending."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from multiplexer.core.errors import Code
from providers.batch.openai_batch import parse_line
from providers.openai import OpenAIProvider
from tests.remote_helpers import (
    InstantClock,
    chat_reply,
    die_after_create,
    item,
    make_provider,
    restart_until_done,
    started,
)

pytestmark = pytest.mark.anyio
BASE = "http://oai.test/v1"



def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def ok_line(cid: str, text: str) -> dict[str, Any]:
    return {"id": "l", "custom_id": cid, "response": {"status_code": 200, "body": chat_reply(text)},
            "error": None}


class BatchApi:
    """A scripted Batch API: each created batch ends as ``endings`` says, in turn."""

    def __init__(self, mock: respx.MockRouter, endings: list[str], *, polls: int = 2,
                 shape: Any = None) -> None:
        self.endings = list(endings)
        self.polls = polls
        self.shape = shape or self.default_shape
        self.uploads: list[bytes] = []
        self.creates: list[dict[str, Any]] = []
        self.lines: dict[str, list[dict[str, Any]]] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.files: dict[str, bytes] = {}
        self.upload_route = mock.post("/files").mock(side_effect=self.upload)
        self.create_route = mock.post("/batches").mock(side_effect=self.create)
        self.poll_route = mock.get(path__regex=r"/batches/(?P<bid>[^/]+)$").mock(side_effect=self.poll)
        self.cancel_route = mock.post(path__regex=r"/batches/(?P<bid>[^/]+)/cancel$").mock(
            side_effect=self.cancel)
        mock.get(path__regex=r"/files/(?P<fid>[^/]+)/content$").mock(side_effect=self.content)

    def upload(self, request: httpx.Request) -> httpx.Response:
        self.uploads.append(request.content)
        fid = f"file-in-{len(self.uploads)}"
        chunks = request.content.replace(b"\r\n", b"\n").split(b"\n")
        lines = [json.loads(x) for x in chunks if x.startswith(b'{"custom_id"')]
        self.lines[fid] = lines
        return httpx.Response(200, json={"id": fid, "object": "file", "purpose": "batch"})

    def create(self, request: httpx.Request) -> httpx.Response:
        spec = json.loads(request.content)
        self.creates.append(spec)
        bid = f"batch_{len(self.creates)}"
        self.batches[bid] = {"id": bid, "status": "validating", "polls": 0, "spec": spec,
                             "ending": self.endings.pop(0)}
        return httpx.Response(200, json={"id": bid, "status": "validating"})

    def poll(self, request: httpx.Request, bid: str) -> httpx.Response:
        batch = self.batches[bid]
        batch["polls"] += 1
        body: dict[str, Any] = {"id": bid, "status": "in_progress", "metadata": batch["spec"]["metadata"]}
        if batch["status"] == "cancelling" or batch["polls"] >= self.polls:
            ending = "cancelled" if batch["status"] == "cancelling" else batch["ending"]
            lines = self.lines[batch["spec"]["input_file_id"]]
            out, err, extra = self.shape(ending, lines)
            body.update(extra)
            body["status"] = ending
            if out:
                self.files[f"{bid}-out"] = jsonl(out)
                body["output_file_id"] = f"{bid}-out"
            if err:
                self.files[f"{bid}-err"] = jsonl(err)
                body["error_file_id"] = f"{bid}-err"
        return httpx.Response(200, json=body)

    def cancel(self, request: httpx.Request, bid: str) -> httpx.Response:
        self.batches[bid]["status"] = "cancelling"
        return httpx.Response(200, json={"id": bid, "status": "cancelling"})

    def content(self, request: httpx.Request, fid: str) -> httpx.Response:
        return httpx.Response(200, content=self.files[fid])

    @staticmethod
    def default_shape(ending: str, lines: list[dict[str, Any]]):
        """completed: all answered, in reverse order; expired/cancelled: the first half only."""
        answered = lines if ending == "completed" else lines[: len(lines) // 2]
        out = [ok_line(x["custom_id"], "re: " + x["body"]["messages"][0]["content"])
               for x in reversed(answered)]
        extra = {"errors": {"data": [{"message": "line 1 invalid"}]}} if ending == "failed" else {}
        return ([] if ending == "failed" else out), [], extra


def provider(tmp_path, **settings):
    return make_provider(OpenAIProvider, {"base_url": BASE, "api_key": "k", "batch_poll_interval_s": 5,
                                          **settings}, tmp_path, clock=InstantClock())


def chats(p, texts, model="gpt"):
    return [item(p, "chat", {"model": model, "messages": [{"role": "user", "content": t}]},
                 mode="batch") for t in texts]


def texts_of(outcomes):
    return [o.result["choices"][0]["message"]["content"] if o.ok else o.error for o in outcomes]


async def test_a_job_uploads_jsonl_creates_a_batch_and_matches_output_by_custom_id(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c"]))
    assert texts_of(out) == ["re: a", "re: b", "re: c"]
    upload = api.uploads[0]
    assert b'name="purpose"\r\n\r\nbatch' in upload and b'.jsonl"' in upload
    lines = api.lines["file-in-1"]
    assert [x["method"] for x in lines] == ["POST"] * 3
    assert {x["url"] for x in lines} == {"/v1/chat/completions"}
    assert len({x["custom_id"] for x in lines}) == 3
    assert lines[0]["body"] == {"model": "gpt", "messages": [{"role": "user", "content": "a"}]}
    spec = api.creates[0]
    assert spec["input_file_id"] == "file-in-1" and spec["endpoint"] == "/v1/chat/completions"
    assert spec["completion_window"] == "24h" and "multiplexer_part" in spec["metadata"]
    assert api.poll_route.call_count == 2


async def test_error_file_lines_reach_only_their_items(tmp_path):
    def shape(ending, lines):
        ids = [x["custom_id"] for x in lines]
        out = [ok_line(ids[0], "fine"), ok_line(ids[3], "fine too")]
        err = [
            {"id": "e1", "custom_id": ids[1], "error": None, "response": {
                "status_code": 400, "body": {"error": {"message": "bad request", "code": "invalid"}}}},
            {"id": "e2", "custom_id": ids[2], "response": None,
             "error": {"code": "server_error", "message": "exploded"}},
        ]
        return out, err, {}

    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        BatchApi(mock, ["completed"], shape=shape)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c", "d"]))
    assert [o.ok for o in out] == [True, False, False, True]
    assert out[1].error.data["upstream_status"] == 400 and out[1].error.data["detail"] == "bad request"
    assert out[1].error.data["upstream_code"] == "invalid"
    assert out[2].error.data["detail"] == "exploded"


async def test_expired_batch_delivers_what_finished_and_resubmits_the_rest_once(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["expired", "completed"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c", "d"]))
    assert texts_of(out) == ["re: a", "re: b", "re: c", "re: d"]
    assert len(api.creates) == 2
    assert [x["body"]["messages"][0]["content"] for x in api.lines["file-in-2"]] == ["c", "d"]


async def test_expired_twice_fails_the_unfinished_items_clearly(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["expired", "expired"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b", "c", "d"]))
    assert [o.ok for o in out] == [True, True, True, False]
    err = out[3].error
    assert err.code == Code.UPSTREAM_ERROR and err.data["expired"] is True
    assert "expired" in err.data["detail"] and "resubmission" in err.data["detail"]
    assert len(api.creates) == 2


async def test_no_resubmission_when_disabled(tmp_path):
    p = provider(tmp_path, batch_resubmit_expired=False)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["expired"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"]))
    assert [o.ok for o in out] == [True, False] and len(api.creates) == 1


async def test_failed_batch_fails_every_item_with_the_reason(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        BatchApi(mock, ["failed"])
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"]))
    for o in out:
        assert o.error.data["detail"] == "line 1 invalid" and o.error.data["batch_status"] == "failed"


async def test_models_and_size_limits_split_parts(tmp_path):
    p = provider(tmp_path, batch_max_requests=2)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"] * 4)
        async with started(p):
            items = chats(p, ["a", "b", "c"]) + chats(p, ["x"], model="other")
            out = await p.execute("chat", items)
    assert texts_of(out) == ["re: a", "re: b", "re: c", "re: x"]
    models = sorted(tuple(sorted({x["body"]["model"] for x in lines})) for lines in api.lines.values())
    assert models == [("gpt",), ("gpt",), ("other",)]
    assert sorted(len(lines) for lines in api.lines.values()) == [1, 1, 2]


async def test_a_rejected_submission_fails_the_items_without_retrying(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, [])
        api.create_route.mock(return_value=httpx.Response(
            400, json={"error": {"message": "model not available for batch"}}))
        async with started(p):
            out = await p.execute("chat", chats(p, ["a"]))
    assert out[0].error.data["upstream_status"] == 400
    assert api.create_route.call_count == 1


async def test_an_unclear_submission_is_looked_up_not_repeated(tmp_path):
    """POST /batches fails with a 500 after the batch was made: the manager finds it by metadata."""
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"])
        made = api.create

        def create_then_fail(request):
            made(request)
            return httpx.Response(500, json={"error": {"message": "internal"}})

        api.create_route.mock(side_effect=create_then_fail)
        listing = mock.get("/batches").mock(side_effect=lambda r: httpx.Response(200, json={
            "data": [{"id": bid, "metadata": b["spec"]["metadata"], "created_at": 2_000_000_000}
                     for bid, b in api.batches.items()], "has_more": False}))
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"]))
    assert texts_of(out) == ["re: a", "re: b"]
    assert api.create_route.call_count == 1 and listing.call_count == 1


async def test_restart_in_the_submission_window_adopts_the_listed_batch(tmp_path):
    """Killed after POST /batches but before the id was stored: the restart must not submit again."""
    first = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"])
        await die_after_create(api, first, chats(first, ["a", "b"]))
        mock.get("/batches").mock(side_effect=lambda r: httpx.Response(200, json={
            "data": [{"id": "batch_1", "metadata": api.creates[0]["metadata"],
                      "created_at": 2_000_000_000}], "has_more": False}))
        part, rows = await restart_until_done(provider(tmp_path))
    assert part.state == "submitting" and part.remote_id is None
    assert len(api.creates) == 1 and len(api.uploads) == 1  # nothing submitted twice
    assert [r[2]["choices"][0]["message"]["content"] for r in rows] == ["re: a", "re: b"]


async def test_polling_survives_upstream_errors(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = BatchApi(mock, ["completed"])
        real = api.poll
        failures = iter([httpx.Response(503)] * 4 + [httpx.Response(200, text="not json")])

        def flaky(request, bid):
            return next(failures, None) or real(request, bid)

        api.poll_route.mock(side_effect=flaky)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a"]))
    assert texts_of(out) == ["re: a"]


async def test_a_result_missing_from_a_completed_batch_fails_that_item(tmp_path):
    def shape(ending, lines):
        return [ok_line(lines[0]["custom_id"], "only")], [], {}

    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        BatchApi(mock, ["completed"], shape=shape)
        async with started(p):
            out = await p.execute("chat", chats(p, ["a", "b"]))
    assert out[0].ok
    assert "without a result" in out[1].error.data["detail"]


def test_output_line_shapes():
    assert parse_line("p", "{not json") is None
    assert parse_line("p", json.dumps({"no": "custom id"})) is None
    expired = parse_line("p", json.dumps({"custom_id": "c", "error": {"code": "batch_expired"}}))
    assert expired.kind == "unfinished"
    stopped = parse_line("p", json.dumps({"custom_id": "c", "error": {"code": "batch_cancelled"}}))
    assert stopped.kind == "cancelled"
    odd = parse_line("p", json.dumps({"custom_id": "c", "response": None, "error": None}))
    assert odd.kind == "errored" and "malformed" in odd.error.data["detail"]
