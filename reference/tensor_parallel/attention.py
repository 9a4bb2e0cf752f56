"""Megatron's parallel self-attention: the heads split across the TP group."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.model import CausalSelfAttention, causal_attention
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.rng import ShardedDropout, TensorParallelRNG

__all__ = ["ParallelCausalSelfAttention"]


class ParallelCausalSelfAttention(nn.Module):
    """Megatron's parallel attention: each rank holds ``n_head // tp`` whole heads.

    A column-parallel / row-parallel pair like the MLP, heads as the unit of the split: c_attn
    splits q, k and v each by heads (``chunks=3``), so this rank's (B, T, 3 C // tp) output holds
    its heads' [q_r | k_r | v_r]; the heads attend independently (`causal_attention`); c_proj sums
    their contributions (g). The attention-probability dropout acts on this rank's heads (the TP
    stream, `rng.fork()`); the residual dropout acts on a replicated tensor (the default stream)
    or, under SP, on a sequence shard (its own mask, `ShardedDropout`).
    """

    def __init__(self, c_attn: ColumnParallelLinear, c_proj: RowParallelLinear, head_dim: int,
                 dropout: float, resid_dropout: nn.Module, rng: TensorParallelRNG | None):
        super().__init__()
        self.c_attn, self.c_proj, self.resid_dropout = c_attn, c_proj, resid_dropout
        self.head_dim, self.dropout, self.rng = head_dim, dropout, rng

    @classmethod
    def from_dense(cls, attn: CausalSelfAttention, group, *, sequence_parallel: bool = False,
                   regather_input: bool = False, rng: TensorParallelRNG | None = None
                   ) -> "ParallelCausalSelfAttention":
        """This rank's heads of `attn`, copied, so the TP module computes the same function."""
        tp = dist.get_world_size(group)
        n_head = attn.c_attn.out_features // 3 // attn.head_dim
        if n_head % tp:
            raise ValueError(f"ParallelCausalSelfAttention: n_head={n_head} must divide by tp={tp} "
                             f"(each rank holds whole heads)")
        p_resid = attn.resid_dropout.p
        if rng is None and (attn.dropout > 0 or (sequence_parallel and p_resid > 0)):
            raise ValueError("attention with dropout under tensor parallelism needs rng="
                             "TensorParallelRNG(...): sharded tensors must draw their own masks")
        c_attn = ColumnParallelLinear.from_dense(
            attn.c_attn, group, sequence_parallel=sequence_parallel,
            regather_input=regather_input, chunks=3)  # (.., C) -> (.., 3 C // tp)
        c_proj = RowParallelLinear.from_dense(
            attn.c_proj, group, input_is_parallel=True, sequence_parallel=sequence_parallel)
        resid_dropout = ShardedDropout(p_resid, rng) if sequence_parallel and rng is not None \
            else nn.Dropout(p_resid)
        return cls(c_attn, c_proj, attn.head_dim, attn.dropout, resid_dropout, rng)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 C // tp), T whole even when x is a sequence shard
        fork = self.rng.fork() if self.rng is not None else contextlib.nullcontext()
        with fork:  # dropout on this rank's n_head // tp heads: its own random stream
            y = causal_attention(qkv, self.head_dim, self.dropout if self.training else 0.0)  # (B, T, C // tp)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C), or (B, T // tp, C) under SP
