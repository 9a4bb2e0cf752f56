"""The course's attention module with its sequence split over the cp group.

`ContextParallelAttention.from_dense(attn, cp_group, kind="ring" | "ulysses")` replaces a
`reference.model.CausalSelfAttention` in a block whose input is this rank's (B, T/cp, C). The
weights are the dense module's own Parameters (context parallelism replicates every weight);
only the attention between the projections changes:

    x (B, T/cp, C) --c_attn--> q, k, v (B, H, T/cp, D) each
      --ring_attention or ulysses_attention--> (B, H, T/cp, D)
      --c_proj, residual dropout--> (B, T/cp, C)

Under tensor parallelism (`reference.parallel` builds it from Megatron's attention) the same
runs on this rank's n_head / tp heads. Ulysses passes the attention dropout to
scaled_dot_product_attention; ring attention has none and refuses to train with ``dropout > 0``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.context_parallel.ring import ring_attention
from reference.context_parallel.ulysses import check_heads, ulysses_attention
from reference.model import CausalSelfAttention

__all__ = ["ContextParallelAttention", "KINDS"]

KINDS = ("ring", "ulysses")


class ContextParallelAttention(nn.Module):
    """Causal self-attention on this rank's T/cp tokens, attending over all T (ring or Ulysses)."""

    def __init__(self, c_attn: nn.Linear, c_proj: nn.Linear, resid_dropout: nn.Module, head_dim: int,
                 dropout: float, group, kind: str = "ring", zigzag: bool = True):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: context-parallel attention is one of {KINDS}")
        self.c_attn, self.c_proj, self.resid_dropout = c_attn, c_proj, resid_dropout
        self.head_dim, self.dropout = head_dim, dropout
        self.group, self.kind, self.zigzag = group, kind, zigzag
        self.cp = dist.get_world_size(group)
        if kind == "ulysses":  # this rank's heads: all of them, or n_head / tp under TP
            check_heads(c_attn.weight.shape[0] // 3 // head_dim, self.cp)

    @classmethod
    def from_dense(cls, attn: CausalSelfAttention, group, kind: str = "ring",
                   zigzag: bool = True) -> "ContextParallelAttention":
        """The context-parallel version of `attn`, sharing its weights; ``zigzag``: the layout
        (`layout`) of the tokens this rank receives."""
        if not isinstance(attn, CausalSelfAttention):
            raise TypeError(f"from_dense wants a CausalSelfAttention, got {type(attn).__name__}")
        return cls(attn.c_attn, attn.c_proj, attn.resid_dropout, attn.head_dim, attn.dropout,
                   group, kind, zigzag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, n, 3 C), or (B, n, 3 C / tp) under TP
        B, n, _ = qkv.shape  # n = T / cp tokens of this rank (whole even when SP split x over tp)
        q, k, v = qkv.chunk(3, dim=-1)  # each (B, n, C)
        n_head = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, n, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, n, D)
        p = self.dropout if self.training else 0.0
        if self.kind == "ring":
            if p > 0:
                raise ValueError(f"ring attention has no attention dropout: this module has "
                                 f"dropout={self.dropout} and is training; use kind='ulysses', "
                                 f"dropout=0, or eval()")
            y = ring_attention(q, k, v, self.group, causal=True, zigzag=self.zigzag)
        else:
            y = ulysses_attention(q, k, v, self.group, causal=True, zigzag=self.zigzag, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, n, n_head * self.head_dim)  # (B, n, C)
        return self.resid_dropout(self.c_proj(y))  # (B, n, C)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, cp={self.cp}, zigzag={self.zigzag}"
