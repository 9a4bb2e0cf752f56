"""How the data-parallel replicas keep their weights and gradients: one object per way.

    pm.data_parallel      # chosen once by `parallelize` (`data_parallelism(config, mesh, ...)`)

`train_step`, `full_state_dict` and `generate` ask this object, and never which ZeRO stage
runs. Each way answers the same questions (`Replicas`' methods): `make_optimizer`, the
optimizer of this rank's parameters; `forward_backward`, the step's schedule with what must
happen around it; `reduce_gradients`, the sums and means after the last backward;
`local_grads`, the gradients this rank steps with; `clip`; `full_state_dict` and `generate`,
on whole weights. The ways, in the order the course teaches them:

    Replicas               every dp x cp rank holds the whole (tp, pp) slice: one all-reduce
    OptimizerShards        ZeRO-1: `ZeroOptimizer` reduce-scatters in `step()`
    GradientShards         ZeRO-2: the same optimizer, bucket by bucket during the backward
    WholeModelShards       ZeRO-3 by blocks: `FSDP` over the whole model (tp = pp = 1)
    ParameterShards        ZeRO-3 composed: `ShardedParameters`, gathered once a step
    ReshardedAfterForward  the same shards, gathered per block and micro-batch"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from reference import comms
from reference.expert_parallel import moe_all_reduce_gradients
from reference.parallel.clip import clip_grad_norm_, flat_shard_pieces, mark_parallel_params
from reference.tensor_parallel import allreduce_sequence_parallel_grads
from reference.zero import ReshardAfterForward, ZeroOptimizer

__all__ = ["Replicas", "OptimizerShards", "GradientShards", "WholeModelShards", "ParameterShards",
           "ReshardedAfterForward", "data_parallelism"]


def sum_sequence_parallel_grads(pm) -> None:
    """The LayerNorms' and row biases' gradients, each tp rank's partial sum over its tokens,
    summed over tp (a no-op without sequence parallelism)."""
    if pm.mesh.tp > 1 and pm.config.sequence_parallel:
        for stage in pm.stages:
            allreduce_sequence_parallel_grads(stage, pm.mesh.group("tp"))


class Replicas:
    """Every replica holds every weight of its slice; gradients averaged after the backward."""

    def make_optimizer(self, params, optimizer_class, decay=None, **kwargs):
        return optimizer_class(params, **kwargs)

    def forward_backward(self, pm, run):
        return run.pipeline(None)

    def reduce_gradients(self, pm, optimizer) -> None:
        sum_sequence_parallel_grads(pm)
        mesh = pm.mesh
        if mesh.dp_cp == 1:
            return
        if pm.has_experts:
            edp = mesh.group("edp") if mesh.ep > 1 else mesh.group("dp")
            for stage in pm.stages:
                moe_all_reduce_gradients(stage, mesh.group("dp"), edp)
            return
        # Dense: one flat all-reduce of every gradient over the dp x cp replicas (one bucket:
        # after the last backward there is nothing left to overlap with)
        grads = [p.grad for p in pm.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comms.all_reduce(flat, group=mesh.group("dp_cp"))
        flat /= mesh.dp_cp
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def local_grads(self, pm, optimizer) -> list:
        return [p.grad for p in pm.parameters() if p.grad is not None]

    def clip(self, pm, optimizer, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(pm.stages, max_norm, pm.mesh)

    def whole(self, pm):
        """A context in which this rank's stages hold their whole weights."""
        return contextlib.nullcontext()

    def full_state_dict(self, pm, of_stages) -> dict:
        with self.whole(pm):
            return of_stages(pm)

    def generate(self, pm, sample, *args):
        with self.whole(pm):
            return sample(pm, *args)


class OptimizerShards(Replicas):
    """ZeRO-1: `ZeroOptimizer` reduce-scatters the gradients in `step()`, each rank updates
    its flat shard and all-gathers the weights."""

    stage = 1

    def __init__(self, group):
        self.group = group

    def make_optimizer(self, params, optimizer_class, decay=None, **kwargs):
        return ZeroOptimizer(params, optimizer_class, stage=self.stage, group=self.group, **kwargs)

    def reduce_gradients(self, pm, optimizer) -> None:
        sum_sequence_parallel_grads(pm)  # before the optimizer's reduce-scatter: whole gradients

    def local_grads(self, pm, optimizer) -> list:
        optimizer.reduce_gradients()  # the shard's averaged gradients; step() will not reduce again
        return [optimizer.shard.grad] if optimizer.shard.grad is not None else []

    def clip(self, pm, optimizer, max_norm: float) -> torch.Tensor:
        optimizer.reduce_gradients()
        # The flat shard mixes tensor-parallel slices, replicas over tp and the tied
        # embedding's second copy: each slice of it is counted by its parameter's marks.
        mark_parallel_params(pm.stages)
        return clip_grad_norm_(optimizer, max_norm, pm.mesh)


