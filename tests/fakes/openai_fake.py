"""A fake OpenAI API (embeddings, chat completions, files + batches) for offline end-to-end tests.

Replies are deterministic functions of the request so a test can compute what each caller
should receive (`embed_text`, `"echo: " + last user message`) and check the gateway routed
every answer to the right caller. See `FakeOpenAIState` for the knobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from providers.mock import encoded, unit_vector
from tests.fakes.common import (
    ApiError,
    Dialect,
    FakeState,
    Limiter,
    format_duration,
    guarded_route,
    json_body,
    last_user_text,
    not_found_handlers,
    require,
    text_of,
    word_count,
)
from tests.fakes.openai_batch import BatchJob, StoredFile, batch_routes
from tests.fakes.streaming import StreamKnobs, sse, words
from tests.fakes.strict import check_keys

__all__ = ["DIALECT", "FakeOpenAIState", "chat_completion", "create_app", "embed_text", "embeddings"]


@dataclass
class FakeOpenAIState(FakeState, StreamKnobs):
    """Knobs and observations for the OpenAI fake (see `FakeState` for faults and counters).

    `embedding_batch_sizes` logs the input count of every accepted `/v1/embeddings` call.
    Batches: `force_status` ends the next polled batch as failed/expired/cancelled;
    `item_error_style` picks how failing items appear in the error file ("response": status 400
    with an error body, like a failed request; "error": `error: {code, message}`);
    `expired_in_error_file` writes `batch_expired` lines for unfinished items instead of omitting them.
    """

    embedding_dim: int = 8
    max_embedding_inputs: int = 2048
    embedding_batch_sizes: list[int] = field(default_factory=list)
    max_batch_requests: int = 50_000
    force_status: Literal["failed", "expired", "cancelled"] | None = None
    item_error_style: Literal["response", "error"] = "response"
    expired_in_error_file: bool = False
    quota_full_creates: int = 0  # the next N batch creates fail with token_limit_exceeded (Azure)
    files: dict[str, StoredFile] = field(default_factory=dict)
    batches: dict[str, BatchJob] = field(default_factory=dict)
    bodies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # request bodies, by path


def embed_text(text: str, dim: int = 8) -> list[float]:
    """Unit vector derived from SHAKE-256 of the text: same text, same vector, in any process
    (the mock provider's, so the two agree)."""
    return unit_vector(text, dim)


def embeddings(state: FakeOpenAIState, body: dict[str, Any]) -> dict[str, Any]:
    """Embeddings response body; `usage` counts whitespace words (see `word_count`)."""
    model = require(body, "model", str)
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs:
        raise ApiError(400, "'input' must be a non-empty string or array of strings", param="input")
    if len(inputs) > state.max_embedding_inputs:
        raise ApiError(
            400,
            f"'$.input' is too long. Maximum length is {state.max_embedding_inputs}, got {len(inputs)}.",
            param="input",
        )
    if not all(isinstance(text, str) and text for text in inputs):
        raise ApiError(400, "'$.input' is invalid: every item must be a non-empty string", param="input")
    dim = body.get("dimensions", state.embedding_dim)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ApiError(400, "'dimensions' must be a positive integer", param="dimensions")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    data = []
    for index, text in enumerate(inputs):
        data.append({"object": "embedding", "index": index,
                     "embedding": encoded(embed_text(text, dim), encoding)})
    tokens = sum(word_count(text) for text in inputs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def chat_completion(state: FakeOpenAIState, body: dict[str, Any]) -> dict[str, Any]:
    """Chat completion echoing the last user message; fails (400) when it holds `fail_marker`."""
    model = require(body, "model", str)
    messages = require(body, "messages", list)
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ApiError(400, "'messages' must be a non-empty array of {role, content}", param="messages")
    prompt = last_user_text(messages)
    if state.marked_to_fail(prompt):
        raise ApiError(400, f"fake failure: message contains {state.fail_marker!r}", param="messages")
    reply = "echo: " + prompt
    prompt_tokens = sum(word_count(text_of(m.get("content"))) for m in messages)
    completion_tokens = word_count(reply)
    return {
        "id": state.next_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(state.clock()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chat(fake: FakeOpenAIState, body: dict[str, Any], result: dict[str, Any]) -> Response:
    """The completion as `chat.completion.chunk` events: a role, a word each, the finish reason,
    the usage chunk when `stream_options.include_usage`, then `[DONE]`."""
    head = {k: result[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"
    text = result["choices"][0]["message"]["content"]
    options = body.get("stream_options") or {}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    async def events() -> Any:
        yield None, chunk({"role": "assistant", "content": ""})
        for word in words(text):
            yield None, chunk({"content": word})
        yield None, chunk({}, "stop")
        if options.get("include_usage"):
            yield None, {**head, "choices": [], "usage": result["usage"]}
        yield None, "[DONE]"

    error = {"error": {"message": "fake failure mid-stream", "type": "server_error",
                       "param": None, "code": None}}
    return sse(events, fake, lambda: (None, error))


def completion(state: FakeOpenAIState, body: dict[str, Any]) -> dict[str, Any]:
    """A legacy text completion echoing the prompt (a string, or a list of them: a choice each)."""
    model = require(body, "model", str)
    raw = body.get("prompt")
    prompts = [raw] if isinstance(raw, str) else raw
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "'prompt' must be a string or an array of strings", param="prompt")
    if any(state.marked_to_fail(p) for p in prompts):
        raise ApiError(400, f"fake failure: prompt contains {state.fail_marker!r}", param="prompt")
    texts = ["echo: " + p for p in prompts]
    prompt_tokens = sum(word_count(p) for p in prompts)
    completion_tokens = sum(word_count(t) for t in texts)
    return {
        "id": state.next_id("cmpl-"), "object": "text_completion", "created": int(state.clock()),
        "model": model, "system_fingerprint": None,
        "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": "stop"}
                    for i, t in enumerate(texts)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def stream_completion(fake: FakeOpenAIState, body: dict[str, Any], result: dict[str, Any]) -> Response:
    """The completion as `text_completion` chunks: a word each, the finish reason, the usage chunk
    when `stream_options.include_usage`, then `[DONE]`."""
    head = {k: result[k] for k in ("id", "object", "created", "model", "system_fingerprint")}
    text = result["choices"][0]["text"]
    options = body.get("stream_options") or {}

    def chunk(piece: str, finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}]}

    async def events() -> Any:
        for word in words(text):
            yield None, chunk(word)
        yield None, chunk("", "stop")
        if options.get("include_usage"):
            yield None, {**head, "choices": [], "usage": result["usage"]}
        yield None, "[DONE]"

    error = {"error": {"message": "fake failure mid-stream", "type": "server_error", "param": None,
                       "code": None}}
    return sse(events, fake, lambda: (None, error))


def response(state: FakeOpenAIState, body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API response echoing the last user input; fails (400) on `fail_marker`."""
    model = require(body, "model", str)
    raw = body.get("input")
    if isinstance(raw, str):
        prompt, inputs = raw, [raw]
    elif isinstance(raw, list) and raw:
        prompt = last_user_text(raw)
        inputs = [text_of(m.get("content")) for m in raw if isinstance(m, dict)]
    else:
        raise ApiError(400, "'input' must be a string or a non-empty array of items", param="input")
    if state.marked_to_fail(prompt):
        raise ApiError(400, f"fake failure: input contains {state.fail_marker!r}", param="input")
    reply = "echo: " + prompt
    input_tokens = sum(word_count(t) for t in inputs)
    output_tokens = word_count(reply)
    message = {"type": "message", "id": state.next_id("msg_"), "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": reply, "annotations": []}]}
    return {
        "id": state.next_id("resp_"), "object": "response", "created_at": int(state.clock()),
        "status": "completed", "model": model, "output": [message], "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": [], "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": {}, "temperature": 1.0, "top_p": 1.0,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                  "total_tokens": input_tokens + output_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def stream_response(fake: FakeOpenAIState, body: dict[str, Any], result: dict[str, Any]) -> Response:
    """The Responses API's named events: created, the message and its text a word a delta, done."""
    message = result["output"][0]
    text = message["content"][0]["text"]
    seq = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **fields}

    async def events() -> Any:
        started = {**result, "status": "in_progress", "output": [], "usage": None}
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        item = {**message, "status": "in_progress", "content": []}
        yield event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", item_id=message["id"], output_index=0, content_index=0,
                    part=part)
        for word in words(text):
            yield event("response.output_text.delta", item_id=message["id"], output_index=0,
                        content_index=0, delta=word, logprobs=[])
        yield event("response.output_text.done", item_id=message["id"], output_index=0, content_index=0,
                    text=text, logprobs=[])
        yield event("response.content_part.done", item_id=message["id"], output_index=0, content_index=0,
                    part=message["content"][0])
        yield event("response.output_item.done", output_index=0, item=message)
        yield event("response.completed", response=result)

    return sse(events, fake, lambda: event("error", code="server_error", message="fake failure mid-stream",
                                           param=None))


_ERROR_DEFAULTS: dict[int, tuple[str, str | None]] = {
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    429: ("requests", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
}


def _render_error(exc: ApiError) -> Response:
    kind, code = _ERROR_DEFAULTS.get(
        exc.status, ("server_error" if exc.status >= 500 else "invalid_request_error", None)
    )
    error = {"message": exc.message, "type": exc.kind or kind, "param": exc.param, "code": exc.code or code}
    return JSONResponse({"error": error}, status_code=exc.status)


def _check_auth(request: Request) -> ApiError | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return None
    return ApiError(401, "You didn't provide an API key. Send 'Authorization: Bearer <key>'.")


def _limit_headers(limiter: Limiter, now: float) -> dict[str, str]:
    reset = format_duration(limiter.reset_in(now))
    return {
        "x-ratelimit-limit-requests": str(limiter.requests_per_window),
        "x-ratelimit-remaining-requests": str(limiter.remaining_requests),
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-limit-tokens": str(limiter.tokens_per_window),
        "x-ratelimit-remaining-tokens": str(limiter.remaining_tokens),
        "x-ratelimit-reset-tokens": reset,
    }


DIALECT = Dialect(
    check_auth=_check_auth,
    render_error=_render_error,
    limit_headers=_limit_headers,
    request_id_header="x-request-id",
)


def create_app(state: FakeOpenAIState | None = None) -> Starlette:
    """Build the fake; pass a state to tune it, or read the created one from `app.state.fake`."""
    fake = FakeOpenAIState() if state is None else state

    async def embeddings_endpoint(request: Request) -> Response:
        body = await json_body(request)
        check_keys(fake.strict_keys, "/v1/embeddings", body)
        result = embeddings(fake, body)
        fake.embedding_batch_sizes.append(len(result["data"]))
        fake.limiter.add_tokens(result["usage"]["prompt_tokens"])
        return JSONResponse(result)

    def generation(path: str, answer: Callable[[FakeOpenAIState, dict[str, Any]], dict[str, Any]],
                   stream: Callable[[FakeOpenAIState, dict[str, Any], dict[str, Any]], Response],
                   spent: tuple[str, str]) -> Callable[[Request], Any]:
        """An endpoint that answers, counts the usage against the limits, keeps the body, streams."""
        async def endpoint(request: Request) -> Response:
            body = await json_body(request)
            check_keys(fake.strict_keys, path, body)
            result = answer(fake, body)
            fake.limiter.add_tokens(*(result["usage"][k] for k in spent))
            fake.bodies.setdefault(path, []).append(body)
            if body.get("stream"):
                return stream(fake, body, result)
            return JSONResponse(result)

        return endpoint

    chat_endpoint = generation("/v1/chat/completions", chat_completion, stream_chat,
                               ("prompt_tokens", "completion_tokens"))
    completions_endpoint = generation("/v1/completions", completion, stream_completion,
                                      ("prompt_tokens", "completion_tokens"))
    responses_endpoint = generation("/v1/responses", response, stream_response,
                                    ("input_tokens", "output_tokens"))

    operations: dict[str, Callable[[FakeOpenAIState, dict[str, Any]], dict[str, Any]]] = {
        "/v1/embeddings": embeddings,
        "/v1/chat/completions": chat_completion,
        "/v1/responses": response,
        "/v1/completions": completion,
    }
    routes = [
        guarded_route("/v1/embeddings", ["POST"], embeddings_endpoint, fake, DIALECT),
        guarded_route("/v1/chat/completions", ["POST"], chat_endpoint, fake, DIALECT),
        guarded_route("/v1/responses", ["POST"], responses_endpoint, fake, DIALECT),
        guarded_route("/v1/completions", ["POST"], completions_endpoint, fake, DIALECT),
        *batch_routes(fake, DIALECT, operations),
    ]
    app = Starlette(routes=routes, exception_handlers=not_found_handlers(DIALECT))
    app.state.fake = fake
    return app
