"""How the data-parallel replicas keep their weights and gradients: one object per way.

    pm.data_parallel      # chosen once by `parallelize` (`data_parallelism(config, mesh)`)

`parallelize`, `train_step`, the clip, the checkpoints, `full_state_dict` and `generate` ask this
object, and never which ZeRO stage runs. The ways, in the order the course teaches them:

    Replicas                every dp x cp rank holds the whole (tp, pp) slice: one all-reduce
    OptimizerShards         ZeRO-1: `ZeroOptimizer` reduce-scatters in `step()`
    GradientShards          ZeRO-2: the same optimizer, bucket by bucket during the backward
    WholeModelShards        ZeRO-3 by blocks: `FSDP` over the whole model (tp = pp = ep = 1)
    ParameterShards         ZeRO-3 per parameter: `ShardedParameters`, gathered once a step
    ParameterShardsPerBlock the same shards, gathered per block and micro-batch and freed after
                            each forward and backward (the engine: `reference.zero.ReshardAfterForward`)

The contract. Every way answers the same questions (`Replicas` gives the defaults):

    method            called by, when                     what it guarantees
    build             `parallelize`, once, on this rank's  the modules the executor runs (FSDP's
                      stages after the pipeline cut        wrapper, or the stages); the way keeps
                                                           what it sharded
    make_optimizer    `ParallelGPT.make_optimizer`, once   the optimizer of what this rank steps on
                                                           (ZeRO-1/2's sharded one, or a plain one)
    forward_backward  `train_step`, once a step            the schedule has run (`run.pipeline`);
                                                           returns (the last stage's loss or None,
                                                           peak activation bytes)
    reduce_gradients  `train_step`, after the last         what must happen between the backward and
                      backward                             the clip, done; returns what it did, for
                                                           the step's trace, or None when it did nothing
    local_grads       `train_step` (fp16), after it        the reduced gradients the optimizer steps
                                                           with (for the overflow check)
    norm_pieces       the clip; post-validation            (the pieces the global norm is taken of,
                                                           each with the parameter whose marks count
                                                           it; the gradients clipping scales)
    clip              `train_step`, when asked             every gradient scaled by one factor from
                                                           the global norm, each number counted once
    modules           checkpoints, resharding              the modules whose named parameters are the
                                                           model's, whole or as this rank's rows
    flat_weights      checkpoints                          the flat shards that hold this rank's
                                                           weights (FSDP's units), else []
    flat_states       checkpoints, resharding              the flat shards whose optimizer state this
                                                           rank holds (ZeRO-1/2's, FSDP's), else []
    whole             `full_state_dict`, `generate`        a context in which the stages hold their
                                                           whole weights
    full_state_dict,  `reference.parallel.gather`,         the same as on one process, every rank
    generate          `reference.parallel.generate`
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from reference import comms
from reference.expert_parallel import expert_parameters, moe_all_reduce_gradients
from reference.parallel.clip import clip_pieces, flat_grad_pieces, grad_pieces, mark_parallel_params
from reference.tensor_parallel import allreduce_sequence_parallel_grads
from reference.zero import FSDP, ReshardAfterForward, ShardedParameters, ShardedSets, ZeroOptimizer

__all__ = ["Replicas", "OptimizerShards", "GradientShards", "WholeModelShards", "ParameterShards",
           "ParameterShardsPerBlock", "data_parallelism"]


def sum_sequence_parallel_grads(pm) -> Optional[str]:
    """The LayerNorms' and row biases' gradients, each tp rank's partial sum over its tokens,
    summed over tp (a no-op without sequence parallelism). Returns what it did, or None."""
    if pm.mesh.tp > 1 and pm.config.sequence_parallel:
        for stage in pm.stages:
            allreduce_sequence_parallel_grads(stage, pm.mesh.group("tp"))
        return "sequence-parallel sum over tp"
    return None


def _joined(*done) -> Optional[str]:
    done = [d for d in done if d]
    return ", then ".join(done) if done else None


class Replicas:
    """Every replica holds every weight of its slice; gradients averaged after the backward."""

    def build(self, model, stages: list, mesh) -> list:
        return stages

    def make_optimizer(self, params, optimizer_class, decay=None, **kwargs):
        return optimizer_class(params, **kwargs)

    def forward_backward(self, pm, run):
        return run.pipeline(None)

    def reduce_gradients(self, pm, optimizer) -> Optional[str]:
        """All-reduce (mean) over dp x cp after the SP sum; experts over their edp group."""
        sp = sum_sequence_parallel_grads(pm)
        mesh = pm.mesh
        if mesh.dp_cp == 1:
            return sp
        if pm.has_experts:
            edp = mesh.group("edp") if mesh.ep > 1 else mesh.group("dp")
            for stage in pm.stages:
                moe_all_reduce_gradients(stage, mesh.group("dp"), edp)
            return _joined(sp, "all-reduce over dp (experts: over edp)")
        # Dense: one flat all-reduce of every gradient over the dp x cp replicas (one bucket:
        # after the last backward there is nothing left to overlap with)
        grads = [p.grad for p in pm.parameters() if p.grad is not None]
        comms.all_reduce_coalesced(grads, group=mesh.group("dp_cp"), divide_by=mesh.dp_cp)
        return _joined(sp, "all-reduce over dp x cp")

    def local_grads(self, pm, optimizer) -> list:
        return [p.grad for p in pm.parameters() if p.grad is not None]

    def clip(self, pm, optimizer, max_norm: float) -> torch.Tensor:
        return clip_pieces(*self.norm_pieces(pm, optimizer), max_norm, pm.mesh)

    def norm_pieces(self, pm, optimizer) -> tuple:
        """What the global norm is taken of and what clipping scales (`reference.parallel.clip`):
        (pieces (parameter whose marks count it, gradient, is a dp shard), gradients to scale)."""
        return grad_pieces(pm.stages)

    def modules(self, pm) -> list:
        return list(pm.stages)

    def flat_weights(self) -> list:
        return []

    def flat_states(self, optimizer) -> list:
        return []

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

    def reduce_gradients(self, pm, optimizer) -> Optional[str]:
        """Only the SP sum over tp, on whole gradients: the mean over dp x cp is the optimizer's
        reduce-scatter, in `step()` (or earlier, in `local_grads` and `clip`, which need it)."""
        return sum_sequence_parallel_grads(pm)

    def local_grads(self, pm, optimizer) -> list:
        optimizer.reduce_gradients()  # the shard's averaged gradients; step() will not reduce again
        return [optimizer.shard.grad] if optimizer.shard.grad is not None else []

    def norm_pieces(self, pm, optimizer) -> tuple:
        optimizer.reduce_gradients()
        # The flat shard mixes tensor-parallel slices, replicas over tp and the tied
        # embedding's second copy: each slice of it is counted by its parameter's marks.
        mark_parallel_params(pm.stages)
        pieces = flat_grad_pieces(optimizer.layout, optimizer.params, optimizer.dp_rank, optimizer.shard.grad)
        return pieces, [optimizer.shard.grad]

    def flat_states(self, optimizer) -> list:
        return [(optimizer.shard, optimizer.layout, optimizer.params,
                 [p.shape for p in optimizer.params], optimizer.group)]


class GradientShards(OptimizerShards):
    """ZeRO-2: the optimizer's hooks reduce-scatter each bucket during the backward."""

    stage = 2

    @torch.no_grad()
    def reduce_gradients(self, pm, optimizer) -> Optional[str]:
        """The last buckets' reduce-scatter; with SP, the sum over tp of the shards' SP slices.
        The hooks reduce-scattered the LayerNorms' and row biases' gradients over dp while
        they were each tp rank's partial sums. The tp ranks' flat shards cover the same ranges,
        so summing those slices over tp gives the sum of the dp means, the dp mean of the sum."""
        optimizer.reduce_gradients()  # the last buckets; step() will not reduce again
        if not (pm.mesh.tp > 1 and pm.config.sequence_parallel):
            return "the last buckets' reduce-scatter over dp x cp"
        pieces = [g for p, g, _ in flat_grad_pieces(optimizer.layout, optimizer.params, optimizer.dp_rank,
                                                     optimizer.shard.grad)
                  if getattr(p, "sequence_parallel", False)]
        # (the same pieces on every tp rank: the same layout) this shard's numbers of SP parameters
        comms.all_reduce_coalesced(pieces, group=pm.mesh.group("tp"))
        return "the last buckets' reduce-scatter over dp x cp, then the shards' SP sum over tp"


