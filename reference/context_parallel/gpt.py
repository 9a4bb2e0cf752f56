"""A whole GPT with its sequence split over the cp group.

    cpm = ContextParallelGPT(GPT(config), cp_group, kind="ring")      # the same weights on every rank
    idx_r, tgt_r = (split_sequence(t, cp, cp_rank) for t in (idx, targets))
    logits_r, loss_share = cpm(idx_r, tgt_r)     # (B, T/cp, V), this rank's share of the loss
    loss_share.backward()
    allreduce_context_parallel_grads(cpm, cp_group)  # the single-process gradients

Three things change against the plain GPT, applied from outside (`reference.model` knows nothing of them):

1. every block's attention becomes `ContextParallelAttention` (ring or Ulysses), the only
   place where tokens of different ranks meet;
2. the position embedding reads the positions this rank holds (`sequence_positions`: under
   the zig-zag split not 0 .. T/cp - 1, as `GPT.embed` would assume);
3. a rank's loss share is the *sum* of its tokens' cross-entropies divided by B * T: the shares
   add up to the single-process token mean, and their gradients, summed over the cp group
   (`allreduce_context_parallel_grads`), to its gradients, as in data parallelism (Megatron-LM
   all-reduces the weight gradients over the dp x cp ranks at once).

A mixture-of-experts aux loss, computed on this rank's tokens, is added divided by cp: an
approximation of the full sequence's (exact for the dense MLP, whose aux loss is zero).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference import comms
from reference.context_parallel.attention import ContextParallelAttention
from reference.context_parallel.layout import sequence_positions
from reference.model import GPT

__all__ = ["ContextParallelGPT", "apply_context_parallel", "allreduce_context_parallel_grads"]


def apply_context_parallel(model: GPT, group, kind: str = "ring", zigzag: bool = True) -> GPT:
    """Swap every block's attention for its context-parallel version, in place; returns `model`."""
    for block in model.h:
        if not isinstance(block.attn, ContextParallelAttention):
            block.attn = ContextParallelAttention.from_dense(block.attn, group, kind, zigzag)
    return model


class ContextParallelGPT(nn.Module):
    """`model` run on this rank's part of the sequence: (B, T/cp) ids -> (B, T/cp, V) logits, loss share."""

    def __init__(self, model: GPT, group, kind: str = "ring", zigzag: bool = True):
        super().__init__()
        self.model = apply_context_parallel(model, group, kind, zigzag)
        self.group, self.zigzag = group, zigzag
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)

    def positions(self, n: int, device=None) -> torch.Tensor:
        """(n,) positions of this rank's n = T/cp tokens in the whole sequence."""
        T = n * self.cp
        block_size = self.model.config.block_size
        if T > block_size:
            raise ValueError(f"sequence length T={T} (T/cp={n} on each of cp={self.cp} ranks) is "
                             f"longer than block_size={block_size}")
        return sequence_positions(T, self.cp, self.cp_rank, self.zigzag).to(device)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's token ids (B, T/cp) -> the residual stream (B, T/cp, C), true positions embedded."""
        m = self.model
        pos = self.positions(idx.size(1), idx.device)  # (T/cp,)
        return m.drop(m.wte(idx) + m.wpe(pos))  # (B, T/cp, C)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """(logits (B, T/cp, V), loss share or None): the shares of the cp ranks sum to the GPT's loss."""
        x = self.embed(idx)
        aux = x.new_zeros(())
        for block in self.model.h:
            x, block_aux = block(x)  # (B, T/cp, C)
            aux = aux + block_aux
        logits = self.model.head(x)  # (B, T/cp, V)
        if targets is None:
            return logits, None
        B, n = targets.shape
        lm = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
        return logits, lm / (B * n * self.cp) + aux / self.cp


@torch.no_grad()
def allreduce_context_parallel_grads(module: nn.Module, group) -> None:
    """Sum every parameter's gradient over the cp group (one metered all-reduce per parameter)."""
    if dist.get_world_size(group) == 1:
        return
    for p in module.parameters():  # a tied weight comes once
        if p.grad is not None:
            comms.all_reduce(p.grad, group=group)
