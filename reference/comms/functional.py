"""Collectives as functions of tensors, shared by several parallelisms.

    y = all_gather_along(x, dim=1, group=tp_group)            # (B, T / n, C) -> (B, T, C)
    rows = all_to_all(x, recv_splits, send_splits, ep_group)  # differentiable, uneven splits

Each returns a new tensor and goes through the metered wrappers of `reference.comms.collectives`.
Tensor and context parallelism gather with `all_gather_along` (`reference.tensor_parallel.comms`,
`reference.context_parallel.layout`); expert parallelism sends tokens to their experts and back
with `all_to_all` (`reference.expert_parallel.moe`), and Ulysses trades a sequence split for a
head split with it (`reference.context_parallel.ulysses`).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from reference.comms.collectives import all_gather_into_tensor, all_to_all_single

__all__ = ["all_gather_along", "all_to_all", "AllToAll"]


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank order: (.., n, ..) -> (.., N * n, ..)
    on a group of N ranks (no autograd: the differentiable operators are built on it)."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0: move `dim` there and back.
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((n * x0.shape[0],) + x0.shape[1:])
    all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


class AllToAll(torch.autograd.Function):
    """Rows (sum(input_splits), C) -> rows (sum(output_splits), C) across the group."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # An all-to-all is a permutation of rows between ranks, so its gradient is the inverse
        # permutation: the same exchange with the splits swapped, every row's gradient going
        # back to where the row came from.
        return AllToAll.apply(grad_out, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group=None) -> torch.Tensor:
    """Differentiable all-to-all with uneven splits: a block of ``input_splits[d]`` consecutive rows
    goes to group rank d, and ``output_splits[s]`` rows come from group rank s, stacked in source
    order. Every rank of `group` calls it, with matching splits."""
    return AllToAll.apply(x, [int(n) for n in output_splits], [int(n) for n in input_splits], group)
