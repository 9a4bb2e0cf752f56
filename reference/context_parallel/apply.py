"""Context parallelism as a dimension of the composed GPT: what `reference.parallel.parallelize`
does when cp > 1, as `reference.tensor_parallel.apply_tensor_parallel` does for tp.

    cpm = apply_context_parallel_dim(model, mesh, config)    # after tensor parallelism
    idx_r, tgt_r = context_parallel_batch(idx, targets, mesh.cp, mesh.cp_rank, config.cp_kind)

The cp ranks of one (pp, dp, tp) place hold the same weights and split every sequence of their
dp rank's batch, T / cp tokens each. Three things change, each from outside the model:

1. **attention**: every block's attention (Megatron's when tp > 1) becomes
   `ContextParallelAttention` over the cp group with the same projections (the same
   Parameters, so names and tensor-parallel marks stay): ring attention on the zig-zag
   layout, or Ulysses on the contiguous one;
2. **positions**: ``wpe`` looks up the positions this rank really holds (`sequence_positions`);
3. **data**: `context_parallel_batch` keeps this rank's tokens of each sequence, in the
   layout its attention was built for.

Every cp rank holds B/dp x T/cp tokens, so averaging the ranks' mean losses and gradients over
dp x cp (what `train_step` does) gives one process's mean over the global batch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference.context_parallel.attention import ContextParallelAttention
from reference.context_parallel.layout import sequence_positions, split_sequence
from reference.model import GPT

__all__ = ["ContextParallelPositions", "apply_context_parallel_dim", "context_parallel_batch"]


class ContextParallelPositions(nn.Module):
    """The position embedding reading this rank's true positions: `GPT.embed` asks for 0 .. n - 1
    of its n = T / cp tokens, this looks up ``sequence_positions(T, cp, cp_rank)`` instead. It
    holds the model's own ``wpe.weight`` (the same Parameter, under the same name)."""

    def __init__(self, wpe: nn.Embedding, cp: int, cp_rank: int, zigzag: bool):
        super().__init__()
        self.weight = wpe.weight  # (block_size, C), replicated like every weight under cp
        self.cp, self.cp_rank, self.zigzag = cp, cp_rank, zigzag

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        n = pos.shape[0]  # this rank's T / cp tokens, asked for as positions 0 .. n - 1
        true = sequence_positions(n * self.cp, self.cp, self.cp_rank, self.zigzag).to(pos.device)
        return F.embedding(true[pos], self.weight)  # (n, C)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, cp_rank={self.cp_rank}, zigzag={self.zigzag}"


def apply_context_parallel_dim(model: GPT, mesh, config) -> GPT:
    """Swap every block's attention for ring or Ulysses attention over ``mesh.group("cp")``
    and ``wpe`` for this rank's positions, in place (after tensor parallelism). Identity
    when ``config.cp == 1``."""
    if config.cp == 1:
        return model
    group, zigzag = mesh.group("cp"), config.cp_kind == "ring"
    for block in model.h:
        a = block.attn  # CausalSelfAttention, or ParallelCausalSelfAttention under TP
        block.attn = ContextParallelAttention(a.c_attn, a.c_proj, a.resid_dropout, a.head_dim,
                                              a.dropout, group, config.cp_kind, zigzag)
    model.wpe = ContextParallelPositions(model.wpe, mesh.cp, mesh.cp_rank, zigzag)
    return model


def context_parallel_batch(idx: torch.Tensor, targets: torch.Tensor, cp: int, cp_rank: int,
                           kind: str = "ring"):
    """This cp rank's tokens of every sequence, (B, T) -> (B, T / cp), ids and targets: the zig-zag
    chunks cp_rank and 2 cp - 1 - cp_rank (ring), or the contiguous part cp_rank (Ulysses)."""
    if cp == 1:
        return idx, targets
    zigzag = kind == "ring"
    return (split_sequence(idx, cp, cp_rank, zigzag, dim=1),
            split_sequence(targets, cp, cp_rank, zigzag, dim=1))
