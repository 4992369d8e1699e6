"""Anthropic Message Batches through the job manager, against respx."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
import respx

from multiplexer.core.errors import Code
from providers.anthropic import AnthropicProvider
from providers.batch.anthropic_batch import parse_line
from tests.remote_helpers import (
    InstantClock,
    die_after_create,
    item,
    make_provider,
    restart_until_done,
    started,
)

pytestmark = pytest.mark.anyio
BASE = "http://claude.test"
PATH = "/v1/messages/batches"



def message(text: str) -> dict[str, Any]:
    return {"id": "msg", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": text}], "usage": {"input_tokens": 1, "output_tokens": 1}}


class MessageBatches:
    """Each batch ends after ``polls`` polls; ``outcome(i, request)`` picks each result's type."""

    def __init__(self, mock: respx.MockRouter, outcome=None, polls: int = 2) -> None:
        self.outcome = outcome or (lambda i, req, n: "succeeded")
        self.polls = polls
        self.batches: dict[str, dict[str, Any]] = {}
        self.create_route = mock.post(PATH).mock(side_effect=self.create)
        mock.get(path__regex=rf"{PATH}/(?P<bid>[^/]+)$").mock(side_effect=self.poll)
        mock.get(path__regex=rf"{PATH}/(?P<bid>[^/]+)/results$").mock(side_effect=self.results)
        self.cancel_route = mock.post(path__regex=rf"{PATH}/(?P<bid>[^/]+)/cancel$").mock(
            side_effect=self.cancel)

    def create(self, request: httpx.Request) -> httpx.Response:
        bid = f"msgbatch_{len(self.batches) + 1}"
        self.batches[bid] = {"requests": json.loads(request.content)["requests"], "polls": 0,
                             "cancel": False, "n": len(self.batches)}
        return httpx.Response(200, json=self.view(bid))

    def view(self, bid: str) -> dict[str, Any]:
        b = self.batches[bid]
        ended = b["polls"] >= self.polls or (b["cancel"] and b["polls"] > 0)
        counts = {"processing": 0 if ended else len(b["requests"]), "succeeded": 0, "errored": 0,
                  "canceled": 0, "expired": 0}
        if ended:
            for i, r in enumerate(b["requests"]):
                counts[self.kind(b, i, r)] += 1
        return {"id": bid, "type": "message_batch",
                "processing_status": "ended" if ended else "in_progress", "request_counts": counts,
                "cancel_initiated_at": "2024-01-01T00:00:00Z" if b["cancel"] else None,
                "created_at": "2100-01-01T00:00:00Z",
                "results_url": f"{BASE}{PATH}/{bid}/results" if ended else None}

    def kind(self, b: dict[str, Any], i: int, r: dict[str, Any]) -> str:
        return "canceled" if b["cancel"] and i > 0 else self.outcome(i, r, b["n"])

    def poll(self, request: httpx.Request, bid: str) -> httpx.Response:
        self.batches[bid]["polls"] += 1
        return httpx.Response(200, json=self.view(bid))

    def results(self, request: httpx.Request, bid: str) -> httpx.Response:
        b = self.batches[bid]
        rows = []
        for i, r in reversed(list(enumerate(b["requests"]))):
            kind = self.kind(b, i, r)
            result: dict[str, Any] = {"type": kind}
            if kind == "succeeded":
                result["message"] = message("re: " + r["params"]["messages"][0]["content"])
            elif kind == "errored":
                result["error"] = {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": "bad prompt"}}
            rows.append({"custom_id": r["custom_id"], "result": result})
        return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in rows).encode())

    def cancel(self, request: httpx.Request, bid: str) -> httpx.Response:
        self.batches[bid]["cancel"] = True
        return httpx.Response(200, json=self.view(bid))


def provider(tmp_path, **settings):
    return make_provider(AnthropicProvider, {"base_url": BASE, "api_key": "k", "batch_poll_interval_s": 3,
                                             **settings}, tmp_path, clock=InstantClock())


def msgs(p, texts):
    return [item(p, "messages", {"model": "claude", "max_tokens": 8,
                                 "messages": [{"role": "user", "content": t}]}, mode="batch")
            for t in texts]


def texts_of(outcomes):
    return [o.result["content"][0]["text"] if o.ok else o.error for o in outcomes]


