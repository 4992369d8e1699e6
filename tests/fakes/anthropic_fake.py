"""A fake Anthropic API (Messages and Message Batches) for offline end-to-end tests.

Replies echo the last user message so a test knows what each caller should get back;
faults, counters and the limiter work as in the OpenAI fake (see `FakeState`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.fakes.anthropic_batch import MessageBatch, batch_routes
from tests.fakes.common import (
    ApiError,
    Dialect,
    FakeState,
    Limiter,
    guarded_route,
    json_body,
    last_user_text,
    not_found_handlers,
    require,
    rfc3339,
    text_of,
    word_count,
)
from tests.fakes.streaming import StreamKnobs, sse, words
from tests.fakes.strict import check_keys

__all__ = ["DIALECT", "FakeAnthropicState", "create_app", "create_message"]


@dataclass
class FakeAnthropicState(FakeState, StreamKnobs):
    """Knobs and observations for the Anthropic fake (see `FakeState` for faults and counters).

    `force_status` ends the next polled batch early: "expired" expires the items after
    `expire_after_items` (default half), "canceled" cancels those after `cancel_after_items`.
    """

    max_batch_requests: int = 100_000
    force_status: Literal["expired", "canceled"] | None = None
    batches: dict[str, MessageBatch] = field(default_factory=dict)


def create_message(state: FakeAnthropicState, params: dict[str, Any]) -> dict[str, Any]:
    """Message echoing the last user turn; fails (400) when it holds `fail_marker`. Tokens are words."""
    model = require(params, "model", str)
    max_tokens = require(params, "max_tokens", int)
    messages = require(params, "messages", list)
    if max_tokens < 1:
        raise ApiError(400, "max_tokens: must be at least 1")
    if not messages or not all(
        isinstance(m, dict) and m.get("role") in ("user", "assistant") for m in messages
    ):
        raise ApiError(400, "messages: must be a non-empty list of user/assistant turns")
    prompt = last_user_text(messages)
    if state.marked_to_fail(prompt):
        raise ApiError(400, f"fake failure: message contains {state.fail_marker!r}")
    reply = "echo: " + prompt
    input_tokens = word_count(text_of(params.get("system"))) + sum(
        word_count(text_of(m.get("content"))) for m in messages
    )
    return {
        "id": state.next_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": reply}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": word_count(reply)},
    }


def stream_message(fake: FakeAnthropicState, message: dict[str, Any]) -> Response:
    """The message as Anthropic's named events, a `text_delta` per word."""
    text = message["content"][0]["text"]
    usage = message["usage"]

    async def events() -> Any:
        start = {**message, "content": [], "stop_reason": None,
                 "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 1}}
        yield "message_start", {"type": "message_start", "message": start}
        yield "content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}
        yield "ping", {"type": "ping"}
        for word in words(text):
            yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": word}}
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                "usage": {"output_tokens": usage["output_tokens"]}}
        yield "message_stop", {"type": "message_stop"}

    error = {"type": "error", "error": {"type": "overloaded_error", "message": "fake overload mid-stream"}}
    return sse(events, fake, lambda: ("error", error))


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_object(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error envelope; the type follows the status (`ApiError.kind` is OpenAI's notion)."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def _render_error(exc: ApiError) -> Response:
    return JSONResponse(error_object(exc), status_code=exc.status)


def _check_auth(request: Request) -> ApiError | None:
    if not request.headers.get("x-api-key", "").strip():
        return ApiError(401, "x-api-key header is required")
    if not request.headers.get("anthropic-version", "").strip():
        return ApiError(400, "anthropic-version: header is required")
    return None


def _limit_headers(limiter: Limiter, now: float) -> dict[str, str]:
    reset = rfc3339(limiter.reset_at(now))
    limit = limiter.tokens_per_window
    remaining = {
        "requests": limiter.remaining_requests,
        "tokens": limiter.remaining_tokens,
        "input-tokens": max(0, limit - limiter.used_input_tokens),
        "output-tokens": max(0, limit - limiter.used_output_tokens),
    }
    headers: dict[str, str] = {}
    for name, left in remaining.items():
        prefix = f"anthropic-ratelimit-{name}"
        headers[f"{prefix}-limit"] = str(limiter.requests_per_window if name == "requests" else limit)
        headers[f"{prefix}-remaining"] = str(left)
        headers[f"{prefix}-reset"] = reset
    return headers


DIALECT = Dialect(
    check_auth=_check_auth,
    render_error=_render_error,
    limit_headers=_limit_headers,
    request_id_header="request-id",
)


def create_app(state: FakeAnthropicState | None = None) -> Starlette:
    """Build the fake; pass a state to tune it, or read the created one from `app.state.fake`."""
    fake = FakeAnthropicState() if state is None else state

    async def messages_endpoint(request: Request) -> Response:
        params = await json_body(request)
        check_keys(fake.strict_keys, "/v1/messages", params)
        message = create_message(fake, params)
        fake.limiter.add_tokens(message["usage"]["input_tokens"], message["usage"]["output_tokens"])
        if params.get("stream"):
            return stream_message(fake, message)
        return JSONResponse(message)

    async def count_tokens_endpoint(request: Request) -> Response:
        params = await json_body(request)
        check_keys(fake.strict_keys, "/v1/messages/count_tokens", params)
        require(params, "model", str)
        messages = require(params, "messages", list)
        texts = [text_of(m.get("content")) for m in messages if isinstance(m, dict)]
        system = params.get("system")
        texts.append(system if isinstance(system, str) else text_of(system))
        return JSONResponse({"input_tokens": sum(word_count(t) for t in texts)})

    routes = [
        guarded_route("/v1/messages/count_tokens", ["POST"], count_tokens_endpoint, fake, DIALECT),
        guarded_route("/v1/messages", ["POST"], messages_endpoint, fake, DIALECT),
        *batch_routes(fake, DIALECT, create_message, error_object),
    ]
    app = Starlette(routes=routes, exception_handlers=not_found_handlers(DIALECT))
    app.state.fake = fake
    return app
