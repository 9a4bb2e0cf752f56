"""Composing the parallelisms: one GPT trained with dp x cp x tp x pp (+ ep, ZeRO) at once.

    from reference.parallel import ParallelConfig, parallelize, train_step
    pm = parallelize(GPT(config), mesh, ParallelConfig.debug_3d())   # this rank's part
    result = train_step(pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3), idx, targets)

This is the layer above every parallelism package: it may import all of them, and none
of them imports it. Where each part lives:

* `config`: `ParallelConfig`, the degrees and options of a run, validated before any rank starts;
* `parallelize`: tensor, context, expert and pipeline parallelism applied from outside in a
  fixed order (`ParallelGPT`; context parallelism as a mesh dimension is
  `reference.context_parallel.apply`);
* `step`: `train_step`, one training step for any combination; `post_validation`: the optimizer
  step taken before the global checks (clip norm, fp16 overflow) and undone when they fail;
* `data_parallelism`: how the replicas keep weights and gradients, one object per way (plain
  replicas, ZeRO-1/2 shards, ZeRO-3 by blocks, per parameter, resharded after forward),
  `pm.data_parallel`, which `train_step`, `full_state_dict` and `generate` ask;
* `scaler`: `DynamicLossScaler`, fp16's loss scaling, every rank agreeing on each skipped step;
* `clip`: `clip_grad_norm_`, the global gradient norm over every shard counted once;
* `gather`: `full_state_dict`, every split undone, on every rank;
* `generate`: sampling from the parallel model (the plain model's tokens for the same seed);
* `estimate`: memory, bubble, bytes and step time per GPU of a configuration, from formulas
  (`estimate_memory`, `estimate_traffic`); `explorer`: which configurations fit a cluster;
  `placement`: which traffic crosses nodes for an order of the axes;
* `golden`: the debug run (its model, data and 8-rank run; its committed losses are
  `reference.train.golden`'s); `viz`: a composed step drawn rank by rank.

`viz` and `explorer` (which load matplotlib and ipywidgets, which a rank does not need) and
`golden` are imported from their modules."""
from reference.context_parallel.apply import context_parallel_batch
from reference.parallel.clip import clip_grad_norm_, mark_parallel_params
from reference.parallel.config import ParallelConfig
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
