"""Sentence embeddings, pooled and normalised as the model's sentence-transformers config says.

``modules.json`` lists the pipeline (Transformer -> Pooling -> Normalize); the
Pooling module's ``config.json`` names the modes, ``sentence_bert_config.json``
the input limit and lowercasing. A plain transformers directory falls back to
mean pooling without normalisation unless the model spec says otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..tensors import pad
from .packed_bert import PackedEncoder

# Concatenation order of sentence-transformers' legacy boolean keys.
_LEGACY = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
MODES = frozenset(_LEGACY.values())


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EmbedConfig:
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_length: int | None = None
    lowercase: bool = False


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def read_embed_config(
    path: Path, *, pooling: str | Sequence[str] | None = None, normalize: bool | None = None
) -> EmbedConfig:
    """The pipeline sentence-transformers would run for this directory; explicit overrides win."""
    modes: tuple[str, ...] = ("mean",)
    norm, max_length, lowercase = False, None, False
    modules_file = path / "modules.json"
    if modules_file.is_file():
        for module in _json(modules_file):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            where = path / module.get("path", "")
            if kind == "Transformer":
                bert = where / "sentence_bert_config.json"
                if bert.is_file():
                    cfg = _json(bert)
                    max_length = cfg.get("max_seq_length")
                    lowercase = bool(cfg.get("do_lower_case", False))
            elif kind == "Pooling":
                modes = _pooling_modes(_json(where / "config.json"))
            elif kind == "Normalize":
                norm = True
            else:
                raise UnsupportedModel(f"sentence-transformers module {kind!r} is not supported")
    if pooling is not None:
        modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    if normalize is not None:
        norm = normalize
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UnsupportedModel(f"unknown pooling mode(s) {bad}")
    return EmbedConfig(modes, norm, max_length, lowercase)


def _pooling_modes(cfg: dict[str, Any]) -> tuple[str, ...]:
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        return (mode,) if isinstance(mode, str) else tuple(mode)
    modes = tuple(mode for key, mode in _LEGACY.items() if cfg.get(key))
    if cfg.get("include_prompt") is False:
        raise UnsupportedModel("pooling that excludes the prompt is not supported")
    return modes or ("mean",)


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """sentence-transformers' padded pooling, mode for mode, concatenated."""
    acc = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    out: list[torch.Tensor] = []
    fmask = mask.unsqueeze(-1).to(hidden.dtype)
    for mode in modes:
        if mode == "cls":
            first = mask.to(torch.int).argmax(dim=1)
            out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
        elif mode == "max":
            out.append(hidden.masked_fill(fmask == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (hidden * fmask).sum(dim=1, dtype=acc)
            count = torch.clamp(fmask.sum(dim=1, dtype=acc), min=1e-9)
            denom = count if mode == "mean" else torch.sqrt(count)
            out.append((total / denom).to(hidden.dtype))
        elif mode == "weightedmean":
            weights = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=acc).view(1, -1, 1)
            weights = weights - mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1)
            wmask = mask.unsqueeze(-1).to(acc) * weights
            summed = (hidden * wmask).sum(dim=1)
            out.append((summed / torch.clamp(wmask.sum(dim=1), min=1e-9)).to(hidden.dtype))
        elif mode == "lasttoken":
            seq_len = hidden.shape[1]
            values, idx = mask.flip(1).max(1)
            idx = torch.where(values == 0, seq_len - 1, idx)
            last = seq_len - idx - 1
            out.append((hidden * fmask)[torch.arange(hidden.shape[0], device=hidden.device), last])
    return torch.cat(out, dim=-1)


def embed(
    model: torch.nn.Module, rows: Sequence[Sequence[int]], cfg: EmbedConfig, *,
    pad_id: int, side: str, device: torch.device, packed: PackedEncoder | None = None,
) -> torch.Tensor:
    """[rows, dim] float32 on the CPU; call under ``torch.inference_mode``.

    With ``packed`` (a BERT encoder) the linear layers skip the padding.
    """
    if packed is not None:
        hidden, mask = packed(rows, device)
    else:
        ids, mask = pad(rows, pad_id, side=side, device=device)
        out = model(input_ids=ids, attention_mask=mask)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    vectors = pool(hidden, mask, cfg.pooling)
    if cfg.normalize:
        vectors = F.normalize(vectors, p=2, dim=1)
    return vectors.float().cpu()
