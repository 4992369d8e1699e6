"""A fake Gemini API (generateContent, its SSE stream, embeddings, Files and Batch API) for offline
end-to-end tests, written from the shapes in the vendor notes (batch-providers.md section 1).

Replies echo the last user turn ("echo: <text>"), so a test knows what each caller should get;
tokens are words. A user text holding `fail_marker` fails with 400 INVALID_ARGUMENT; one that
starts with "call " answers with a functionCall of the first declared function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.fakes.common import (
    ApiError,
    Dialect,
    FakeState,
    Limiter,
    guarded_route,
    json_body,
    not_found_handlers,
    word_count,
)
from tests.fakes.streaming import StreamKnobs, sse, words

__all__ = ["DIALECT", "FakeGeminiState", "create_app", "generate"]

PART_KEYS = frozenset({"text", "inlineData", "inline_data", "fileData", "file_data", "functionCall",
                       "function_call", "functionResponse", "function_response", "thought",
                       "thoughtSignature"})
REQUEST_KEYS = frozenset({"model", "contents", "systemInstruction", "system_instruction", "generationConfig",
                          "generation_config", "safetySettings", "safety_settings", "tools",
                          "toolConfig", "tool_config", "cachedContent", "cached_content"})
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
MAX_EMBED_REQUESTS = 100


@dataclass
class FakeGeminiState(FakeState, StreamKnobs):
    """Knobs for the Batch API besides `FakeState`'s: `state_prefix` (the wire's BATCH_STATE_ or
    the SDK's JOB_STATE_), `output_in` (the operation's `response`, as the REST guide reads it,
    or `metadata.output`, as the SDK does), `echo_inline_keys` (users report inline results carry
    no key), `force_state` ("EXPIRED", "FAILED"), `enqueued_token_limit` per model (429 beyond)."""

    state_prefix: str = "BATCH_STATE_"
    output_in: Literal["response", "metadata"] = "response"
    echo_inline_keys: bool = False
    force_state: str | None = None
    enqueued_token_limit: int | None = None
    max_concurrent_batches: int = 100
    batches: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    uploads: dict[str, dict[str, Any]] = field(default_factory=dict)
    generated: list[dict[str, Any]] = field(default_factory=list)  # every generateContent body seen
    embed_sizes: list[int] = field(default_factory=list)  # inputs of each batchEmbedContents request


def _get(body: dict[str, Any], camel: str) -> Any:
    """Proto JSON takes camelCase and snake_case alike."""
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    return body.get(camel, body.get(snake))


def _texts(content: Any) -> list[str]:
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p["text"] for p in parts or [] if isinstance(p, dict) and isinstance(p.get("text"), str)]


def generate(state: FakeGeminiState, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """A GenerateContentResponse for one request body (raises ApiError as the API would)."""
    unknown = set(body) - REQUEST_KEYS
    if unknown:
        raise ApiError(400, f"Invalid JSON payload received. Unknown name {sorted(unknown)[0]!r}")
    contents = _get(body, "contents")
    if not isinstance(contents, list) or not contents:
        raise ApiError(400, "* GenerateContentRequest.contents: contents is not specified")
    images: list[str] = []
    for turn in contents:
        if not isinstance(turn, dict) or turn.get("role", "user") not in ("user", "model"):
            raise ApiError(400, "Please use a valid role: user, model.")
        parts = turn.get("parts")
        if not isinstance(parts, list) or not parts:
            raise ApiError(400, "* GenerateContentRequest.contents.parts: contents.parts must not be empty.")
        for part in parts:
            if not isinstance(part, dict) or not part or set(part) - PART_KEYS:
                raise ApiError(400, f"Invalid part: {part!r}")
            inline = _get(part, "inlineData")
            if isinstance(inline, dict):
                if not inline.get("mimeType") or not isinstance(inline.get("data"), str):
                    raise ApiError(400, "inlineData needs mimeType and data")
                images.append(inline["mimeType"])
    state.generated.append(body)
    last = contents[-1]
    text = " ".join(_texts(last))
    if state.marked_to_fail(text):
        raise ApiError(400, f"fake failure: the prompt contains {state.fail_marker!r}")
    parts: list[dict[str, Any]]
    responses = [p[k] for p in last.get("parts", []) for k in ("functionResponse",) if k in p]
    declared = [d for t in _get(body, "tools") or [] for d in _get(t, "functionDeclarations") or []]
    if responses:
        reply = "echo: tool said " + json.dumps(responses[0].get("response"), sort_keys=True)
        parts = [{"text": reply}]
    elif text.startswith("call ") and declared:
        reply = ""
        parts = [{"functionCall": {"name": declared[0]["name"], "args": {"q": text[5:]}}}]
    else:
        reply = "echo: " + text + (f" [{len(images)} image(s): {', '.join(images)}]" if images else "")
        parts = [{"text": reply}]
    finish = "STOP"
    config = _get(body, "generationConfig") or {}
    budget = _get(config, "maxOutputTokens")
    if isinstance(budget, int) and reply and word_count(reply) > budget:
        reply = " ".join(reply.split()[:budget])
        parts, finish = [{"text": reply}], "MAX_TOKENS"
    prompt = sum(word_count(t) for turn in contents for t in _texts(turn))
    prompt += sum(word_count(t) for t in _texts(_get(body, "systemInstruction")))
    output = word_count(reply) if reply else 3
    cand = {"content": {"role": "model", "parts": parts}, "finishReason": finish, "index": 0}
    return {"candidates": [cand],
            "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": output,
                              "totalTokenCount": prompt + output},
            "modelVersion": model, "responseId": state.next_id("resp")}


def stream(state: FakeGeminiState, response: dict[str, Any]) -> Response:
    """`alt=sse`: a chunk per word of the text, the last with the finish reason and usage."""
    cand = response["candidates"][0]
    text = "".join(p.get("text", "") for p in cand["content"]["parts"])
    calls = [p for p in cand["content"]["parts"] if "functionCall" in p]

    async def events() -> Any:
        pieces = words(text) if text else []
        chunks = [[{"text": w}] for w in pieces] + ([calls] if calls else [])
        for i, parts in enumerate(chunks):
            content = {"role": "model", "parts": parts}
            chunk: dict[str, Any] = {"candidates": [{"content": content, "index": 0}],
                                     "modelVersion": response["modelVersion"],
                                     "responseId": response["responseId"]}
            if i == len(chunks) - 1:
                chunk["candidates"][0]["finishReason"] = cand["finishReason"]
                chunk["usageMetadata"] = response["usageMetadata"]
            yield None, chunk

    error = {"error": {"code": 503, "message": "fake overload mid-stream", "status": "UNAVAILABLE"}}
    return sse(events, state, lambda: (None, error))


def embed_values(text: str, index: int) -> list[float]:
    return [float(len(text)), float(index)]


def error_object(exc: ApiError) -> dict[str, Any]:
    return {"error": {"code": exc.status, "message": exc.message,
                      "status": STATUS.get(exc.status, "UNKNOWN"), "details": []}}


def _render_error(exc: ApiError) -> Response:
    return JSONResponse(error_object(exc), status_code=exc.status)


def _check_auth(request: Request) -> ApiError | None:
    if not (request.headers.get("x-goog-api-key") or request.query_params.get("key")):
        return ApiError(403, "Method doesn't allow unregistered callers (callers without established "
                        "identity). Please use API Key or other form of API consumer identity.")
    return None


def _limit_headers(limiter: Limiter, now: float) -> dict[str, str]:
    return {}  # the Gemini API sends no rate-limit headers


DIALECT = Dialect(check_auth=_check_auth, render_error=_render_error, limit_headers=_limit_headers,
                  request_id_header="x-request-id")


def create_app(state: FakeGeminiState | None = None) -> Starlette:
    """Build the fake; pass a state to tune it, or read the created one from `app.state.fake`."""
    from tests.fakes.gemini_batch import batch_routes

    fake = FakeGeminiState() if state is None else state

    async def models(request: Request) -> Response:
        model, _, method = request.path_params["name"].partition(":")
        body = await json_body(request)
        if method == "generateContent":
            return JSONResponse(generate(fake, model, body))
        if method == "streamGenerateContent":
            if request.query_params.get("alt") != "sse":
                raise ApiError(400, "the fake streams only with alt=sse")
            return stream(fake, generate(fake, model, body))
        if method == "embedContent":
            text = " ".join(_texts(body.get("content")))
            return JSONResponse({"embedding": {"values": embed_values(text, 0)}})
        if method == "batchEmbedContents":
            requests = body.get("requests")
            if not isinstance(requests, list) or not requests:
                raise ApiError(400, "* BatchEmbedContentsRequest.requests: requests is not specified")
            if len(requests) > MAX_EMBED_REQUESTS:
                raise ApiError(400, f"at most {MAX_EMBED_REQUESTS} requests can be in one batch")
            fake.embed_sizes.append(len(requests))
            out = []
            for i, r in enumerate(requests):
                if r.get("model") != f"models/{model}":
                    raise ApiError(400, f"requests[{i}].model must be models/{model}")
                text = " ".join(_texts(r.get("content")))
                if fake.marked_to_fail(text):
                    raise ApiError(400, f"fake failure: requests[{i}] contains {fake.fail_marker!r}")
                out.append({"values": embed_values(text, i)})
            return JSONResponse({"embeddings": out})
        if method == "batchGenerateContent":
            from tests.fakes.gemini_batch import create_batch

            return JSONResponse(create_batch(fake, model, body, str(request.base_url).rstrip("/")))
        raise ApiError(404, f"unknown method {method!r}")

    routes = [guarded_route("/v1beta/models/{name}", ["POST"], models, fake, DIALECT),
              *batch_routes(fake, DIALECT)]
    app = Starlette(routes=routes, exception_handlers=not_found_handlers(DIALECT))
    app.state.fake = fake
    return app
