"""Many embedding calls as few ``batchEmbedContents`` requests, each caller given its own answer.

A call is an ``embedContent`` body (one input, answered ``{"embedding": ...}``) or a
``batchEmbedContents`` body (its ``requests``, answered ``{"embeddings": [...]}``); the lane's
batch of them is packed by ``packing.pack`` into requests of at most ``max_inputs`` inputs, and a
request refused as a whole is sent again per caller so the error finds its owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import Code, RpcError, invalid_params, upstream_error

from .api_client import ApiClient
from .http_util import batch_deadline
from .packing import Chunk, pack


def model_path(model: str) -> str:
    """``gemini-2.5-flash`` or ``models/gemini-2.5-flash`` (or a tuned model's full name)."""
    return model if "/" in model else f"models/{model}"


def embed_requests(params: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """A call's embedding requests: an ``embedContent`` body is one, a ``batchEmbedContents`` body
    its ``requests``; each names the model, as batchEmbedContents wants."""
    if isinstance(params.get("requests"), list):
        requests = params["requests"]
    elif isinstance(params.get("content"), dict):
        requests = [{k: v for k, v in params.items() if k != "model"}]
    else:
        raise invalid_params("embeddings params are an embedContent body ('content') or a "
                             "batchEmbedContents body ('requests')", param="content")
    if not requests or not all(isinstance(r, dict) and isinstance(r.get("content"), dict) for r in requests):
        raise invalid_params("'requests' must be a non-empty array of objects with 'content'",
                             param="requests")
    return [{**r, "model": model_path(model)} for r in requests]


class Vectors:
    """Collects chunk responses and builds each caller's answer in its own body's shape."""

    def __init__(self, per_item: Sequence[Sequence[Any]], single: Sequence[bool]) -> None:
        self.vectors: list[list[Any]] = [[None] * len(x) for x in per_item]
        self.errors: list[RpcError | None] = [None] * len(per_item)
        self.single = single

    def add(self, chunk: Chunk, embeddings: list[Any]) -> None:
        pos = 0
        for span in chunk.spans:
            for n in range(span.count):
                self.vectors[span.item][span.start + n] = embeddings[pos]
                pos += 1

    def fail(self, chunk: Chunk, error: RpcError) -> None:
        for span in chunk.spans:
            if self.errors[span.item] is None:
                self.errors[span.item] = error

    def outcome(self, i: int) -> Outcome:
        if self.errors[i] is not None:
            return Outcome.fail(self.errors[i])  # type: ignore[arg-type]
        if self.single[i]:
            return Outcome(result={"embedding": self.vectors[i][0]})
        return Outcome(result={"embeddings": self.vectors[i]})


async def run_embeddings(api: ApiClient, version: str, max_inputs: int,
                         items: Sequence[Item]) -> list[Outcome]:
    """One lane batch of embedding calls (one model: the lane groups them by it)."""
    per_item: list[list[Any]] = []
    bad: dict[int, RpcError] = {}
    for i, item in enumerate(items):
        try:
            per_item.append(embed_requests(item.params, item.params["model"]))
        except RpcError as e:
            per_item.append([])
            bad[i] = e
    single = [not isinstance(item.params.get("requests"), list) for item in items]
    model = items[0].params["model"]
    path = f"{version}/{model_path(model)}:batchEmbedContents"
    vectors = Vectors(per_item, single)

    async def send(chunk: Chunk, owners: Sequence[Item], split_on_400: bool) -> None:
        try:
            body = await api.json("POST", path, json={"requests": chunk.inputs}, idempotent=True,
                                           deadline=batch_deadline(owners))
        except RpcError as e:
            if split_on_400 and e.code == Code.UPSTREAM_ERROR and (e.data or {}).get(
                    "upstream_status") in (400, 413, 422):
                pos = 0
                for span, owner in zip(chunk.spans, owners, strict=True):
                    alone = Chunk([span], chunk.inputs[pos:pos + span.count], span.tokens)
                    pos += span.count
                    await send(alone, [owner], False)
            else:
                vectors.fail(chunk, e)
            return
        embeddings = body.get("embeddings")
        if not isinstance(embeddings, list) or len(embeddings) != len(chunk.inputs):
            vectors.fail(chunk, upstream_error(api.name, "malformed batchEmbedContents response: "
                                               f"expected {len(chunk.inputs)} embeddings"))
            return
        vectors.add(chunk, embeddings)

    async with anyio.create_task_group() as tg:
        for chunk in pack(per_item, max_inputs, None):
            owners = [items[s.item] for s in chunk.spans]
            tg.start_soon(send, chunk, owners, len(chunk.spans) > 1)
    return [Outcome.fail(bad[i]) if i in bad else vectors.outcome(i) for i in range(len(items))]
