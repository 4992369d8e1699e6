"""Packing many embedding calls into few requests, and giving each caller its own answer back.

Pure functions (no I/O) so the bookkeeping that decides who gets which vector is
tested on its own: a caller's inputs may be split over several upstream requests
and a request may hold many callers, yet each caller sees an ordinary embeddings
object with indices from 0 and its share of the usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from multiplexer.core.errors import RpcError, invalid_params
from multiplexer.core.jsonrpc import is_token_array


def text_tokens(text: str) -> int:
    """A cheap estimate (about four characters a token); usage corrects it afterwards."""
    return max(1, (len(text) + 3) // 4)


def embedding_inputs(params: Any) -> list[Any]:
    """The inputs of one embeddings call: strings, or token arrays (lists of ints)."""
    if not isinstance(params, dict):
        raise invalid_params("embeddings params must be an object")
    raw = params.get("input")
    if isinstance(raw, str) or is_token_array(raw):
        inputs = [raw]
    elif isinstance(raw, list) and raw:
        inputs = raw
    else:
        raise invalid_params("'input' must be a non-empty string or array", param="input")
    for i, value in enumerate(inputs):
        if isinstance(value, str):
            if not value:
                raise invalid_params(f"input[{i}] is an empty string", param="input")
        elif not is_token_array(value):
            raise invalid_params(f"input[{i}] must be a string or an array of token ids",
                                 param="input")
    return inputs


def input_tokens(value: Any) -> int:
    return text_tokens(value) if isinstance(value, str) else len(value)


@dataclass(slots=True)
class Span:
    """``count`` consecutive inputs of caller ``item``, starting at its input ``start``."""

    item: int
    start: int
    count: int
    tokens: int


@dataclass(slots=True)
class Chunk:
    """One upstream request: the inputs, and whose they are."""

    spans: list[Span] = field(default_factory=list)
    inputs: list[Any] = field(default_factory=list)
    tokens: int = 0


def pack(per_item: Sequence[Sequence[Any]], max_inputs: int, max_tokens: int | None) -> list[Chunk]:
    """Fill requests in order, each bounded by ``max_inputs`` and (when set) ``max_tokens``."""
    chunks: list[Chunk] = []
    cur = Chunk()
    for i, inputs in enumerate(per_item):
        for j, value in enumerate(inputs):
            cost = input_tokens(value)
            if cur.inputs and (len(cur.inputs) >= max_inputs
                               or (max_tokens is not None and cur.tokens + cost > max_tokens)):
                chunks.append(cur)
                cur = Chunk()
            if cur.spans and cur.spans[-1].item == i:
                cur.spans[-1].count += 1
                cur.spans[-1].tokens += cost
            else:
                cur.spans.append(Span(i, j, 1, cost))
            cur.inputs.append(value)
            cur.tokens += cost
    if cur.inputs:
        chunks.append(cur)
    return chunks


def split_usage(total: int, weights: Sequence[int]) -> list[int]:
    """Integer shares of ``total`` proportional to ``weights`` that sum exactly to ``total``."""
    if not weights:
        return []
    wsum = sum(weights)
    if wsum <= 0:
        weights, wsum = [1] * len(weights), len(weights)
    raw = [total * w / wsum for w in weights]
    shares = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda k: raw[k] - shares[k], reverse=True)
    for k in order[: total - sum(shares)]:
        shares[k] += 1
    return shares


def ordered_data(body: Any, expected: int) -> list[dict[str, Any]] | None:
    """The response's embeddings sorted by index; None unless they are exactly 0..expected-1."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != expected:
        return None
    if not all(isinstance(d, dict) and isinstance(d.get("index"), int) for d in data):
        return None
    data = sorted(data, key=lambda d: d["index"])
    if [d["index"] for d in data] != list(range(expected)):
        return None
    return data


class Scatter:
    """Collects chunk responses and builds one embeddings object per caller."""

    def __init__(self, per_item: Sequence[Sequence[Any]]) -> None:
        self.vectors: list[list[dict[str, Any] | None]] = [[None] * len(x) for x in per_item]
        self.prompt_tokens = [0] * len(per_item)
        self.has_usage = [True] * len(per_item)
        self.errors: list[RpcError | None] = [None] * len(per_item)
        self.model: list[Any] = [None] * len(per_item)

    def add(self, chunk: Chunk, body: dict[str, Any], data: list[dict[str, Any]]) -> None:
        usage = body.get("usage")
        total = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        shares = (split_usage(total, [s.tokens for s in chunk.spans])
                  if isinstance(total, int) and total >= 0 else None)
        pos = 0
        for k, span in enumerate(chunk.spans):
            for n in range(span.count):
                self.vectors[span.item][span.start + n] = data[pos]
                pos += 1
            self.model[span.item] = body.get("model")
            if shares is None:
                self.has_usage[span.item] = False
            else:
                self.prompt_tokens[span.item] += shares[k]

    def fail(self, chunk: Chunk, error: RpcError) -> None:
        for span in chunk.spans:
            if self.errors[span.item] is None:
                self.errors[span.item] = error

    def result(self, i: int) -> dict[str, Any] | RpcError:
        if self.errors[i] is not None:
            return self.errors[i]  # type: ignore[return-value]
        data = []
        for k, entry in enumerate(self.vectors[i]):
            assert entry is not None
            data.append({**entry, "index": k})
        out: dict[str, Any] = {"object": "list", "data": data, "model": self.model[i]}
        if self.has_usage[i]:
            tokens = self.prompt_tokens[i]
            out["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
        return out


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string or a list of typed parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content
                        if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _budget(value: Any) -> int:
    """An output budget as the caller gave it: a plain integer, else nothing to add."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _strings(raw: Any) -> list[Any]:
    """A field that takes one value or a list of them, as a list."""
    return [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []


def completion_tokens(params: dict[str, Any]) -> int:
    """A legacy completion's estimate: its prompt (or prompts) plus the output budget (per prompt)."""
    prompts = [p for p in _strings(params.get("prompt")) if isinstance(p, str)]
    budget = _budget(params.get("max_tokens") or 16)  # the API's own default
    return sum(text_tokens(p) for p in prompts) + budget * max(len(prompts), 1)


def responses_tokens(params: dict[str, Any]) -> int:
    """A Responses API call's estimate: its input (a string or items) and instructions, plus the
    output budget."""
    prompt = 0
    for item in _strings(params.get("input")):
        if isinstance(item, str):
            prompt += text_tokens(item)
        elif isinstance(item, dict):
            prompt += text_tokens(content_text(item.get("content"))) + 4
    if isinstance(params.get("instructions"), str):
        prompt += text_tokens(params["instructions"])
    return prompt + _budget(params.get("max_output_tokens"))


def chat_tokens(params: dict[str, Any]) -> int:
    """Prompt estimate plus the completion budget, which is what providers count against limits."""
    messages = params.get("messages") or []
    prompt = sum(text_tokens(content_text(m.get("content"))) + 4
                 for m in messages if isinstance(m, dict))
    prompt += text_tokens(content_text(params.get("system"))) if params.get("system") else 0
    return prompt + _budget(params.get("max_completion_tokens") or params.get("max_tokens"))
