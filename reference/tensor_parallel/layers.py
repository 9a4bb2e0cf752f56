"""Megatron's tensor-parallel linear layers.

A linear layer computes Y = X A (nn.Linear stores weight = A^T, shape (out, in)). Split A
over the tp ranks of a group in one of two ways:

* **by columns** (`ColumnParallelLinear`): rank r holds columns [r out/tp, (r+1) out/tp) of A
  (those rows of ``weight``), reads the whole X and computes its slice Y_r = X A_r. No
  communication forward; f (all-reduce backward) sums the ranks' parts of dX.
* **by rows** (`RowParallelLinear`): rank r holds rows [r in/tp, ...) of A (those columns of
  ``weight``), reads its slice X_r and computes a partial sum X_r A_r; g (all-reduce forward)
  adds them, then the replicated bias is added once.

Column then row is Megatron's MLP, Z = GeLU(X A) B (the GeLU acts on each rank's own
columns): one all-reduce forward (g), one backward (f). With ``sequence_parallel=True`` a
column layer's input and a row layer's output are sequence shards (B, T // tp, C) and f and g
split in two (`comms`); a row layer's bias then meets only this rank's tokens and is marked
``sequence_parallel``, its gradient summed over the TP group after backward.
``regather_input=True`` (Megatron's memory-saving form) keeps only the shard of a column
layer's input for backward and all-gathers it again there.

A layer built directly (not ``from_dense``) follows Megatron's master-weight init: every rank
draws the *whole* dense weight on a CPU generator seeded with the layer's ``seed`` (the default
stream untouched) and keeps its slice, so the TP layer equals the ``nn.Linear`` built after
``torch.manual_seed(seed)``, for any tp. ``seed`` must be the same on every rank of the group;
give each layer of a model its own. ``perform_initialization=False`` (Megatron's name, default
True) skips that draw and leaves the shard empty: ``from_dense`` copies its slice of the dense
layer in, without drawing a master weight it would throw away.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference.comms.functional import all_gather_along
from reference.tensor_parallel.comms import (
    SEQ_DIM,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_along,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from reference.tensor_parallel.cut import record_cut

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_shard", "row_shard", "linear_init_",
           "check_init_seed"]


# ---------------------------------------------------------------------------
# Which slice of a dense weight each rank holds
# ---------------------------------------------------------------------------
def column_shard(t: torch.Tensor, tp_rank: int, tp: int, chunks: int = 1) -> torch.Tensor:
    """Rank `tp_rank`'s rows of a weight (out, in) or bias (out,) under a column split; with
    ``chunks=k`` each of k blocks side by side is split, so rank r holds [q_r | k_r | v_r] of c_attn."""
    out = t.shape[0]
    if out % (tp * chunks):
        raise ValueError(f"a column split needs the output size {out} to divide by "
                         f"tp={tp} x chunks={chunks} = {tp * chunks}")
    return torch.cat([block.chunk(tp, dim=0)[tp_rank] for block in t.chunk(chunks, dim=0)], dim=0)


def row_shard(weight: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank `tp_rank`'s columns of a weight (out, in) under a row split of A = weight^T."""
    if weight.shape[1] % tp:
        raise ValueError(f"a row split needs the input size {weight.shape[1]} to divide by tp={tp}")
    return weight.chunk(tp, dim=1)[tp_rank]


def _keep_frozen(layer: nn.Module, dense: nn.Module) -> None:
    """A frozen dense parameter stays frozen in its shard (requires_grad copied by name)."""
    dense_params = dict(dense.named_parameters())
    for name, p in layer.named_parameters():
        p.requires_grad_(dense_params[name].requires_grad)


def check_init_seed(owner: str, seed) -> None:
    """A layer's init seed is an int; a bool or None here is a slip, not a choice."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"{owner}: seed must be an int (the same on every rank of the group), "
                        f"got {seed!r}")


@torch.no_grad()
def linear_init_(weight: torch.Tensor, bias: torch.Tensor | None,
                 generator: torch.Generator) -> None:
    """nn.Linear's `reset_parameters`, drawn from `generator` in the same order (weight, then bias
    U(-1/sqrt(in), 1/sqrt(in))): a generator seeded s gives `torch.manual_seed(s); nn.Linear(...)`'s."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)  # (out, in)
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound, generator=generator)  # (out,)


def _master_linear(in_features: int, out_features: int, bias: bool, seed: int, dtype):
    """The master weight (out, in) and bias (out,), drawn from `seed` on the CPU for the constructor."""
    weight = torch.empty(out_features, in_features, dtype=dtype, device="cpu")
    full_bias = torch.empty(out_features, dtype=dtype, device="cpu") if bias else None
    linear_init_(weight, full_bias, torch.Generator().manual_seed(seed))
    return weight, full_bias


# ---------------------------------------------------------------------------
# Sequence-parallel column GEMM that all-gathers its input again in backward
# ---------------------------------------------------------------------------
class _RegatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # the shard (B, T // tp, in), not the gathered input
        return F.linear(all_gather_along(x, SEQ_DIM, group), weight, bias)  # (B, T, out // tp)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, out // tp)
        x, weight = ctx.saved_tensors
        total = all_gather_along(x, SEQ_DIM, ctx.group)  # (B, T, in), gathered once more
        grad_x = reduce_scatter_along(grad @ weight, SEQ_DIM, ctx.group)  # (B, T // tp, in)
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad2d.t() @ total.reshape(-1, total.shape[-1])  # (out // tp, in)
        grad_b = grad2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