class WholeModelShards(Replicas):
    """ZeRO-3 by blocks: `FSDP` wraps the whole model as one stage (tp = pp = ep = 1); the
    executor runs its micro-batches as any stage's, each block gathered for its forward and
    backward, its gradient reduce-scattered during the backward."""

    def __init__(self, dp_cp: int):
        self.dp_cp, self.fsdp, self.model = dp_cp, None, None

    def build(self, model, stages: list, mesh) -> list:
        (whole,) = stages  # pp = 1: one stage, the whole GPT (its own modules and names)
        self.fsdp = FSDP(whole, group=mesh.group("dp_cp"), units=list(whole.h.values()))  # a unit a block
        self.model = model
        return [self.fsdp]

    def make_optimizer(self, params, optimizer_class, decay=None, **kwargs):
        if decay:
            raise ValueError(f"weight_decay={decay} with zero_stage=3 (dp*cp={self.dp_cp}) is not "
                             f"supported: FSDP's flat shards mix matrices (decayed) with biases and "
                             f"LayerNorm gains (not), and per-group decay is not implemented for them; "
                             f"use zero_stage 1 or 2, or weight_decay=0")
        return optimizer_class(params, **kwargs)

    def reduce_gradients(self, pm, optimizer) -> Optional[str]:
        return None  # each block's gradient was reduce-scattered during the backward

    def norm_pieces(self, pm, optimizer) -> tuple:
        mark_parallel_params(self.fsdp.module)  # each unit's flat shard, counted by its parameters
        units = [u for u in self.fsdp.units if u.shard.grad is not None]
        pieces = [piece for u in units for piece in flat_grad_pieces(u.layout, u.params, u.dp_rank, u.shard.grad)]
        return pieces, [u.shard.grad for u in units]

    def modules(self, pm) -> list:
        return [self.fsdp.module]

    def flat_weights(self) -> list:
        return list(self.fsdp.units)

    def flat_states(self, optimizer) -> list:
        return [(u.shard, u.layout, u.params, u.shapes, u.group) for u in self.fsdp.units]

    def full_state_dict(self, pm, of_stages) -> dict:
        return self.fsdp.full_state_dict()  # the GPT's names, gathered unit by unit

    def generate(self, pm, sample, *args):
        # the root unit (embeddings, head) whole for the whole loop; each block is gathered by
        # its own hooks as the GPT runs it
        with self.fsdp.summon_full_params():
            return self.model.generate(*args)


