"""ZeRO-3 per parameter (the FSDP2 design): each tensor's dim 0 split over the data-parallel ranks.

    sharded = ShardedParameters(params, group)   # every parameter now holds its rows only
    sharded.gather()                             # before the step: every parameter whole again
    ... forward and backward of every micro-batch (any pipeline schedule, TP, checkpointing) ...
    sharded.reduce_scatter()                     # after the last backward: .data and .grad = shards
    optimizer.step()                             # a plain torch optimizer over the same parameters

`reference.zero.fsdp` flattens a block's tensors into one buffer and cuts that: a shard then
mixes pieces of several tensors, which is fine while every tensor is whole and replicated,
but not once tensor parallelism has split some of them (a shard would hold a slice of a
column-parallel weight next to a LayerNorm gain replicated over tp). Here every parameter
is sharded on its own, along dim 0, as PyTorch's `fully_shard` (FSDP2) does with
`Shard(0)` DTensors; a parameter that is already a tensor-parallel slice (out / tp, in) is
simply split again:

    p (d0, *rest)   c = ceil(d0 / N) rows per rank, dim 0 padded with zeros to N c
    rank r holds rows [r c, (r + 1) c) of the padded tensor:   shard (c, *rest)

Between steps `p.data` *is* the shard (the full tensor freed), so the optimizer, its state,
the gradient clip and `reference.memory.measure` all see 1/N of each tensor. The padding
rows are zero in the parameter and in the gradient, so an element-wise optimizer (SGD,
Adam, AdamW) leaves them zero.

When to gather (torchtitan's ``reshard_after_forward=False`` under pipeline parallelism):
all of this rank's parameters are gathered once before the step and kept through every
micro-batch's forward and backward, then the gradients reduce-scattered once after the
last backward. That costs one all-gather and one reduce-scatter of the stage per step,
(N-1)/N x 2 x its bytes, whatever the number of micro-batches m (the flat `FSDP` gathers
twice and reduce-scatters once per micro-batch: 3 m times), against holding the whole
stage's parameters and gradients during the step (the flat FSDP holds one block). With a
pipeline a stage runs 2 m times a step, so gathering per micro-batch would multiply the
data-parallel traffic by m; with tensor parallelism the stage is already 1/tp of the
model. It also composes with anything the executor does, activation checkpointing
included: the executor only ever sees whole (TP-local) parameters.

Both collectives move all parameters in one call (FSDP2's copy-in / copy-out): the shards
are packed end to end into one buffer (S,) per rank, all-gathered to (N, S), and each
parameter's N row blocks copied out; the gradients are packed the other way, (N, S) with
block r holding every tensor's rows for rank r, and reduce-scattered to (S,).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference import comms

__all__ = ["ShardedParameters", "ShardedSets", "ZeroRows", "shard_rows", "copy_rows", "all_gather_shards", "rows_of",
           "reduce_scatter_grads"]


def copy_rows(blocks: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full`` (d0, *rest) into ``blocks`` (N, c, *rest), zero, as rows of the padded
    (N c, *rest) tensor: block r gets rows [r c, (r + 1) c), the rows past d0 stay zero."""
    c, d0 = blocks.shape[1], full.shape[0]
    whole = d0 // c                                    # blocks filled entirely
    blocks[:whole].copy_(full[:whole * c].view((whole, c) + tuple(full.shape[1:])))
    if whole * c < d0:
        blocks[whole, :d0 - whole * c].copy_(full[whole * c:])