# ---------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r: this rank's ``out // tp`` output features.

    Input (.., in) replicated, or (B, T // tp, in) with ``sequence_parallel``.
    Output (.., out // tp), or (.., out) with ``gather_output=True``.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 regather_input: bool = False, chunks: int = 1, seed: int = 0,
                 perform_initialization: bool = True):
        super().__init__()
        tp, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        if out_features % (tp * chunks):
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} must divide by "
                             f"tp={tp} x chunks={chunks} = {tp * chunks}")
        if regather_input and not sequence_parallel:
            raise ValueError("regather_input=True only applies with sequence_parallel=True")
        check_init_seed("ColumnParallelLinear", seed)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp, self.chunks = group, tp, chunks
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.regather_input = regather_input
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))  # (out // tp, in)
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None
        if perform_initialization:  # False: left empty, for `from_dense` to copy into
            self.copy_shard(*_master_linear(in_features, out_features, bias, seed, self.weight.dtype))
        for p in self.parameters(recurse=False):  # rows cut, block by block: recorded where cut
            record_cut(p, 0, tp, self.tp_rank, out_features, blocks=chunks)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, gather_output: bool = False, *,
                   sequence_parallel: bool = False, regather_input: bool = False,
                   chunks: int = 1) -> "ColumnParallelLinear":
        """This rank's columns of `linear`'s A, copied, so the TP layer computes the same function."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    gather_output=gather_output, sequence_parallel=sequence_parallel,
                    regather_input=regather_input, chunks=chunks, perform_initialization=False)
        layer.copy_shard(linear.weight, linear.bias)
        _keep_frozen(layer, linear)
        return layer.to(linear.weight.device)

    @torch.no_grad()
    def copy_shard(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy in this rank's rows of a dense weight (out, in) and bias (out,) ([q_r | k_r | v_r], chunks=3)."""
        self.weight.copy_(column_shard(weight, self.tp_rank, self.tp, self.chunks))
        if bias is not None:
            self.bias.copy_(column_shard(bias, self.tp_rank, self.tp, self.chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.regather_input:
            y = _RegatherLinear.apply(x, self.weight, self.bias, self.group)
        else:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, self.group)  # (B, T, in)
            else:
                x = copy_to_tensor_parallel_region(x, self.group)  # f
            y = F.linear(x, self.weight, self.bias)  # (.., out // tp)
        if not self.gather_output:
            return y
        y = gather_from_tensor_parallel_region(y, self.group)  # (.., tp * out // tp), rank-major
        if self.chunks > 1:
            # Rank-major [q_0 k_0 v_0 | q_1 k_1 v_1] back to the dense [q_0 q_1 | k_0 k_1 | v_0 v_1].
            w = self.out_features // (self.tp * self.chunks)
            y = y.unflatten(-1, (self.tp, self.chunks, w)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.out_features // self.tp}), tp={self.tp}, chunks={self.chunks}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Z = sum_r X_r A_r + b: this rank's ``in // tp`` input features, partial sums added by g.

    Input (.., in // tp) with ``input_is_parallel=True`` (a column layer's output), else (.., in)
    replicated and split here. Output (.., out) replicated, or (B, T // tp, out) with ``sequence_parallel``.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seed: int = 0,
                 perform_initialization: bool = True):
        super().__init__()
        tp, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        if in_features % tp:
            raise ValueError(f"RowParallelLinear: in_features={in_features} must divide by tp={tp}")
        check_init_seed("RowParallelLinear", seed)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp = group, tp
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))  # (out, in // tp)
        # The bias is whole on every rank and added once, after the reduction.
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if perform_initialization:  # False: left empty, for `from_dense` to copy into
            self.copy_shard(*_master_linear(in_features, out_features, bias, seed, self.weight.dtype))
        record_cut(self.weight, 1, tp, self.tp_rank, in_features)  # columns cut; the bias whole
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # its gradient sees only this rank's tokens

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, input_is_parallel: bool = True, *,
                   sequence_parallel: bool = False) -> "RowParallelLinear":
        """This rank's rows of `linear`'s A, copied, so the TP layer computes the same function."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                    perform_initialization=False)
        layer.copy_shard(linear.weight, linear.bias)
        _keep_frozen(layer, linear)
        return layer.to(linear.weight.device)

    @torch.no_grad()
    def copy_shard(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy in this rank's columns of a dense weight (out, in), and the bias (out,) whole."""
        self.weight.copy_(row_shard(weight, self.tp_rank, self.tp))
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)  # (.., in // tp)
        partial = F.linear(x, self.weight)  # (.., out): this rank's term of the sum
        if self.sequence_parallel:
            z = reduce_scatter_to_sequence_parallel_region(partial, self.group)  # (B, T // tp, out)
        else:
            z = reduce_from_tensor_parallel_region(partial, self.group)  # g
        return z if self.bias is None else z + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.in_features // self.tp}), "
                f"out_features={self.out_features}, tp={self.tp}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")