class ParameterShards(Replicas):
    """ZeRO-3 per parameter: every parameter's dim 0 over dp x cp (`ShardedParameters`; experts
    over their edp group, `ShardedSets`; HSDP: over dp_shard, the mean across replicas),
    gathered once before the schedule, reduce-scattered once after it (after the SP sum over
    tp, so each whole gradient is averaged once)."""

    reshard: Optional[ReshardAfterForward] = None  # gathered per block: its action hook

    def __init__(self):
        self.sharded = None

    def build(self, model, stages: list, mesh) -> list:
        params = list({id(p): p for m in stages for p in m.parameters()}.values())
        if mesh.ep > 1:  # experts over the expert-data-parallel group, the rest over dp
            experts = {id(p) for m in stages for p in expert_parameters(m)}
            self.sharded = ShardedSets([
                ShardedParameters([p for p in params if id(p) not in experts], mesh.group("dp")),
                ShardedParameters([p for p in params if id(p) in experts], mesh.group("edp"),
                                  mean_over=mesh.dp)])
        elif mesh.dp_replicate > 1:  # HSDP: rows over dp_shard, the shards' mean across replicas
            self.sharded = ShardedParameters(params, mesh.group("dp_shard"), mean_over=mesh.dp,
                                             replicate_group=mesh.group("dp_replicate"))
        else:
            self.sharded = ShardedParameters(params, mesh.group("dp_cp"))
        return stages

    def forward_backward(self, pm, run):
        self.sharded.gather()
        run.event("gather", "parameters", 0.0)
        return run.pipeline(None)

    def reduce_gradients(self, pm, optimizer) -> Optional[str]:
        """The SP sum over tp, then one reduce-scatter of every gradient to this rank's rows."""
        sp = sum_sequence_parallel_grads(pm)
        self.sharded.reduce_scatter()
        return _joined(sp, "reduce-scatter over dp x cp")

    def whole(self, pm):
        return contextlib.nullcontext() if self.sharded.gathered else self.sharded.gathered_params()


class ParameterShardsPerBlock(ParameterShards):
    """The same shards, gathered per block and micro-batch by the executor's action hook and
    freed after each forward and backward (the engine: `reference.zero.ReshardAfterForward`);
    when the backward ends only the SP sum over tp is left, done on the shards (the same rows
    on every tp rank)."""

    def forward_backward(self, pm, run):
        if self.reshard is None:
            self.reshard = ReshardAfterForward(self.sharded, pm.stages, pm.config.microbatches)
        with self.reshard.step():
            return run.pipeline(self.reshard.hook)

    def reduce_gradients(self, pm, optimizer) -> Optional[str]:
        """Only the SP sum over tp: each block was reduce-scattered after its backward."""
        return sum_sequence_parallel_grads(pm)


def data_parallelism(config, mesh):
    """The one place that reads the ZeRO stage: the way this run keeps its replicas (built on
    this rank's stages by its `build`)."""
    if mesh.dp_cp == 1 or config.zero_stage == 0:
        return Replicas()
    if config.zero_stage == 1:
        return OptimizerShards(mesh.group("dp_cp"))
    if config.zero_stage == 2:
        return GradientShards(mesh.group("dp_cp"))
    if config.zero3_by_blocks:
        return WholeModelShards(mesh.dp_cp)
    return ParameterShardsPerBlock() if config.reshard_after_forward else ParameterShards()
