"""Dynamic padding: each batch is padded to its own longest row, never to the model's limit."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad(
    rows: Sequence[Sequence[int]], pad_id: int, *, side: str = "right", device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [rows, longest]; padding on ``side``."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row)
        if side == "left":
            ids[i, longest - n:] = torch.tensor(row, dtype=torch.long)
            mask[i, longest - n:] = 1
        else:
            ids[i, :n] = torch.tensor(row, dtype=torch.long)
            mask[i, :n] = 1
    if device is not None and device.type != "cpu":
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
    return ids, mask


def padded_cost(rows: Sequence[Sequence[int]]) -> int:
    return len(rows) * max((len(r) for r in rows), default=0)