class GradientShards(OptimizerShards):
    """ZeRO-2: the optimizer's hooks reduce-scatter each bucket during the backward."""

    stage = 2

    @torch.no_grad()
    def reduce_gradients(self, pm, optimizer) -> None:
        """The hooks reduce-scattered the LayerNorms' and row biases' gradients over dp while
        they were each tp rank's partial sums. The tp ranks' flat shards cover the same ranges,
        so summing those slices over tp gives the sum of the dp means, the dp mean of the sum."""
        if not (pm.mesh.tp > 1 and pm.config.sequence_parallel):
            return
        optimizer.reduce_gradients()  # the last buckets; step() will not reduce again
        pieces = [g for p, g in flat_shard_pieces(optimizer.layout, optimizer.params, optimizer.dp_rank,
                                                  optimizer.shard.grad)
                  if getattr(p, "sequence_parallel", False)]
        if not pieces:  # the same on every tp rank: the same layout
            return
        flat = torch.cat(pieces)  # (k,) this shard's numbers of sequence-parallel parameters
        comms.all_reduce(flat, group=pm.mesh.group("tp"))
        offset = 0
        for g in pieces:
            g.copy_(flat[offset: offset + g.numel()])
            offset += g.numel()


class WholeModelShards(Replicas):
    """ZeRO-3 by blocks: `FSDP` wraps the whole model as one stage (tp = pp = 1); the executor
    runs its micro-batches as any stage's, each block gathered for its forward and backward,
    its gradient reduce-scattered during the backward."""

    def __init__(self, fsdp, model=None, dp_cp: int = 1):
        self.fsdp, self.model, self.dp_cp = fsdp, model, dp_cp

    def make_optimizer(self, params, optimizer_class, decay=None, **kwargs):
        if decay:
            raise ValueError(f"weight_decay={decay} with zero_stage=3 (dp*cp={self.dp_cp}) is not "
                             f"supported: FSDP's flat shards mix matrices (decayed) with biases and "
                             f"LayerNorm gains (not), and per-group decay is not implemented for them; "
                             f"use zero_stage 1 or 2, or weight_decay=0")
        return optimizer_class(params, **kwargs)

    def reduce_gradients(self, pm, optimizer) -> None:
        pass  # each block's gradient was reduce-scattered during the backward

    def full_state_dict(self, pm, of_stages) -> dict:
        return self.fsdp.full_state_dict()  # the GPT's names, gathered unit by unit

    def generate(self, pm, sample, *args):
        # the root unit (embeddings, head) whole for the whole loop; each block is gathered by
        # its own hooks as the GPT runs it
        with self.fsdp.summon_full_params():
            return self.model.generate(*args)


class ParameterShards(Replicas):
    """ZeRO-3 composed: every parameter's dim 0 over dp x cp (`ShardedParameters`), gathered
    once before the schedule, reduce-scattered once after it (after the SP sum over tp, so
    each whole gradient is averaged once)."""

    reshard: Optional[ReshardAfterForward] = None  # resharded after forward: its action hook

    def __init__(self, sharded):
        self.sharded = sharded

    def forward_backward(self, pm, run):
        self.sharded.gather()
        run.event("gather", "parameters", 0.0)
        return run.pipeline(None)

    def reduce_gradients(self, pm, optimizer) -> None:
        sum_sequence_parallel_grads(pm)
        self.sharded.reduce_scatter()

    def whole(self, pm):
        return contextlib.nullcontext() if self.sharded.gathered else self.sharded.gathered_params()


class ReshardedAfterForward(ParameterShards):
    """The same shards, gathered per block and micro-batch by the executor's action hook and
    freed after each forward and backward (`reference.zero.fsdp_reshard`); when the backward
    ends only the SP sum over tp is left, done on the shards (the same rows on every tp rank)."""

    def forward_backward(self, pm, run):
        if self.reshard is None:
            self.reshard = ReshardAfterForward(self.sharded, pm.stages, pm.config.microbatches)
        with self.reshard.step():
            return run.pipeline(self.reshard.hook)

    def reduce_gradients(self, pm, optimizer) -> None:
        sum_sequence_parallel_grads(pm)


def data_parallelism(config, mesh, *, fsdp=None, model=None, sharded=None):
    """The one place that reads the ZeRO stage: the way this run keeps its replicas."""
    if fsdp is not None:
        return WholeModelShards(fsdp, model, mesh.dp_cp)
    if sharded is not None:
        return ReshardedAfterForward(sharded) if config.reshard_after_forward else ParameterShards(sharded)
    if mesh.dp_cp > 1 and config.zero_stage == 1:
        return OptimizerShards(mesh.group("dp_cp"))
    if mesh.dp_cp > 1 and config.zero_stage == 2:
        return GradientShards(mesh.group("dp_cp"))
    return Replicas()
