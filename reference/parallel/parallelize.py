"""`parallelize(model, mesh, config)`: the plain GPT, made this rank's part of a 3D (4D) run.

Every rank builds the same plain `GPT` (same seed) and calls `parallelize` with the same
`ParallelConfig`. The model's code is untouched: each parallelism is applied from outside, in
a fixed order, each the identity when its degree is 1:

1. **tensor parallelism** (+ sequence parallelism) first, while the model is still whole, so
   the swap sees every block and names stay the model's own;
2. **context parallelism** (`reference.context_parallel.apply`): after TP, because it wraps the
   projections TP made;
3. **expert parallelism**: each MoE layer keeps this rank's experts (with SP it routes the
   sequence gathered over tp, `reference.expert_parallel.sequence_parallel`);
4. **the pipeline cut** into pp x virtual_stages stages, after every module swap, because it
   hands the final modules out; with tied weights the first and last stages form the
   "embedding group" that sums the tied gradient;
5. **activation checkpointing**: how the executor runs each local stage;
6. **data parallelism / ZeRO** last, on what this rank finally holds, over the ranks holding
   the same shard (dp x cp, the ``dp_cp`` group; experts over the expert-data-parallel group).

ZeRO-3 comes in two forms, the configuration's `zero3_engine` (printed by the trainer's
``--check``). "blocks": `FSDP` wraps the whole model (tp = pp = ep = 1) and gathers each block
per micro-batch, forward and backward (one block whole at a time; about 3 m transfers a step,
one more gather per block with activation checkpointing). "parameters": each parameter of this
rank's stages is sharded along dim 0 (`ShardedParameters`, the FSDP2 design), gathered once
before the step and kept whole through every micro-batch, its gradient reduce-scattered once
after the last backward (torchtitan's ``reshard_after_forward=False`` under a pipeline). "auto"
(the default) picks blocks wherever they can run. The data-parallel way builds either
(`reference.parallel.data_parallelism`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from reference.context_parallel.apply import apply_context_parallel_dim
from reference.expert_parallel import MoE, register_bias_update, shard_experts
from reference.expert_parallel.sequence_parallel import sequence_parallel_experts
from reference.model import GPT, weight_decay_groups
from reference.parallel.config import ParallelConfig
from reference.parallel.data_parallelism import Replicas, data_parallelism
from reference.pipeline_parallel import (build_embedding_group, build_schedule, local_stages,
                                         overlap_pairs, split_stages)
from reference.tensor_parallel import apply_tensor_parallel

__all__ = ["ParallelGPT", "parallelize", "count_experts"]


def count_experts(model: nn.Module) -> Optional[int]:
    """Experts per MoE layer of `model` (None for a dense model)."""
    sizes = {len(m.experts) for m in model.modules() if type(m) is MoE}
    if len(sizes) > 1:
        raise ValueError(f"MoE layers with different numbers of experts: {sorted(sizes)}")
    return sizes.pop() if sizes else None


@dataclass
class ParallelGPT:
    """What one rank holds after `parallelize`: its stages (chunks), groups and schedule."""

    config: ParallelConfig
    mesh: object
    model_config: object
    stages: list                     # this rank's pipeline chunks (GPTStage), or [FSDP] for ZeRO-3 by blocks
    schedule: object                 # the pipeline schedule (a pipeline of 1 when pp = 1)
    tied_group: Optional[object] = None
    has_experts: bool = False
    data_parallel: object = field(default_factory=Replicas)  # how the replicas keep weights, gradients
    scaler: Optional[object] = None  # fp16: the DynamicLossScaler train_step uses

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds model stage 0 (the schedule places the stages: ZB-V in a V;
        under DualPipe both ends do)."""
        return any(self.schedule.ends(s)[0] for s in self._stage_numbers)

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last model stage (under ZB-V, pipeline rank 0 does)."""
        return any(self.schedule.ends(s)[1] for s in self._stage_numbers)

    @property
    def _stage_numbers(self) -> set:
        return {self.schedule.stage(self.mesh.pp_rank, c) for c in range(self.schedule.virtual)}

    def parameters(self) -> list[nn.Parameter]:
        """This rank's distinct parameters (a tied weight once)."""
        return list({id(p): p for module in self.stages for p in module.parameters()}.values())

    def named_parameters(self):
        seen = set()
        for module in self.stages:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def train(self, mode: bool = True) -> "ParallelGPT":
        for module in self.stages:
            module.train(mode)
        return self

    def eval(self) -> "ParallelGPT":
        return self.train(False)

    def make_optimizer(self, optimizer_class=torch.optim.AdamW, weight_decay=None, **kwargs):
        """The optimizer of this rank's parameters, as the run's data-parallel way makes it: ZeRO's
        sharded one for zero_stage 1-2, a plain one otherwise (under ZeRO-3 the parameters are
        the shards). With `weight_decay`, the single-process trainer's groups
        (`reference.train.single.make_optimizer`): matrices decayed, biases and gains not."""
        params = [p for p in self.parameters() if p.requires_grad]
        if weight_decay is not None:
            params = weight_decay_groups(params, weight_decay)
        optimizer = self.data_parallel.make_optimizer(params, optimizer_class, weight_decay, **kwargs)
        # experts balanced by a bias: moved before each step by the step's loads over dp; under
        # DualPipe and over the stage's other copy (rank pp - 1 - r), which routed the other
        # direction's micro-batches: both ranks list their routers in the model's order
        peer = self.schedule.copy_peer(self.mesh.pp_rank)
        copies = (self.mesh.group("pp"), peer) if peer is not None else None
        stages = sorted(self.stages, key=lambda st: st.spec.stage) if copies else self.stages
        register_bias_update(optimizer, nn.ModuleList(stages), self.mesh.group("dp") if self.mesh.dp > 1 else None,
                             copies)
        return optimizer


