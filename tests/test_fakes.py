"""The provider fakes must behave like the real APIs, or end-to-end tests built on them prove nothing."""

from __future__ import annotations

import base64
import json
import math
import struct
from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.fakes.anthropic_fake import FakeAnthropicState
from tests.fakes.anthropic_fake import create_app as anthropic_app
from tests.fakes.common import Limiter, format_duration
from tests.fakes.openai_fake import FakeOpenAIState, embed_text
from tests.fakes.openai_fake import create_app as openai_app
from tests.fakes.serve import serve_app

pytestmark = pytest.mark.anyio

OPENAI_HEADERS = {"authorization": "Bearer sk-test"}
ANTHROPIC_HEADERS = {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"}



class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def openai(state: FakeOpenAIState, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(openai_app(state))
    return httpx.AsyncClient(transport=transport, base_url="http://fake", headers=headers or OPENAI_HEADERS)


def anthropic(state: FakeAnthropicState, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(anthropic_app(state))
    return httpx.AsyncClient(
        transport=transport, base_url="http://fake", headers=headers or ANTHROPIC_HEADERS
    )


def chat_line(custom_id: str, text: str, model: str = "gpt-test", url: str = "/v1/chat/completions") -> str:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


async def start_batch(client: httpx.AsyncClient, lines: list[str]) -> dict[str, Any]:
    files = {"file": ("requests.jsonl", ("\n".join(lines) + "\n").encode())}
    upload = await client.post("/v1/files", data={"purpose": "batch"}, files=files)
    assert upload.status_code == 200, upload.text
    spec = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    created = await client.post("/v1/batches", json=spec)
    assert created.status_code == 200, created.text
    return created.json()


async def jsonl_file(client: httpx.AsyncClient, file_id: str) -> list[dict[str, Any]]:
    response = await client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200
    return [json.loads(line) for line in response.text.splitlines()]


def message_request(custom_id: str, text: str) -> dict[str, Any]:
    params = {"model": "claude-test", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return {"custom_id": custom_id, "params": params}


# --- OpenAI: embeddings and chat ---------------------------------------------------------------


async def test_embeddings_are_deterministic_unit_vectors_in_input_order() -> None:
    state = FakeOpenAIState()
    async with openai(state) as client:
        many = await client.post("/v1/embeddings", json={"model": "emb", "input": ["a b c", "d", "a b c"]})
        one = await client.post("/v1/embeddings", json={"model": "emb", "input": "d"})
    body = many.json()
    assert body["object"] == "list" and body["model"] == "emb"
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    vectors = [item["embedding"] for item in body["data"]]
    assert vectors[0] == vectors[2] == embed_text("a b c") and vectors[1] == embed_text("d") != vectors[0]
    assert all(len(v) == 8 and math.isclose(sum(x * x for x in v), 1.0) for v in vectors)
    assert one.json()["data"][0]["embedding"] == vectors[1]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert state.embedding_batch_sizes == [3, 1]
    assert state.requests["/v1/embeddings"] == 2


async def test_embeddings_honour_dimensions_and_base64() -> None:
    async with openai(FakeOpenAIState()) as client:
        response = await client.post(
            "/v1/embeddings",
            json={"model": "emb", "input": ["x"], "dimensions": 4, "encoding_format": "base64"},
        )
    decoded = struct.unpack("<4f", base64.b64decode(response.json()["data"][0]["embedding"]))
    assert decoded == pytest.approx(embed_text("x", 4), rel=1e-6)


async def test_embeddings_reject_more_than_2048_inputs() -> None:
    state = FakeOpenAIState()
    async with openai(state) as client:
        response = await client.post("/v1/embeddings", json={"model": "emb", "input": ["w"] * 2049})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (
        error["type"] == "invalid_request_error" and error["param"] == "input" and "2048" in error["message"]
    )
    assert state.embedding_batch_sizes == []


async def test_chat_completion_echoes_last_user_message() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    async with openai(FakeOpenAIState()) as client:
        response = await client.post("/v1/chat/completions", json={"model": "gpt-test", "messages": messages})
    body = response.json()
    assert (
        body["object"] == "chat.completion"
        and body["model"] == "gpt-test"
        and body["id"].startswith("chatcmpl-")
    )
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "echo: hello world",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer "}, {"authorization": "Basic abc"}])
async def test_openai_requires_a_bearer_key(headers: dict[str, str]) -> None:
    state = FakeOpenAIState()
    async with openai(state, headers={"x-other": "1", **headers}) as client:
        response = await client.post("/v1/embeddings", json={"model": "emb", "input": "x"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert "x-ratelimit-remaining-requests" in response.headers
    assert state.requests["/v1/embeddings"] == 1 and state.embedding_batch_sizes == []


# --- OpenAI: faults and rate limits ------------------------------------------------------------


async def test_fail_next_answers_injected_statuses_in_order() -> None:
    state = FakeOpenAIState(fail_next=[500, 429, 503])
    async with openai(state) as client:
        responses = [await client.post("/v1/embeddings", json={"model": "e", "input": "x"}) for _ in range(4)]
    assert [r.status_code for r in responses] == [500, 429, 503, 200]
    assert responses[0].json()["error"]["type"] == "server_error"
    assert responses[1].json()["error"]["code"] == "rate_limit_exceeded"
    assert responses[1].headers["retry-after"] == "1" and "retry-after" not in responses[2].headers
    assert state.requests["/v1/embeddings"] == 4 and state.embedding_batch_sizes == [1]
    assert state.statuses == {500: 1, 429: 1, 503: 1, 200: 1}


async def test_injected_429_can_omit_retry_after() -> None:
    async with openai(FakeOpenAIState(fail_next=[429], retry_after_s=None)) as client:
        response = await client.post("/v1/embeddings", json={"model": "e", "input": "x"})
    assert response.status_code == 429 and "retry-after" not in response.headers


@pytest.mark.parametrize("send_retry_after", [True, False])
async def test_limiter_answers_429_until_the_window_resets(send_retry_after: bool) -> None:
    clock = FakeClock()
    limiter = Limiter(requests_per_window=2, window_s=90, enforce=True, send_retry_after=send_retry_after)
    state = FakeOpenAIState(clock=clock, limiter=limiter)
    async with openai(state) as client:

        async def call() -> httpx.Response:
            return await client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "one two"}]},
            )

        first, second = await call(), await call()
        clock.now += 89.988
        blocked = await call()
        clock.now += 0.012
        after = await call()
    assert [first.status_code, second.status_code, blocked.status_code, after.status_code] == [
        200,
        200,
        429,
        200,
    ]
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert [
        first.headers["x-ratelimit-remaining-requests"],
        second.headers["x-ratelimit-remaining-requests"],
    ] == ["1", "0"]
    assert first.headers["x-ratelimit-reset-requests"] == "1m30s"
    assert first.headers["x-ratelimit-remaining-tokens"] == str(2_000_000 - 5)
    assert blocked.headers["x-ratelimit-reset-requests"] == "12ms"
    assert blocked.json()["error"]["type"] == "requests"
    assert blocked.headers.get("retry-after") == ("1" if send_retry_after else None)
    assert after.headers["x-ratelimit-remaining-requests"] == "1"


def test_reset_durations_look_like_openai() -> None:
    assert [format_duration(s) for s in (0.012, 6, 90, 17.28, 3605)] == [
        "12ms",
        "6s",
        "1m30s",
        "17.28s",
        "1h0m5s",
    ]


# --- OpenAI: batches ---------------------------------------------------------------------------


async def test_batch_completes_after_polls_with_shuffled_output_and_error_file() -> None:
    state = FakeOpenAIState(fail_custom_ids={"c4"}, polls_to_complete=3)
    texts = ["alpha", "beta", "FAIL please", "gamma", "delta", "epsilon"]
    async with openai(state) as client:
        batch = await start_batch(client, [chat_line(f"c{i}", t) for i, t in enumerate(texts)])
        assert batch["status"] == "validating" and batch["object"] == "batch"
        polled = [(await client.get(f"/v1/batches/{batch['id']}")).json() for _ in range(3)]
        done = polled[-1]
        output = await jsonl_file(client, done["output_file_id"])
        errors = await jsonl_file(client, done["error_file_id"])
        meta = (await client.get(f"/v1/files/{done['output_file_id']}")).json()
    assert [p["status"] for p in polled] == ["in_progress", "finalizing", "completed"]
    assert done["request_counts"] == {"total": 6, "completed": 4, "failed": 2}
    assert done["completed_at"] is not None and done["input_file_id"] == batch["input_file_id"]
    by_id = {line["custom_id"]: line for line in output}
    assert [line["custom_id"] for line in output] != sorted(by_id)
    assert set(by_id) == {"c0", "c1", "c3", "c5"}
    for custom_id, line in by_id.items():
        content = line["response"]["body"]["choices"][0]["message"]["content"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert content == "echo: " + texts[int(custom_id[1:])]
    assert {line["custom_id"] for line in errors} == {"c2", "c4"}
    assert all(
        line["response"]["status_code"] == 400 and line["response"]["body"]["error"] for line in errors
    )
    assert meta["purpose"] == "batch_output" and meta["object"] == "file"
    assert state.requests["/v1/batches/{batch_id}"] == 3


async def test_batch_item_errors_can_use_the_error_field() -> None:
    state = FakeOpenAIState(item_error_style="error", polls_to_complete=1)
    async with openai(state) as client:
        batch = await start_batch(client, [chat_line("ok", "fine"), chat_line("bad", "FAIL")])
        done = (await client.get(f"/v1/batches/{batch['id']}")).json()
        (error_line,) = await jsonl_file(client, done["error_file_id"])
    assert error_line["custom_id"] == "bad" and error_line["response"] is None
    assert set(error_line["error"]) == {"code", "message"}


async def test_invalid_batch_file_fails_validation_with_line_numbers() -> None:
    lines = [
        chat_line("a", "x"),
        chat_line("a", "y"),
        chat_line("b", "z", model="other"),
        chat_line("c", "z", url="/v1/embeddings"),
        "not json",
    ]
    async with openai(FakeOpenAIState()) as client:
        batch = await start_batch(client, lines)
        failed = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert failed["status"] == "failed" and failed["output_file_id"] is None
    codes = {(e["code"], e["line"]) for e in failed["errors"]["data"]}
    assert codes == {
        ("duplicate_custom_id", 2),
        ("mismatched_model", 3),
        ("invalid_url", 4),
        ("invalid_json_line", 5),
    }


async def test_batch_create_rejects_bad_requests() -> None:
    async with openai(FakeOpenAIState()) as client:
        missing = await client.post(
            "/v1/batches",
            json={
                "input_file_id": "file-nope",
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        window = await client.post(
            "/v1/batches",
            json={
                "input_file_id": "file-nope",
                "endpoint": "/v1/chat/completions",
                "completion_window": "1h",
            },
        )
        not_jsonl = await client.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("x.txt", b"{}")}
        )
    assert (missing.status_code, window.status_code, not_jsonl.status_code) == (404, 400, 400)
    assert window.json()["error"]["param"] == "completion_window"


@pytest.mark.parametrize("in_error_file", [False, True])
async def test_expired_batch_returns_only_finished_items(in_error_file: bool) -> None:
    state = FakeOpenAIState(expire_after_items=2, expired_in_error_file=in_error_file)
    async with openai(state) as client:
        batch = await start_batch(client, [chat_line(f"c{i}", f"t{i}") for i in range(5)])
        state.force_status = "expired"
        expired = (await client.get(f"/v1/batches/{batch['id']}")).json()
        output = await jsonl_file(client, expired["output_file_id"])
        errors = await jsonl_file(client, expired["error_file_id"]) if in_error_file else []
    assert expired["status"] == "expired" and expired["expired_at"] is not None
    assert sorted(line["custom_id"] for line in output) == ["c0", "c1"]
    assert expired["request_counts"] == {"total": 5, "completed": 2, "failed": 0}
    if in_error_file:
        assert sorted(line["custom_id"] for line in errors) == ["c2", "c3", "c4"]
        assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    else:
        assert expired["error_file_id"] is None


async def test_forced_failure_ends_the_batch() -> None:
    state = FakeOpenAIState(force_status="failed")
    async with openai(state) as client:
        batch = await start_batch(client, [chat_line("a", "x")])
        failed = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "batch_failed"


async def test_cancel_moves_through_cancelling_to_cancelled() -> None:
    async with openai(FakeOpenAIState(polls_to_complete=5)) as client:
        batch = await start_batch(client, [chat_line("a", "x"), chat_line("b", "y")])
        running = (await client.get(f"/v1/batches/{batch['id']}")).json()
        cancelling = (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()
        cancelled = (await client.get(f"/v1/batches/{batch['id']}")).json()
        again = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert (running["status"], cancelling["status"], cancelled["status"]) == (
        "in_progress",
        "cancelling",
        "cancelled",
    )
    assert cancelled["output_file_id"] is None and cancelled["request_counts"]["completed"] == 0
    assert again.status_code == 400


# --- Anthropic ---------------------------------------------------------------------------------


async def test_messages_echo_with_ratelimit_headers() -> None:
    clock = FakeClock()
    state = FakeAnthropicState(clock=clock)
    body = {"model": "claude-test", "max_tokens": 8, "messages": [{"role": "user", "content": "hi there"}]}
    async with anthropic(state) as client:
        response = await client.post("/v1/messages", json=body)
    message = response.json()
    assert (
        message["type"] == "message" and message["role"] == "assistant" and message["model"] == "claude-test"
    )
    assert message["content"] == [{"type": "text", "text": "echo: hi there"}]
    assert message["stop_reason"] == "end_turn" and message["usage"] == {
        "input_tokens": 2,
        "output_tokens": 3,
    }
    reset = datetime.fromisoformat(response.headers["anthropic-ratelimit-requests-reset"])
    assert reset.timestamp() == clock.now + 60
    assert response.headers["anthropic-ratelimit-requests-remaining"] == "9999"
    assert response.headers["anthropic-ratelimit-output-tokens-remaining"] == str(2_000_000 - 3)
    assert state.requests["/v1/messages"] == 1


@pytest.mark.parametrize(
    ("headers", "status", "kind"),
    [
        ({"anthropic-version": "2023-06-01"}, 401, "authentication_error"),
        ({"x-api-key": "k"}, 400, "invalid_request_error"),
    ],
)
async def test_messages_require_key_and_version(headers: dict[str, str], status: int, kind: str) -> None:
    async with anthropic(FakeAnthropicState(), headers=headers) as client:
        response = await client.post("/v1/messages", json={})
    assert response.status_code == status
    assert response.json() == {
        "type": "error",
        "error": {"type": kind, "message": response.json()["error"]["message"]},
    }


async def test_anthropic_faults_and_limiter() -> None:
    clock = FakeClock()
    state = FakeAnthropicState(
        fail_next=[529, 429], clock=clock, limiter=Limiter(requests_per_window=1, enforce=True)
    )
    body = {"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    async with anthropic(state) as client:
        overloaded, limited, ok, blocked = [await client.post("/v1/messages", json=body) for _ in range(4)]
    assert overloaded.status_code == 529 and overloaded.json()["error"]["type"] == "overloaded_error"
    assert limited.status_code == 429 and limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert ok.status_code == 200 and ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert blocked.status_code == 429 and blocked.headers["retry-after"] == "60"
    assert state.requests["/v1/messages"] == 4


async def test_message_batch_ends_after_polls_with_shuffled_results() -> None:
    state = FakeAnthropicState(fail_custom_ids={"r3"})
    texts = ["one", "FAIL two", "three", "four", "five"]
    async with anthropic(state) as client:
        created = await client.post(
            "/v1/messages/batches",
            json={"requests": [message_request(f"r{i}", t) for i, t in enumerate(texts)]},
        )
        batch = created.json()
        early = await client.get(f"/v1/messages/batches/{batch['id']}/results")
        polled = [(await client.get(f"/v1/messages/batches/{batch['id']}")).json() for _ in range(2)]
        results = await client.get(polled[-1]["results_url"])
    assert batch["type"] == "message_batch" and batch["processing_status"] == "in_progress"
    assert batch["request_counts"]["processing"] == 5 and batch["results_url"] is None
    assert early.status_code == 400
    assert [p["processing_status"] for p in polled] == ["in_progress", "ended"]
    ended = polled[-1]
    assert ended["request_counts"] == {
        "processing": 0,
        "succeeded": 3,
        "errored": 2,
        "canceled": 0,
        "expired": 0,
    }
    assert ended["ended_at"] is not None and ended["results_url"].startswith(
        "http://fake/v1/messages/batches/"
    )
    rows = [json.loads(line) for line in results.text.splitlines()]
    assert [row["custom_id"] for row in rows] != [f"r{i}" for i in range(5)]
    by_id = {row["custom_id"]: row["result"] for row in rows}
    for custom_id in ("r0", "r2", "r4"):
        assert by_id[custom_id]["message"]["content"][0]["text"] == "echo: " + texts[int(custom_id[1:])]
    for custom_id in ("r1", "r3"):
        assert by_id[custom_id]["type"] == "errored"
        assert by_id[custom_id]["error"]["type"] == "error"
        assert by_id[custom_id]["error"]["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "requests",
    [
        [message_request("dup", "a"), message_request("dup", "b")],
        [message_request("has space", "a")],
        [message_request(f"r{i}", "a") for i in range(3)],
        [],
    ],
)
async def test_message_batch_rejects_bad_requests(requests: list[dict[str, Any]]) -> None:
    async with anthropic(FakeAnthropicState(max_batch_requests=2)) as client:
        response = await client.post("/v1/messages/batches", json={"requests": requests})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


async def test_message_batch_forced_expiry_keeps_finished_results() -> None:
    state = FakeAnthropicState(expire_after_items=1, force_status="expired")
    async with anthropic(state) as client:
        batch = (
            await client.post(
                "/v1/messages/batches", json={"requests": [message_request(f"r{i}", "x") for i in range(3)]}
            )
        ).json()
        ended = (await client.get(f"/v1/messages/batches/{batch['id']}")).json()
        rows = [json.loads(line) for line in (await client.get(ended["results_url"])).text.splitlines()]
    assert ended["request_counts"]["succeeded"] == 1 and ended["request_counts"]["expired"] == 2
    assert {row["custom_id"]: row["result"]["type"] for row in rows} == {
        "r0": "succeeded",
        "r1": "expired",
        "r2": "expired",
    }


async def test_message_batch_cancel() -> None:
    async with anthropic(FakeAnthropicState(polls_to_complete=5)) as client:
        batch = (
            await client.post("/v1/messages/batches", json={"requests": [message_request("a", "x")]})
        ).json()
        canceling = (await client.post(f"/v1/messages/batches/{batch['id']}/cancel")).json()
        ended = (await client.get(f"/v1/messages/batches/{batch['id']}")).json()
        rows = [json.loads(line) for line in (await client.get(ended["results_url"])).text.splitlines()]
        again = await client.post(f"/v1/messages/batches/{batch['id']}/cancel")
    assert canceling["processing_status"] == "canceling" and canceling["cancel_initiated_at"] is not None
    assert ended["processing_status"] == "ended" and ended["request_counts"]["canceled"] == 1
    assert rows == [{"custom_id": "a", "result": {"type": "canceled"}}]
    assert again.status_code == 400


# --- a real socket -----------------------------------------------------------------------------


async def test_serve_app_on_loopback() -> None:
    state = FakeOpenAIState()
    async with serve_app(openai_app(state)) as base_url:
        assert base_url.startswith("http://127.0.0.1:") and not base_url.endswith(":0")
        async with httpx.AsyncClient(base_url=base_url, headers=OPENAI_HEADERS) as client:
            response = await client.post("/v1/embeddings", json={"model": "e", "input": ["a", "b"]})
    assert response.status_code == 200 and response.json()["data"][1]["embedding"] == embed_text("b")
    assert state.requests["/v1/embeddings"] == 1
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=base_url) as client:
            await client.get("/v1/files/x")
