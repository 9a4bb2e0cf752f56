"""ZeRO-3 per parameter (the FSDP2 design): each tensor's dim 0 split over the data-parallel ranks.

    sharded = ShardedParameters(params, group)   # every parameter now holds its rows only
    sharded.gather()                             # before the step: every parameter whole again
    ... forward and backward of every micro-batch (any pipeline schedule, TP, checkpointing) ...
    sharded.reduce_scatter()                     # after the last backward: .data and .grad = shards
    optimizer.step()                             # a plain torch optimizer over the same parameters

The flat `reference.zero.fsdp` mixes pieces of several tensors in one shard, which breaks once
tensor parallelism has split some of them. Here every parameter is cut on its own along dim 0
(`reference.zero.rows.RowShards`), a tensor-parallel slice simply split again. Between steps
`p.data` *is* the shard (c, *rest), so the optimizer, the clip and `reference.memory.measure`
see 1/N of each tensor.

The stage is one `reference.zero.units.Unit`, gathered once before the step and whole through
every micro-batch (torchtitan's ``reshard_after_forward=False`` under a pipeline): one
all-gather and one reduce-scatter a step, (N-1)/N x 2 x its bytes whatever the number of
micro-batches m, for holding the stage whole; the executor only sees whole (TP-local)
parameters. `reference.zero.fsdp_reshard` cuts the same shards into a unit per block instead.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.zero.rows import RowShards, ZeroRows, copy_rows, shard_rows
from reference.zero.units import Unit

__all__ = ["ShardedParameters", "ShardedSets", "ZeroRows", "shard_rows", "copy_rows"]


class ShardedParameters:
    """This rank's parameters, each sharded along dim 0 over ``group`` (the dp x cp ranks).

    ``params``: this rank's stages' parameters; each records where it was cut, ``p.zero_rows``
    (`ZeroRows`), for the clip and the checkpoints. ``mean_over``: the summed gradient's divisor,
    the group's size unless given (`ShardedSets`). ``replicate_group`` (HSDP, FSDP2's 2D mesh):
    ``group`` is one block of the dp ranks, all blocks holding the same shards; one all-reduce
    across the blocks sums their shares, and ``mean_over`` is all of dp."""

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
        """After the last backward: average each whole gradient into this rank's rows (one
        reduce-scatter of (N, S) -> (S,)), every parameter its shard again. The collective holds
        4 N S + 4 S bytes in fp32: each whole gradient is dropped once copied into (N, S)."""
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

    With experts (ep > 1), dense parameters are sharded over the dp (x cp) group; each expert,
    replicated over its expert-data-parallel group (dp / ep ranks), over that group. An expert's
    gradient already holds its whole ep group's tokens (the all-to-all's backward), so it is
    summed over edp and divided by dp, as `moe_all_reduce_gradients` does without ZeRO:

        sets = ShardedSets([ShardedParameters(dense, dp_group),
                            ShardedParameters(experts, edp_group, mean_over=dp)])
    """

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
