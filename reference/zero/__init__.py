"""ZeRO and FSDP: data parallelism that shards the training state instead of replicating it.

    from reference.zero import ZeroOptimizer, FSDP
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)  # ZeRO-1/2
    model = FSDP(GPT(config))                                                    # ZeRO-3

The three stages of Rajbhandari et al. (2020), each keeping 1/N of something per rank:
stage 1 the optimizer state (P_os), stage 2 the gradients too (P_os+g), stage 3
the parameters as well (P_os+g+p). Where each part lives:

* `reference.zero.shard`: the flat, padded layout every stage stores parameters in
  (`FlatLayout`: Psi numbers padded to P = N * S, rank r owning shard r), and its
  buckets (`FlatBucket`);
* `reference.zero.optimizer`: `ZeroOptimizer`, stages 1 and 2, a drop-in for the
  optimizer of a model every rank holds whole (a `torch.optim.Optimizer`, so LR
  schedulers and `state_dict` work); its docstring has the bytes and the
  memory table; `reference.zero.groups`: its weight-decay groups (matrices decayed,
  biases and LayerNorms not), applied on ranges of its flat shard;
* `reference.zero.reducer`: stage 2's gradient path, `BucketReducer`: buckets of
  the flat layout reduce-scattered from gradient hooks during backward, so a
  rank holds its shard and one bucket of gradient at most;
* `reference.zero.units`: stage 3's one engine, `Unit`: a list of parameters sharded at
  rest, all-gathered whole while used, freed, and its gradients reduce-scattered, over a
  layout object (flat, or each tensor's dim 0: `RowShards`); the only place stage 3
  all-gathers and reduce-scatters. The front-ends below choose the units and when to free;
* `reference.zero.fsdp`: `FSDP`, one flat unit per block (`FlatShards`), all-gathered
  just before it runs (with prefetch) and freed after, mixed precision and CPU offload;
* `reference.zero.fsdp_param`: `ShardedParameters`, stage 3 per parameter (the FSDP2
  design): each tensor split along dim 0 over dp, so a tensor-parallel slice can be
  sharded again; the stage one unit, gathered once per step, which composes with TP,
  pipelines and activation checkpointing (what `reference.parallel.parallelize` uses
  there); `ShardedSets` with experts: dense tensors sharded over dp, each expert over its
  expert-data-parallel group;
* `reference.zero.fsdp_reshard`: `ReshardAfterForward`, the same shards cut into a unit
  per block, gathered per block and micro-batch instead (FSDP2's
  ``reshard_after_forward=True``: 3 m transfers a step for holding about one block whole;
  `ParallelConfig.reshard_after_forward`);
* `reference.zero.adam8bit`: `Adam8bit`, AdamW whose two moments are stored
  block-wise quantised in 8 bits (Dettmers et al., 2022): about 2 bytes of state
  per parameter instead of 8, a memory saving (data parallelism never
  communicates optimizer state);
* `reference.zero.viz`: what each rank holds at each stage, measured bytes against
  the formula, the memory calculator's picture;
* `reference.zero.widgets`: the memory calculator, an ipywidgets explorer of the
  formulas in `reference.memory`.

The formulas themselves (bytes per rank for each stage and precision) live in
`reference.memory`, in the core, because the 3D GPT and the performance lab use
them too; so do the peak of gradient memory inside a step
(`memory.zero_peak_grad_bytes`) and its measurement (`memory.PeakMemory`).
Pictures and widgets are imported from their modules (they load matplotlib and
ipywidgets, which a rank does not need).
"""
from reference.zero.adam8bit import Adam8bit
from reference.zero.fsdp import FSDP
from reference.zero.fsdp_param import ShardedParameters, ShardedSets
from reference.zero.fsdp_reshard import ReshardAfterForward
from reference.zero.optimizer import ZeroOptimizer
from reference.zero.shard import FlatBucket, FlatLayout, trainable_unique

__all__ = [
    "ZeroOptimizer", "FSDP", "ShardedParameters", "ShardedSets", "ReshardAfterForward", "FlatLayout",
    "FlatBucket", "trainable_unique", "Adam8bit",
]
