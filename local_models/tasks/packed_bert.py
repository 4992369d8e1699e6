"""An unpadded forward for BERT-family encoders: linear layers see only real tokens.

A padded batch spends its linear layers (most of the work) on padding too; here
the rows are packed into one ``[tokens, hidden]`` matrix for every projection,
layer norm and feed-forward, and only attention is laid out ``[rows, longest]``
with a mask. Query, key and value share one fused projection. The weights are
the model's own; only the order of work changes, so the results match the
padded forward to float rounding (tests check 1e-5). Models it does not
recognise (``packable`` is False) take the ordinary padded path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out: torch.nn.Linear
    ln1: torch.nn.LayerNorm
    up: torch.nn.Linear
    down: torch.nn.Linear
    ln2: torch.nn.LayerNorm


class PackedBert:
    """Holds fused views of a ``BertModel``'s weights; ``__call__`` is the packed forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        emb = model.embeddings
        self.word = emb.word_embeddings.weight
        self.pos = emb.position_embeddings.weight
        self.type0 = emb.token_type_embeddings.weight[0]
        self.ln0 = emb.LayerNorm
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.layers = []
        for layer in model.encoder.layer:
            att = layer.attention
            s = att.self
            with torch.no_grad():
                qkv_w = torch.cat([s.query.weight, s.key.weight, s.value.weight]).contiguous()
                qkv_b = torch.cat([s.query.bias, s.key.bias, s.value.bias]).contiguous()
            self.layers.append(_Layer(qkv_w, qkv_b, att.output.dense, att.output.LayerNorm,
                                      layer.intermediate.dense, layer.output.dense, layer.output.LayerNorm))

    def __call__(
        self, rows: Sequence[Sequence[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [rows, longest, dim] zero at padding, mask [rows, longest]) like a padded forward."""
        lengths = [len(r) for r in rows]
        n, longest = len(rows), max(lengths)
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)
        lens = torch.tensor(lengths, dtype=torch.long, device=device)
        mask = torch.arange(longest, device=device).unsqueeze(0) < lens.unsqueeze(1)  # [n, longest]
        where = mask.reshape(-1).nonzero().squeeze(1)  # packed token -> slot in the padded layout
        positions = where % longest
        x = self.word.index_select(0, ids) + self.pos.index_select(0, positions) + self.type0
        x = self.ln0(x)
        uniform = min(lengths) == longest
        attn_mask = None if uniform else mask.view(n, 1, 1, longest)
        h, d = self.heads, self.head_dim
        for layer in self.layers:
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)  # [tokens, 3 * dim]
            if uniform:
                grid = qkv.view(n, longest, 3, h, d)
            else:
                grid = qkv.new_zeros(n * longest, qkv.shape[1])
                grid.index_copy_(0, where, qkv)
                grid = grid.view(n, longest, 3, h, d)
            q, k, v = (grid[:, :, i].transpose(1, 2) for i in range(3))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [n, h, longest, d]
            a = a.transpose(1, 2).reshape(n * longest, h * d)
            if not uniform:
                a = a.index_select(0, where)
            x = layer.ln1(layer.out(a) + x)
            y = layer.up(x)
            x = layer.ln2(layer.down(F.gelu(y)) + x)
        hidden = x.new_zeros(n * longest, x.shape[1])
        hidden.index_copy_(0, where, x)
        return hidden.view(n, longest, -1), mask.to(torch.long)


def packable(model: torch.nn.Module) -> bool:
    """A plain ``BertModel`` in eval mode with absolute positions and exact (erf) gelu."""
    cfg = getattr(model, "config", None)
    return (
        type(model).__name__ == "BertModel"
        and getattr(cfg, "model_type", None) == "bert"
        and getattr(cfg, "position_embedding_type", "absolute") == "absolute"
        and getattr(cfg, "hidden_act", None) == "gelu"
        and not getattr(cfg, "is_decoder", False)
        and not model.training
    )
