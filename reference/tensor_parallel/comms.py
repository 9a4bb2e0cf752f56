"""The communication of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al., 2019) writes a tensor-parallel layer as local math
between two conjugate operators:

    f   identity in forward,  all-reduce in backward   (enters a TP region)
    g   all-reduce in forward, identity in backward    (leaves a TP region)

In Y = X A with A split by columns every rank reads the whole X, so dX is the *sum*
of the ranks' contributions (f's backward); in Z = Y B with B split by rows every
rank holds a partial Z that must be *summed* (g's forward), and the sum's gradient
is the same dZ on every rank (g's backward).

Sequence parallelism (Korthikanti et al., 2022) keeps the LayerNorm and dropout
regions as (B, T // tp, C) sequence shards. An all-reduce is a reduce-scatter then
an all-gather, so f and g split in two, and each rank sends the same bytes:

    g -> reduce-scatter in forward, all-gather in backward  (TP region -> sequence shards)
    f -> all-gather in forward, reduce-scatter in backward  (sequence shards -> TP region)

Every collective goes through `reference.comms` (a `comms.meter()` counts it); with a
group of one rank every operator is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import comms
from reference.comms.functional import all_gather_along

__all__ = [
    "SEQ_DIM",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "f", "g",
    "CopyToRegion", "ReduceFromRegion", "AlongDim",
    "gather_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_scatter_along", "split_along",
]

SEQ_DIM = 1  # activations are (B, T, C)


# ---------------------------------------------------------------------------
# The collectives along one dimension, no autograd (the all-gather is `reference.comms.functional`'s)
# ---------------------------------------------------------------------------
def _check_divisible(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"cannot {what} a tensor of shape {tuple(x.shape)} along dim {dim}: its size "
            f"{x.shape[dim]} does not divide by the tensor-parallel size tp={n}"
            + (" (sequence parallelism needs the sequence length to divide by tp)"
               if dim == SEQ_DIM else ""))


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's slice along `dim`: (.., n, ..) -> (.., n // tp, ..)."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "reduce-scatter")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // n,) + x0.shape[1:])
    comms.reduce_scatter_tensor(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice of `x` along `dim` (no communication): (.., n, ..) -> (.., n // tp, ..)."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "split")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    # A fresh buffer: the all-reduce writes in place, and x may be needed by autograd.
    out = x.contiguous().clone()
    comms.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------------------
# Megatron's f and g
# ---------------------------------------------------------------------------
class CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f, where a replicated tensor enters a TP region: (..) -> (..)."""
    return CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g, where partial sums leave a TP region: (..) -> (..) summed."""
    return ReduceFromRegion.apply(x, group)


f = copy_to_tensor_parallel_region
g = reduce_from_tensor_parallel_region


# ---------------------------------------------------------------------------
# Gather, scatter and reduce-scatter along the hidden or the sequence dim, the conjugate in backward
# ---------------------------------------------------------------------------
class AlongDim(torch.autograd.Function):
    """`forward_op(x, dim, group)` in forward, `backward_op(grad, dim, group)` in backward."""

    @staticmethod
    def forward(ctx, x, group, dim, forward_op, backward_op):
        ctx.group, ctx.dim, ctx.backward_op = group, dim, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dim forward, split backward: (.., C // tp) -> (.., C)."""
    return AlongDim.apply(x, group, -1, all_gather_along, split_along)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Split along the last dim forward, all-gather backward: (.., C) -> (.., C // tp)."""
    return AlongDim.apply(x, group, -1, split_along, all_gather_along)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """Enter the sequence-parallel region: (B, T, C) -> (B, T // tp, C), no communication; all-gather backward."""
    return AlongDim.apply(x, group, dim, split_along, all_gather_along)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """f under SP: all-gather forward, (B, T // tp, C) -> (B, T, C); reduce-scatter backward (every
    rank's region used the whole sequence: the gradient of this rank's tokens sums their rows)."""
    return AlongDim.apply(x, group, dim, all_gather_along, reduce_scatter_along)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """g under SP: reduce-scatter forward, (B, T, C) partial sums -> (B, T // tp, C); all-gather backward."""
    return AlongDim.apply(x, group, dim, reduce_scatter_along, all_gather_along)
