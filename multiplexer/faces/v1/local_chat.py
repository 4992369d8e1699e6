"""Chat completions on routes that take a prompt (local ``generate`` models): the messages go to
the model (which renders them with its chat template), and the completion (or its streamed
chunks) comes back in chat's shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from multiplexer.core.errors import invalid_params
from multiplexer.core.json_codec import dumps
from multiplexer.core.responses_api import ResponseEvents, response_object
from multiplexer.faces.v1.common import HttpError

KNOBS = ("temperature", "top_p", "seed", "stop")


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


def _chunks(body: dict[str, Any], base: dict[str, Any],
            choice: Callable[[dict[str, Any], bool], dict[str, Any]]) -> Any:
    """An encoder of the local stream's text chunks as OpenAI ``data:`` events with ``base`` and
    ``choice(local choice, first)``; the usage chunk only when the caller asked for it."""
    options = body.get("stream_options")
    want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    first = [True]

    def encode(chunk: dict[str, Any]) -> bytes:
        if chunk.get("error") is not None:  # the face's error event
            return b"data: " + dumps(chunk) + b"\n\n"
        if "usage" in chunk and not chunk.get("choices"):
            if not want_usage:
                return b""
            return b"data: " + dumps({**base, "choices": [], "usage": chunk["usage"]}) + b"\n\n"
        out = {**base, "choices": [choice(chunk["choices"][0], first[0])]}
        first[0] = False
        return b"data: " + dumps(out) + b"\n\n"

    return encode


def chunk_encoder(body: dict[str, Any]) -> Any:
    """Encodes the local stream's text chunks as ``chat.completion.chunk`` events."""
    base = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body["model"], "system_fingerprint": None}

    def choice(local: dict[str, Any], first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": local.get("text", "")}
        if first:
            delta["role"] = "assistant"
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": local.get("finish_reason")}

    return _chunks(body, base, choice)


# -- the Responses API on the same routes ------------------------------------------------------
def _item_message(item: Any) -> dict[str, str]:
    """An input item as a chat message: ``{role, content}`` with text content (a string, or
    ``input_text``/``output_text`` parts); other item kinds (tool calls, files) are refused."""
    if not isinstance(item, dict) or item.get("type", "message") != "message" or \
            item.get("role") not in ("user", "assistant", "system", "developer"):
        raise HttpError(400, invalid_params("this model takes message items with text content only"),
                        param="input")
    content = item.get("content")
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                 and p.get("type") in ("input_text", "output_text", "text")]
        if len(texts) != len(content):
            raise HttpError(400, invalid_params("this model takes text content only"), param="input")
        content = "".join(texts)
    if not isinstance(content, str):
        raise HttpError(400, invalid_params("a message item's content must be text"), param="input")
    role = "system" if item["role"] == "developer" else item["role"]
    return {"role": role, "content": content}


def responses_params(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API body as a generate call's params: ``input`` (a string or message items)
    and ``instructions`` become the messages the model's chat template renders."""
    if body.get("previous_response_id") is not None:
        raise HttpError(400, invalid_params("this model keeps no responses: send the whole conversation "
                                            "as input"), param="previous_response_id")
    raw = body.get("input")
    if isinstance(raw, str):
        messages = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        messages = [_item_message(item) for item in raw]
    else:
        raise HttpError(400, invalid_params("'input' must be a string or a non-empty array"), param="input")
    if isinstance(body.get("instructions"), str):
        messages = [{"role": "system", "content": body["instructions"]}, *messages]
    params: dict[str, Any] = {"messages": messages}
    if body.get("max_output_tokens") is not None:
        params["max_new_tokens"] = body["max_output_tokens"]
    params.update({k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None})
    if isinstance(body.get("model"), str):
        params["model"] = body["model"]
    return params


def _ids() -> tuple[str, str, int]:
    return "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24], int(time.time())


def responses_result(result: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``text_completion`` with one choice, as a ``response``."""
    choice = result["choices"][0]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    rid, mid, created = _ids()
    return response_object(rid, mid, created, model, status, choice["text"], result.get("usage"))


@dataclass
class _Stream:
    """What a Responses stream has sent so far."""

    open: bool = False
    text: str = ""
    finish: str | None = None


def _named(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


def response_encoder(body: dict[str, Any]) -> Any:
    """Encodes the local stream's text chunks as the Responses API's named events: the response
    and its message opened with the first chunk, a delta per chunk, all closed with the usage."""
    events = ResponseEvents(*_ids(), body["model"])
    state = _Stream()

    def encode(chunk: dict[str, Any]) -> bytes:
        if chunk.get("type") == "error":  # the face's error event
            return _named(events.event("error", **{k: v for k, v in chunk.items() if k != "type"}))
        out = b""
        if not state.open:
            state.open = True
            out = b"".join(map(_named, events.opening()))
        if "usage" in chunk and not chunk.get("choices"):
            status = "incomplete" if state.finish == "length" else "completed"
            return out + b"".join(map(_named, events.closing(status, state.text, chunk["usage"])))
        choice = chunk["choices"][0]
        state.finish = choice.get("finish_reason") or state.finish
        delta = choice.get("text", "")
        if delta:
            state.text += delta
            out += _named(events.delta(delta))
        return out

    return encode


# -- legacy completions on the same routes -------------------------------------------------------
_UNSUPPORTED = ("logprobs", "echo", "suffix", "best_of")


def completion_params(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` body as a generate call's params (the model takes the prompt as is,
    no chat template); what this model cannot do is refused, not ignored."""
    if body.get("n", 1) != 1:
        raise HttpError(400, invalid_params("only n: 1 is supported by this model"), param="n")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, 1 if key == "best_of" else None):
            raise HttpError(400, invalid_params(f"{key} is not supported by this model"), param=key)
    params = {k: body[k] for k in ("prompt", "max_tokens", *KNOBS) if body.get(k) is not None}
    if isinstance(body.get("model"), str):
        params["model"] = body["model"]
    return params


def completion_result(result: dict[str, Any], model: str) -> dict[str, Any]:
    """The local ``text_completion`` in the API's shape: an id, the asked model, no token ids."""
    return {
        "id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
        "model": model, "system_fingerprint": None,
        "choices": [{"index": c["index"], "text": c["text"], "logprobs": None,
                     "finish_reason": c["finish_reason"]} for c in result["choices"]],
        "usage": result.get("usage"),
    }


def completion_encoder(body: dict[str, Any]) -> Any:
    """Encodes the local stream's text chunks as the API's ``text_completion`` chunks."""
    base = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
            "model": body["model"], "system_fingerprint": None}
    return _chunks(body, base, lambda local, first: {
        "index": 0, "text": local.get("text", ""), "logprobs": None,
        "finish_reason": local.get("finish_reason")})