@torch.no_grad()
def all_gather_shards(shards, n: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The collective of every per-parameter ZeRO-3 gather (the whole stage here, a block in
    `reference.zero.fsdp_reshard`): the shards packed end to end (S,) and one all-gather.
    Returns (the packed shards, the (N, S) result); `rows_of` reads each parameter's rows out
    of the second. (The caller holds both until every parameter is copied out: the peak the
    course's formulas count.)"""
    packed = torch.cat([s.reshape(-1) for s in shards])                        # (S,)
    out = torch.empty(n * packed.numel(), dtype=packed.dtype, device=packed.device)
    comms.all_gather_into_tensor(out, packed, group=group)                     # (N S,)
    return packed, out.view(n, packed.numel())                                 # (N, S)


def rows_of(gathered: torch.Tensor, offset: int, c_shape) -> torch.Tensor:
    """A parameter's N row blocks in the gathered (N, S) buffer, from ``offset``: the padded
    (N c, *rest) tensor (the caller keeps its first d0 rows)."""
    n = gathered.shape[0]
    return gathered[:, offset:offset + c_shape.numel()].reshape((n * c_shape[0],) + tuple(c_shape[1:]))


@torch.no_grad()
def reduce_scatter_grads(params, c_shapes, n: int, group, mean_over: int, dtype, device):
    """The collective of every per-parameter ZeRO-3 reduce-scatter: each whole gradient
    copied as rows into one (N, S) buffer (block r: every tensor's rows for rank r) and
    dropped as soon as it is copied, one reduce-scatter to (S,), divided by ``mean_over`` (gloo
    has no AVG). Returns (this rank's (S,) mean gradient, which parameters had a gradient)."""
    S = sum(c.numel() for c in c_shapes)
    packed = torch.zeros(n, S, dtype=dtype, device=device)                     # (N, S)
    offset, with_grad = 0, []
    for p, c_shape in zip(params, c_shapes):
        k = c_shape.numel()
        with_grad.append(p.grad is not None)
        if p.grad is not None:
            copy_rows(packed[:, offset:offset + k].view((n,) + tuple(c_shape)), p.grad)
            p.grad = None  # the whole gradient goes as soon as it is packed
        offset += k
    out = torch.empty(S, dtype=dtype, device=device)                           # (S,)
    comms.reduce_scatter_tensor(out, packed.view(-1), group=group)             # (N S,) -> (S,)
    del packed
    out /= mean_over
    return out, with_grad


def shard_rows(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows [r c, (r + 1) c) of ``full`` (d0, *rest) padded with zero rows to n c, c = ceil(d0 / n)."""
    c = math.ceil(full.shape[0] / n)
    out = full.new_zeros((c,) + tuple(full.shape[1:]))
    rows = full[rank * c:(rank + 1) * c]  # fewer than c (or none) on the last ranks
    out[:rows.shape[0]] = rows
    return out


@dataclass(frozen=True)
class ZeroRows:
    """Where ZeRO-3 per parameter cut a tensor: rows [rank c, (rank + 1) c) of the whole
    (TP-local) tensor of shape ``whole``, c = ceil(whole[0] / parts), padded with zero rows."""

    rank: int
    parts: int
    whole: torch.Size
    replica: int = 0  # HSDP: which copy of these rows (its rank across the replicas); 0 otherwise

    @property
    def first_row(self) -> int:
        return self.rank * math.ceil(self.whole[0] / self.parts)


class ShardedParameters:
    """This rank's parameters, each sharded along dim 0 over ``group`` (the dp x cp ranks).

    ``params``: the distinct parameters of this rank's pipeline stages (tensor-parallel slices
    included). Each records where it was cut, ``p.zero_rows`` (`ZeroRows`: this rank's place,
    the group's size and the whole shape), which the gradient clip and the checkpoints read.
    ``mean_over``: what the summed gradient is divided by, the group's size unless given
    (experts sharded over the expert-data-parallel group divide by dp: see `ShardedSets`).
    ``replicate_group`` (HSDP, FSDP2's 2D mesh): ``group`` is one block of the dp ranks, and
    every block holds the same shards; after the reduce-scatter inside the block, one
    all-reduce across the blocks (the same rows on each) sums the other blocks' share, and
    ``mean_over`` is then all of dp."""

    def __init__(self, params, group, mean_over: int | None = None, replicate_group=None):
        self.group, self.replicate_group = group, replicate_group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        replica = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.mean_over = self.n if mean_over is None else mean_over  # the gradient's divisor
        self.params = list({id(p): p for p in params}.values())  # a tied weight once
        self.shapes = [p.shape for p in self.params]               # the whole (TP-local) shapes
        self.index = {id(p): i for i, p in enumerate(self.params)}
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ShardedParameters packs one buffer: parameters of dtypes {dtypes}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.gathered = False
        for p, shape in zip(self.params, self.shapes):
            with torch.no_grad():
                p.data = shard_rows(p.data, self.rank, self.n)  # (c, *rest): the full tensor freed
            p.zero_rows = ZeroRows(self.rank, self.n, shape, replica)  # recorded where it is cut

    # ------------------------------------------------------------------ arithmetic
    def shard_shape(self, i: int) -> torch.Size:
        shape = self.shapes[i]
        return torch.Size((math.ceil(shape[0] / self.n),) + tuple(shape[1:]))

    @property
    def shard_numel(self) -> int:
        """S: the numbers this rank holds, padding included (its parameter bytes / element size)."""
        return sum(self.shard_shape(i).numel() for i in range(len(self.params)))

    def full_shape(self, p) -> torch.Size:
        """Parameter ``p``'s whole (TP-local) shape, whatever it holds now."""
        return self.shapes[self.index[id(p)]]

    def rank_of(self, p) -> int:
        """This rank's place in the group that shards ``p``: it holds rows [rank c, (rank + 1) c)."""
        self.index[id(p)]  # a KeyError for a parameter not sharded here
        return self.rank

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def gather(self) -> None:
        """Every parameter whole: one all-gather of the packed shards (S,) -> (N, S)."""
        if self.gathered or not self.params:
            self.gathered = True
            return
        (packed, out), offset = all_gather_shards([p.data for p in self.params], self.n, self.group), 0
        for i, p in enumerate(self.params):
            c_shape = self.shard_shape(i)
            p.data = rows_of(out, offset, c_shape)[:self.shapes[i][0]].clone()     # (d0, *rest)
            offset += c_shape.numel()
        del packed, out  # the collective's buffers, held until every parameter is whole
        self.gathered = True

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """After the last backward: average each whole gradient over the group into this rank's
        rows (one reduce-scatter of (N, S) -> (S,)), and shrink every parameter back to its shard.

        The gradients are copied straight into one (N, S) buffer, block r holding every
        tensor's rows for rank r, each whole gradient dropped as soon as it is copied: the
        collective's own memory is that buffer and its (S,) output, 4 N S + 4 S bytes in fp32."""
        if not self.gathered:
            raise RuntimeError("reduce_scatter() without gather(): the parameters are shards already")
        c_shapes = [self.shard_shape(i) for i in range(len(self.params))]
        with_grad = [p.grad is not None for p in self.params]
        if any(with_grad):
            out, _ = reduce_scatter_grads(self.params, c_shapes, self.n, self.group, self.mean_over,
                                          self.dtype, self.params[0].device)
            if self.replicate_group is not None:  # HSDP: every block's share of the same rows
                comms.all_reduce(out, group=self.replicate_group)
        offset = 0
        for i, p in enumerate(self.params):
            c_shape, k = self.shard_shape(i), self.shard_shape(i).numel()
            p.data = shard_rows(p.data, self.rank, self.n)                         # (c, *rest)
            p.grad = out[offset:offset + k].view(c_shape).clone() if with_grad[i] else None
            offset += k
        self.gathered = False

    @contextlib.contextmanager
    def gathered_params(self):
        """Every parameter whole inside the block (to read or overwrite it), shards again after:
        each rank keeps its rows of whatever the whole tensor then holds."""
        was = self.gathered
        self.gather()
        try:
            yield self
        finally:
            if not was:
                with torch.no_grad():
                    for p in self.params:
                        p.data = shard_rows(p.data, self.rank, self.n)
                self.gathered = False


class ShardedSets:
    """Several `ShardedParameters` that gather and reduce-scatter together, each over its group.

    With experts (ep > 1) a rank's parameters are of two kinds. The dense ones (attention,
    LayerNorms, router, shared expert) are replicated over dp, so they are sharded over the
    dp (x cp) group and their gradients averaged there. Each expert lives on one ep rank
    only and is replicated over its expert-data-parallel group (dp / ep ranks), so its rows
    are sharded over that group. Its gradient already holds the contributions of every
    token of its ep group (the all-to-all's backward brought them home), so it is summed
    over the edp group and divided by dp, not by dp / ep: the same mean as a dense
    gradient, as `moe_all_reduce_gradients` does without ZeRO.

        sets = ShardedSets([ShardedParameters(dense, dp_group),
                            ShardedParameters(experts, edp_group, mean_over=dp)])

    It offers what `ShardedParameters` offers to the training step, the clip and the
    checkpoints: `gather`, `reduce_scatter`, `gathered`, `gathered_params`, `full_shape`
    and `rank_of` (each parameter's place in its own group)."""

    def __init__(self, sets):
        self.sets = [s for s in sets if s.params]
        self._of = {id(p): s for s in self.sets for p in s.params}

    @property
    def params(self) -> list:
        return [p for s in self.sets for p in s.params]

    @property
    def gathered(self) -> bool:
        return all(s.gathered for s in self.sets)

    @property
    def shard_numel(self) -> int:
        return sum(s.shard_numel for s in self.sets)

    def full_shape(self, p) -> torch.Size:
        return self._of[id(p)].full_shape(p)

    def rank_of(self, p) -> int:
        return self._of[id(p)].rank_of(p)

    def gather(self) -> None:
        for s in self.sets:
            s.gather()

    def reduce_scatter(self) -> None:
        for s in self.sets:
            s.reduce_scatter()

    @contextlib.contextmanager
    def gathered_params(self):
        with contextlib.ExitStack() as stack:
            for s in self.sets:
                stack.enter_context(s.gathered_params())
            yield self
