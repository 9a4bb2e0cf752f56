"""Context parallelism as a dimension of the composed GPT: what `parallelize` does when cp > 1.

    cpm = apply_context_parallel_dim(model, mesh, config)    # after tensor parallelism
    idx_r, tgt_r = context_parallel_batch(idx, targets, mesh.cp, mesh.cp_rank, config.cp_kind)

The cp ranks of one (pp, dp, tp) place hold the same weights and split every sequence
of their dp rank's batch: each holds T / cp of its tokens. Three things change, each
from outside the model:

1. **attention**: every block's attention (Megatron's parallel attention when tp > 1,
   holding n_head / tp heads) becomes `ContextParallelAttention` over the cp group,
   with the same projections (the same Parameter objects, so names and tensor-parallel
   marks stay): ring attention on the zig-zag layout, or Ulysses on the contiguous one;
2. **positions**: the position embedding ``wpe`` is given the positions this rank
   really holds (`sequence_positions`: under the zig-zag split cp rank r holds chunks
   r and 2 cp - 1 - r, not positions 0 .. T/cp - 1 as `GPT.embed` asks for);
3. **data**: `context_parallel_batch` keeps this rank's tokens of each sequence, ids
   and targets alike (the zig-zag chunks for ring, the contiguous part for Ulysses:
   the layout each attention was built for).

The loss: every cp rank holds the same number of tokens, B/dp x T/cp, so the mean of its
tokens' cross-entropies, averaged over the dp x cp ranks (what `train_step` does with
the losses and the gradients, over the ``dp_cp`` group), is the mean over all B x T
tokens of the global batch, exactly as one process computes it. (Targets equal to
-100 are ignored per rank, so with them the ranks' means weigh unequal counts equally,
as data parallelism already does with its dp ranks.)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference.context_parallel import ContextParallelAttention, sequence_positions, split_sequence
from reference.model import GPT

__all__ = ["ContextParallelPositions", "apply_context_parallel_dim", "context_parallel_batch"]


class ContextParallelPositions(nn.Module):
    """The position embedding reading this rank's true positions: local position i -> p_i.

    `GPT.embed` asks for positions 0 .. n - 1 of the n = T / cp tokens it is given; this
    module looks up ``sequence_positions(T, cp, cp_rank)[i]`` instead. It holds the
    model's own ``wpe.weight`` (the same Parameter, still named ``wpe.weight``)."""

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
    """This cp rank's tokens of every sequence: (B, T) -> (B, T / cp), ids and targets.

    Ring: the zig-zag chunks cp_rank and 2 cp - 1 - cp_rank; Ulysses: the contiguous
    part cp_rank. Pure indexing (every rank holds the whole batch)."""
    if cp == 1:
        return idx, targets
    zigzag = kind == "ring"
    return (split_sequence(idx, cp, cp_rank, zigzag, dim=1),
            split_sequence(targets, cp, cp_rank, zigzag, dim=1))
