"""ZeRO-3 per parameter (the FSDP2 design): each tensor's dim 0 split over the data-parallel ranks.

    sharded = ShardedParameters(params, group)   # every parameter now holds its rows only
    sharded.gather()                             # before the step: every parameter whole again
    ... forward and backward of every micro-batch (any pipeline schedule, TP, checkpointing) ...
    sharded.reduce_scatter()                     # after the last backward: .data and .grad = shards
    optimizer.step()                             # a plain torch optimizer over the same parameters

`reference.zero.fsdp` flattens a block's tensors into one buffer and cuts that: a shard then
mixes pieces of several tensors, which is fine while every tensor is whole and replicated,
but not once tensor parallelism has split some of them (a shard would hold a slice of a
column-parallel weight next to a LayerNorm gain replicated over tp). Here every parameter is
cut on its own along dim 0 (`reference.zero.units.RowShards`); a parameter that is already a
tensor-parallel slice (out / tp, in) is simply split again. Between steps `p.data` *is* the
shard (c, *rest), so the optimizer, its state, the gradient clip and
`reference.memory.measure` all see 1/N of each tensor.

When to gather (torchtitan's ``reshard_after_forward=False`` under pipeline parallelism): the
stage is one `reference.zero.units.Unit`, gathered once before the step and kept whole through
every micro-batch's forward and backward, its gradients reduce-scattered once after the last
backward. That costs one all-gather and one reduce-scatter of the stage per step, (N-1)/N x 2
x its bytes, whatever the number of micro-batches m (the flat `FSDP` moves 3 m times), for
holding the stage's parameters and gradients whole during the step (the flat FSDP holds one
block). With a pipeline a stage runs 2 m times a step, so gathering per micro-batch would
multiply the data-parallel traffic by m; with tensor parallelism the stage is already 1/tp of
the model. It composes with anything the executor does, activation checkpointing included:
the executor only ever sees whole (TP-local) parameters. `reference.zero.fsdp_reshard` cuts
the same shards into a unit per block instead.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.zero.units import RowShards, Unit, ZeroRows, copy_rows, shard_rows

__all__ = ["ShardedParameters", "ShardedSets", "ZeroRows", "shard_rows", "copy_rows"]


class ShardedParameters:
    """This rank's parameters, each sharded along dim 0 over ``group`` (the dp x cp ranks).

    ``params``: the distinct parameters of this rank's pipeline stages (tensor-parallel slices
    included). Each records where it was cut, ``p.zero_rows`` (`ZeroRows`), which the gradient
    clip and the checkpoints read. ``mean_over``: what the summed gradient is divided by, the
    group's size unless given (experts sharded over the expert-data-parallel group divide by
    dp: see `ShardedSets`). ``replicate_group`` (HSDP, FSDP2's 2D mesh): ``group`` is one block
    of the dp ranks, every block holding the same shards; after the reduce-scatter inside the
    block, one all-reduce across the blocks sums their shares, and ``mean_over`` is all of dp."""

    def __init__(self, params, group, mean_over: int | None = None, replicate_group=None):
        self.group, self.replicate_group = group, replicate_group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        replica = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.mean_over = self.n if mean_over is None else mean_over  # the gradient's divisor
        self.params = list({id(p): p for p in params}.values())  # a tied weight once
        self.shapes = [p.shape for p in self.params]               # the whole (TP-local) shapes
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ShardedParameters packs one buffer: parameters of dtypes {dtypes}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        for p, shape in zip(self.params, self.shapes):
            with torch.no_grad():
                p.data = shard_rows(p.data, self.rank, self.n)  # (c, *rest): the full tensor freed
            p.zero_rows = ZeroRows(self.rank, self.n, shape, replica)  # recorded where it is cut
        self.stage = self.unit("stage", self.params) if self.params else None
        self.gathered = False

    def unit(self, name: str, params) -> Unit:
        """A `Unit` of some of these parameters, over this group with this mean."""
        layout = RowShards([p.zero_rows.whole for p in params], self.rank, self.n)
        return Unit(name, params, layout, self.group, self.dtype, params[0].device,
                    mean_over=self.mean_over, replicate_group=self.replicate_group)

    @property
    def shard_numel(self) -> int:
        """S: the numbers this rank holds, padding included (its parameter bytes / element size)."""
        return self.stage.layout.shard_numel if self.stage else 0

    def gather(self) -> None:
        """Every parameter whole: one all-gather of the packed shards (S,) -> (N, S)."""
        if not self.gathered and self.stage is not None:
            self.stage.to_whole(keep_shards=False)
            self.stage.gather()
        self.gathered = True

    def reduce_scatter(self) -> None:
        """After the last backward: average each whole gradient over the group into this rank's
        rows (one reduce-scatter of (N, S) -> (S,)), and shrink every parameter back to its shard.

        Each whole gradient is dropped as soon as it is copied into the (N, S) buffer: the
        collective's own memory is that buffer and its (S,) output, 4 N S + 4 S bytes in fp32."""
        if not self.gathered:
            raise RuntimeError("reduce_scatter() without gather(): the parameters are shards already")
        if self.stage is not None:
            if any(p.grad is not None for p in self.params):
                self.stage.reduce_into_grad()
            self.stage.to_shards(with_grads=True)
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
            if not was and self.stage is not None:
                self.stage.to_shards(with_grads=False)
            self.gathered = was


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

    It offers the training step what `ShardedParameters` does: `gather`, `reduce_scatter`,
    `gathered`, `gathered_params`, `params` and `shard_numel`."""

    def __init__(self, sets):
        self.sets = [s for s in sets if s.params]

    @property
    def params(self) -> list:
        return [p for s in self.sets for p in s.params]

    @property
    def gathered(self) -> bool:
        return all(s.gathered for s in self.sets)

    @property
    def shard_numel(self) -> int:
        return sum(s.shard_numel for s in self.sets)

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
