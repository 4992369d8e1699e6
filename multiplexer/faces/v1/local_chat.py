"""Chat completions on routes that take a prompt (local ``generate`` models): the messages go to
the model (which renders them with its chat template), and the completion (or its streamed
chunks) comes back in chat's shape."""

from __future__ import annotations

import time
import uuid
from typing import Any

from multiplexer.core.errors import invalid_params
from multiplexer.core.jsonrpc import dumps
from multiplexer.core.policy import RouteConfig
from multiplexer.faces.v1.common import HttpError

KNOBS = ("temperature", "top_p", "seed", "stop")


def is_local_chat(route: RouteConfig) -> bool:
    """Routes without a chat operation take ``{prompt}`` (the local provider's generate task)."""
    return route.operation != "chat"


def chat_params(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("n", 1) != 1:
        raise HttpError(400, invalid_params("only n: 1 is supported by this model"), param="n")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise HttpError(400, invalid_params("'messages' must be a non-empty array"), param="messages")
    # the local provider renders them with the model's chat template (or a plain transcript)
    params: dict[str, Any] = {"messages": body["messages"]}
    new = body.get("max_completion_tokens", body.get("max_tokens"))
    if new is not None:
        params["max_new_tokens"] = new
    params.update({k: body[k] for k in KNOBS if body.get(k) is not None})
    if isinstance(body.get("model"), str):
        params["model"] = body["model"]
    return params


def chat_result(result: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``text_completion`` with one choice, as a ``chat.completion``."""
    choice = result["choices"][0]
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion",
        "created": int(time.time()), "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": choice["text"],
                                             "refusal": None},
                     "logprobs": None, "finish_reason": choice["finish_reason"]}],
        "usage": result.get("usage"),
    }


def chunk_encoder(body: dict[str, Any]) -> Any:
    """Encodes the local stream's text chunks as ``chat.completion.chunk`` events."""
    model = body["model"]
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    options = body.get("stream_options")
    want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    first = [True]

    def encode(chunk: dict[str, Any]) -> bytes:
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None}
        if chunk.get("error") is not None:  # the face's error event
            return b"data: " + dumps(chunk) + b"\n\n"
        if "usage" in chunk and not chunk.get("choices"):
            if not want_usage:
                return b""
            return b"data: " + dumps({**base, "choices": [], "usage": chunk["usage"]}) + b"\n\n"
        choice = chunk["choices"][0]
        delta: dict[str, Any] = {"content": choice.get("text", "")}
        if first[0]:
            delta["role"] = "assistant"
            first[0] = False
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                    "finish_reason": choice.get("finish_reason")}]}
        return b"data: " + dumps(out) + b"\n\n"

    return encode
