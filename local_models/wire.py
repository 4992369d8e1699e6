"""Request params in, OpenAI-shaped responses out, so local and remote models are interchangeable.

Parsing is torch-free (it runs in ``prepare`` on the event loop); the response
builders take tensors and run in the worker thread with the forward pass.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from multiplexer.core.call import Outcome
from multiplexer.core.errors import RpcError, invalid_params
from multiplexer.core.jsonrpc import is_token_array, is_unicode

from .prepared import Prepared

try:
    import orjson
except ImportError:  # the local extra brings it; without it replies are encoded by the face
    orjson = None  # type: ignore[assignment]

MAX_STOPS = 8


def chat_messages(params: dict[str, Any]) -> list[dict[str, str]] | None:
    """A generation call's ``messages`` (chat), checked, with text parts joined; None without."""
    messages = params.get("messages")
    if messages is None:
        return None
    if not isinstance(messages, list) or not messages:
        raise invalid_params("messages must be a non-empty array", param="messages")
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            content = " ".join(p for p in parts if isinstance(p, str))
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise invalid_params("each message needs a string role and text content", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def transcript(messages: list[dict[str, str]]) -> str:
    """The prompt for a model without a chat template: one ``role: content`` line per turn."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The model's own chat template when its tokenizer has one, else the plain transcript."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return transcript(messages)


def texts_of(params: dict[str, Any], task: str) -> list[str]:
    """``input`` (or ``prompt`` for generation): one string or a non-empty list of strings.
    A generation call may send chat ``messages`` instead (rendered again, with the model's chat
    template, once its tokenizer is loaded)."""
    if task == "generate" and "prompt" not in params and "input" not in params:
        messages = chat_messages(params)
        if messages is not None:
            return [transcript(messages)]
    key = "input" if "input" in params or task != "generate" else "prompt"
    value = params.get(key)
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        texts = list(value)
    elif is_token_array(value) or (isinstance(value, list) and value
                                   and all(map(is_token_array, value))):  # one array, or several
        raise invalid_params(
            f"{key} holds token ids: a local model takes text, since ids from another tokenizer "
            "(tiktoken's, as LangChain's OpenAIEmbeddings sends unless check_embedding_ctx_length "
            "is false) would be other words in this model's vocabulary", param=key)
    else:
        raise invalid_params(f"{key} must be a string or a non-empty list of strings", param=key)
    for i, text in enumerate(texts):
        if not text.isascii() and not is_unicode(text):
            raise invalid_params(f"{key} holds a lone surrogate (text {i}): not Unicode text",
                                 param=key, index=i)
    return texts


def _number(params: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise invalid_params(f"{key} must be a number in [{lo}, {hi}]")
    return float(value)


def _int(params: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = params.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise invalid_params(f"{key} must be an integer in [{lo}, {hi}]")
    return value


def options_of(params: dict[str, Any], task: str, *, max_new_tokens: int, limit: int) -> dict[str, Any]:
    """The task's own knobs, validated; what the model does not support is refused, not ignored."""
    if task == "embed":
        fmt = params.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise invalid_params('encoding_format must be "float" or "base64"')
        if params.get("dimensions") is not None:
            raise invalid_params("dimensions is not supported by local embedding models")
        return {"encoding_format": fmt}
    if task == "classify":
        return {"top_k": _int(params, "top_k", None, 1, 1_000_000)}
    new = params.get("max_new_tokens", params.get("max_tokens"))
    new = _int({"max_new_tokens": new}, "max_new_tokens", max_new_tokens, 1, limit)
    stop = params.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str) and stop:
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise invalid_params(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return {
        "messages": chat_messages(params),
        "max_new_tokens": new,
        "temperature": _number(params, "temperature", 0.0, 0.0, 100.0),
        "top_p": _number(params, "top_p", 1.0, 1e-6, 1.0),
        "seed": _int(params, "seed", None, 0, 2**63 - 1),
        "stop": stops,
    }


def too_long(model: str, index: int, tokens: int, limit: int) -> RpcError:
    return invalid_params(
        f"input {index} is {tokens} tokens long; model {model} takes at most {limit} "
        "(pass truncate: true to cut it)",
        param="input", index=index, tokens=tokens, max_tokens=limit,
    )


def usage(p: Prepared, completion: int | None = None) -> dict[str, int]:
    prompt = p.real
    out = {"prompt_tokens": prompt, "total_tokens": prompt + (completion or 0)}
    if completion is not None:
        out["completion_tokens"] = completion
    return out


def embeddings_outcome(p: Prepared, vectors: Any) -> Outcome:
    """The outcome for ``vectors`` (a float32 tensor [rows, dim]): the response, and the same
    already as JSON.

    The JSON is built here, in the forward's worker thread, by orjson: each float
    written as the shortest text that reads back as the same float32, about 30x
    faster than ``json`` on the event loop writing 17 digits of a widened double,
    and half the bytes for the client to read. The response's float lists are built
    only when something reads the result (an in-process caller, MCP, a trace): a face
    that sends the JSON never needs them. Without orjson, or when a value is not
    finite, there is no JSON (the face then reports the result as invalid JSON).
    """
    import numpy as np  # with torch, in the worker thread; parsing stays free of both

    rows = vectors.contiguous().numpy()
    base64_format = p.extra.get("encoding_format") == "base64"
    if base64_format:
        data: list[Any] = [base64.b64encode(r.astype("<f4").tobytes()).decode() for r in rows]
    else:
        data = list(rows)
    response: dict[str, Any] = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": p.model,
        "usage": usage(p),
    }
    encoded = None
    if orjson is not None and (base64_format or np.isfinite(rows).all()):
        encoded = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if base64_format:
        return Outcome(result=response, result_json=encoded)

    def with_floats() -> dict[str, Any]:
        return {**response, "data": [{**entry, "embedding": row.tolist()}
                                     for entry, row in zip(response["data"], rows, strict=True)]}

    if encoded is None:
        return Outcome(result=with_floats())
    return Outcome(result_json=encoded, later=with_floats)


def classification_response(p: Prepared, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "classification", "index": i, **r} for i, r in enumerate(rows)],
        "model": p.model,
        "usage": usage(p),
    }


def completion_response(p: Prepared, results: Sequence[Any]) -> dict[str, Any]:
    """``results`` are finished ``GenRequest``s, one per prompt."""
    completion = sum(len(r.tokens) for r in results)
    return {
        "object": "text_completion",
        "model": p.model,
        "choices": [
            {"index": i, "text": r.text, "finish_reason": r.finish_reason, "token_ids": list(r.tokens)}
            for i, r in enumerate(results)
        ],
        "usage": usage(p, completion),
    }
