"""A running generation batch as plain tensors, so rows can join and leave between steps.

The KV cache is kept per layer as ``[rows, heads, time, dim]`` tensors, left
padded: a row that joins is padded on the left to the batch's length (or the
batch to its), a row that leaves is dropped, and time columns that have become
padding for every remaining row are trimmed. The model sees a fresh
``DynamicCache`` built from these tensors at each step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class UnsupportedCache(ValueError):
    pass


@dataclass(slots=True)
class Batch:
    pairs: Pairs  # per layer (keys, values), [rows, heads, time, dim]
    mask: torch.Tensor  # [rows, time], 1 for real tokens
    next_ids: torch.Tensor  # [rows], the last sampled token, not yet fed

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; take whichever this model has."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def to_cache(pairs: Pairs) -> Any:  # a transformers DynamicCache
    from transformers.cache_utils import DynamicCache

    return DynamicCache(ddp_cache_data=pairs)


def from_output(out: Any) -> Pairs:  # out: a transformers ModelOutput
    from transformers.cache_utils import DynamicLayer

    cache = out["cache"] if "cache" in out else out["past_key_values"]
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UnsupportedCache("this transformers version exposes no per-layer cache")
    pairs: Pairs = []
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise UnsupportedCache(
                f"continuous batching needs full-attention caches, got {type(layer).__name__}"
            )
        assert layer.keys is not None and layer.values is not None  # a forward fills every layer
        pairs.append((layer.keys, layer.values))
    return pairs


def _left_pad_time(t: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [extra, 0]
    return F.pad(t, pad)


def merge(a: Batch | None, b: Batch) -> Batch:
    """Rows of ``a`` then rows of ``b``, left padded to a common length."""
    if a is None:
        return b
    length = max(a.length, b.length)
    da, db = length - a.length, length - b.length
    pairs = [
        (torch.cat([_left_pad_time(ka, da, 2), _left_pad_time(kb, db, 2)]),
         torch.cat([_left_pad_time(va, da, 2), _left_pad_time(vb, db, 2)]))
        for (ka, va), (kb, vb) in zip(a.pairs, b.pairs, strict=True)
    ]
    mask = torch.cat([_left_pad_time(a.mask, da, 1), _left_pad_time(b.mask, db, 1)])
    return Batch(pairs, mask, torch.cat([a.next_ids, b.next_ids]))


def select(batch: Batch, keep: Sequence[int]) -> Batch | None:
    """Only the ``keep`` rows, with the columns that became all-padding trimmed."""
    if not keep:
        return None
    if len(keep) == batch.rows:
        return batch
    idx = torch.tensor(list(keep), dtype=torch.long, device=batch.mask.device)
    mask = batch.mask.index_select(0, idx)
    start = int((mask.sum(0) > 0).to(torch.int).argmax())
    pairs = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
             for k, v in batch.pairs]
    return Batch(pairs, mask[:, start:], batch.next_ids.index_select(0, idx))