def parallelize(model: GPT, mesh, config: ParallelConfig, *, batch=None, seed: int = 0) -> ParallelGPT:
    """Apply ``config`` to ``model`` on this rank (every rank calls it; ``mesh.build_groups()``
    must have run). ``batch`` (B, T), when given, is validated too. Returns a `ParallelGPT`."""
    if not isinstance(model, GPT):
        raise TypeError(f"parallelize expects a reference.model.GPT, got {type(model).__name__}")
    n_experts = count_experts(model)
    config.validate(mesh.world_size, model.config, batch=batch, n_experts=n_experts)
    if (mesh.dp, mesh.tp, mesh.pp, mesh.ep, mesh.cp) != (config.dp, config.tp, config.pp, config.ep,
                                                         config.cp):
        raise ValueError(f"the mesh ({mesh}) and the config ({config}) disagree on the degrees")
    # 1. tensor (+ sequence) parallelism: swaps modules inside the whole model
    apply_tensor_parallel(model, mesh, sequence_parallel=config.sequence_parallel, seed=seed,
                          experts_gathered=True)  # step 3 gathers the sequence for MoE layers
    # 2. context parallelism: attention over the cp group, this rank's positions
    apply_context_parallel_dim(model, mesh, config)
    # 3. expert parallelism: each MoE layer keeps this rank's experts
    if config.ep > 1:
        shard_experts(model, mesh.group("ep"))
    if config.sequence_parallel and config.tp > 1:  # MoE layers route the gathered sequence
        sequence_parallel_experts(model, mesh.group("tp"))
    # one stage (pp = 1) accumulates as F0 B0 F1 B1 ...: 1F1B with no warm-up, as DeepSpeed does
    schedule_kind = config.schedule if config.pp > 1 else "1f1b"
    schedule = build_schedule(schedule_kind, config.pp, config.microbatches,
                              virtual=config.virtual_stages)
    if config.overlap_forward_backward:  # DualPipe's F&B pairs, each run overlapped (validated above)
        schedule = overlap_pairs(schedule)
    common = dict(config=config, mesh=mesh, model_config=model.config, schedule=schedule,
                  has_experts=n_experts is not None)
    if config.precision == "fp16":  # the loss scale every rank agrees on: fp16's own module
        from reference.parallel.scaler import DynamicLossScaler

        common["scaler"] = DynamicLossScaler()
    # 4. the pipeline cut (a pipeline of one stage when pp = 1)
    stages = split_stages(model, config.pp, config.n_stages // config.pp,
                          embedding_stage=config.embedding_stage, head_stage=config.embedding_stage)
    mine = local_stages(stages, config.pp, mesh.pp_rank, schedule)  # ZB-V: rank r holds r and 2 pp - 1 - r
    # DualPipe: ranks 0 and pp - 1 each hold both ends (the executor sums every weight's two copies);
    # the ranks of the second half hold copies whose norm the first half counts (`clip`)
    peer = schedule.copy_peer(mesh.pp_rank)
    tied = build_embedding_group(mesh) if config.pp > 1 and peer is None else None
    for stage in mine:
        stage.counted_elsewhere = peer is not None and mesh.pp_rank > peer
    # 5. activation checkpointing is the executor's per-chunk flag (see `train_step`);
    # 6. data parallelism / ZeRO on exactly these local parameters: the way builds what it
    #    shards (ZeRO-3 by blocks: FSDP wraps the one stage; per parameter: each along dim 0)
    way = data_parallelism(config, mesh)
    return ParallelGPT(stages=way.build(model, mine, mesh), tied_group=tied, **common, data_parallel=way)
