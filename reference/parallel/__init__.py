"""Composing the parallelisms: one GPT trained with dp x cp x tp x pp (+ ep, ZeRO) at once.

    from reference.parallel import ParallelConfig, parallelize, train_step
    pm = parallelize(GPT(config), mesh, ParallelConfig.debug_3d())   # this rank's part
    result = train_step(pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3), idx, targets)

This is the layer above every parallelism package: it may import all of them, and none
of them imports it. Where each part lives:

* `reference.parallel.config`: `ParallelConfig`, the degrees and options of a run,
  validated against the world size and the model before any rank starts;
* `reference.parallel.parallelize`: `parallelize(model, mesh, config)`, tensor, context,
  expert and pipeline parallelism applied from outside in a fixed order (`ParallelGPT`);
* `reference.parallel.context`: context parallelism as a mesh dimension: ring or Ulysses
  attention over the cp group, true positions, and each cp rank's tokens of a batch;
* `reference.parallel.step`: `train_step`, one training step for any combination
  (pipeline schedule, gradient synchronisation, clipping, optimizer);
* `reference.parallel.data_parallelism`: how the replicas keep weights and gradients, one
  object per way (replicas averaged once, ZeRO-1 and ZeRO-2 shards, ZeRO-3 by blocks, per
  parameter, resharded after forward), chosen once by `parallelize` (`pm.data_parallel`):
  `train_step`, `full_state_dict` and `generate` ask it and never read the ZeRO stage;
* `reference.parallel.scaler`: `DynamicLossScaler`, fp16's loss scaling, every rank
  agreeing on each skipped step;
* `reference.parallel.clip`: `clip_grad_norm_`, the global gradient norm over every
  shard counted once (tensor-parallel slices, pipeline stages, tied embeddings, data-
  parallel replicas, ZeRO and FSDP shards, experts), and `mark_parallel_params`;
* `reference.parallel.gather`: `full_state_dict`, every split undone, on every rank;
* `reference.parallel.generate`: `generate`, sampling from the parallel model (the plain
  model's tokens for the same seed);
* `reference.parallel.estimate`: memory, bubble and bytes per GPU of a configuration,
  from formulas (`estimate_memory`: the tensors and activations a stage's GPU holds and
  composed ZeRO-3's peak by phase; `estimate_traffic`: the bytes per link);
  `reference.parallel.explorer`: which configurations fit a cluster;
  `reference.parallel.placement`: which traffic crosses nodes for an order of the axes;
* `reference.parallel.golden`: the debug run's committed losses;
* `reference.parallel.viz`: a composed step drawn rank by rank, costs of configurations.

Pictures and widgets (`viz`, `explorer`) and the golden run are imported from their
modules: they load matplotlib and ipywidgets, which a rank does not need.
"""
from reference.parallel.clip import clip_grad_norm_, mark_parallel_params
from reference.parallel.config import ParallelConfig
from reference.parallel.context import context_parallel_batch
from reference.parallel.estimate import estimate
from reference.parallel.gather import full_state_dict
from reference.parallel.generate import generate
from reference.parallel.parallelize import ParallelGPT, parallelize
from reference.parallel.step import StepResult, train_step
from reference.runtime import preload

preload(__name__)  # the composed GPT's ranks import all of it: once, in the fork server

__all__ = [
    "ParallelConfig", "parallelize", "ParallelGPT", "train_step", "StepResult",
    "clip_grad_norm_", "mark_parallel_params", "full_state_dict", "generate", "estimate",
    "context_parallel_batch",
]
