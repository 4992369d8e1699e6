"""Next-token choice per row: greedy, or temperature + nucleus sampling from the row's own generator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Sampled(Protocol):
    temperature: float
    top_p: float
    generator: torch.Generator | None


def next_tokens(logits: torch.Tensor, rows: Sequence[Sampled]) -> list[int]:
    """``logits`` is [rows, vocab]; each row keeps its own seed, so batching never changes its draw."""
    out = logits.float().argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if row.temperature > 0:
            out[i] = sample(logits[i], row.temperature, row.top_p, row.generator)
    return out


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p  # the smallest prefix reaching top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