async def test_inline_requests_and_results_matched_by_custom_id(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = MessageBatches(mock)
        async with started(p):
            out = await p.execute("messages", msgs(p, ["a", "b", "c"]))
    assert texts_of(out) == ["re: a", "re: b", "re: c"]
    request = api.create_route.calls[0].request
    assert request.headers["x-api-key"] == "k" and request.headers["anthropic-version"]
    sent = json.loads(request.content)["requests"]
    assert sent[0]["params"] == {"model": "claude", "max_tokens": 8,
                                 "messages": [{"role": "user", "content": "a"}]}
    assert len({r["custom_id"] for r in sent}) == 3
    assert all(len(r["custom_id"]) <= 64 for r in sent)


async def test_result_types_errored_and_expired(tmp_path):
    def outcome(i, request, n):
        text = request["params"]["messages"][0]["content"]
        if text == "bad":
            return "errored"
        return "expired" if text == "late" and n == 0 else "succeeded"

    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = MessageBatches(mock, outcome)
        async with started(p):
            out = await p.execute("messages", msgs(p, ["ok", "bad", "late"]))
    assert out[0].ok and texts_of(out)[2] == "re: late"  # expired, resubmitted once, then done
    assert out[1].error.code == Code.UPSTREAM_ERROR and out[1].error.data["detail"] == "bad prompt"
    assert out[1].error.data["upstream_code"] == "invalid_request_error"
    assert len(api.batches) == 2
    assert [r["params"]["messages"][0]["content"] for r in api.batches["msgbatch_2"]["requests"]] == ["late"]


async def test_expired_again_fails_clearly(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        MessageBatches(mock, lambda i, r, n: "expired" if i == 0 else "succeeded")
        async with started(p):
            out = await p.execute("messages", msgs(p, ["a", "b"]))
    assert out[0].error.data["expired"] is True and out[1].ok


async def test_cancelled_job_keeps_finished_results(tmp_path):
    p = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = MessageBatches(mock, polls=10**9)  # ends only by the cancel
        created = anyio.Event()
        api.create_route.mock(side_effect=lambda r: (api.create(r), created.set())[0])
        results: list[Any] = []

        async def run():
            results.extend(await p.execute("messages", msgs(p, ["a", "b", "c"])))

        async with started(p), anyio.create_task_group() as tg:
            tg.start_soon(run)
            store = p.jobs.store()
            await created.wait()
            job = (await store.run(store.list_jobs, None, 1))[0]
            await store.run(store.set_job_state, job.id, "cancelling", ("running",))
            await p.jobs.cancel(job.id)
    assert api.cancel_route.call_count == 1
    assert results[0].ok
    assert [o.error.code for o in results[1:]] == [Code.CANCELLED, Code.CANCELLED]


async def test_restart_in_the_submission_window_finds_the_batch_by_listing(tmp_path):
    first = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = MessageBatches(mock)
        await die_after_create(api, first, msgs(first, ["a", "b"]))
        other = {"id": "msgbatch_other", "created_at": "2100-01-01T00:00:00Z",
                 "request_counts": {"processing": 5}}  # a different size: not ours
        old = {"id": "msgbatch_old", "created_at": "2001-01-01T00:00:00Z",
               "request_counts": {"succeeded": 2}}  # before the intent: not ours
        mock.get(PATH).mock(side_effect=lambda r: httpx.Response(200, json={
            "data": [other, api.view("msgbatch_1"), old], "has_more": False}))
        _, rows = await restart_until_done(provider(tmp_path))
    assert len(api.batches) == 1
    assert [r[2]["content"][0]["text"] for r in rows] == ["re: a", "re: b"]


async def test_an_ambiguous_listing_is_reported_not_resubmitted(tmp_path):
    first = provider(tmp_path)
    with respx.mock(base_url=BASE, assert_all_called=False) as mock:
        api = MessageBatches(mock)
        await die_after_create(api, first, msgs(first, ["a"]))
        twin = {**api.view("msgbatch_1"), "id": "msgbatch_twin"}
        mock.get(PATH).mock(return_value=httpx.Response(200, json={
            "data": [api.view("msgbatch_1"), twin], "has_more": False}))
        _, rows = await restart_until_done(provider(tmp_path))
    assert len(api.batches) == 1
    assert rows[0][1] == "failed" and "unknown" in rows[0][3]["data"]["detail"]


def test_result_line_shapes():
    assert parse_line("p", "nope") is None
    assert parse_line("p", json.dumps({"custom_id": "c", "result": {"type": "canceled"}})).kind == "cancelled"
    assert parse_line("p", json.dumps({"custom_id": "c", "result": {"type": "expired"}})).kind == "unfinished"
    odd = parse_line("p", json.dumps({"custom_id": "c", "result": {"type": "succeeded"}}))
    assert odd.kind == "errored"
