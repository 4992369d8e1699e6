"""Sequence classification: labels and scores from a padded batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..tensors import pad


def classify(
    model: torch.nn.Module, rows: Sequence[Sequence[int]], *, pad_id: int, side: str, device: torch.device
) -> torch.Tensor:
    """[rows, labels] scores on the CPU: softmax, or sigmoid for multi-label / single-logit heads."""
    ids, mask = pad(rows, pad_id, side=side, device=device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    multi = getattr(model.config, "problem_type", None) == "multi_label_classification"
    if multi or logits.shape[-1] == 1:
        return torch.sigmoid(logits).cpu()
    return torch.softmax(logits, dim=-1).cpu()


def labelled(
    scores: torch.Tensor, id2label: dict[int, str], top_k: int | None = None
) -> list[dict[str, Any]]:
    """One ``{label, score, scores}`` per row, ``scores`` best first."""
    out = []
    for row in scores.tolist():
        ranked = sorted(range(len(row)), key=lambda i: -row[i])
        if top_k is not None:
            ranked = ranked[:top_k]
        named = [{"label": id2label.get(i, f"LABEL_{i}"), "score": row[i]} for i in ranked]
        out.append({"label": named[0]["label"], "score": named[0]["score"], "scores": named})
    return out
