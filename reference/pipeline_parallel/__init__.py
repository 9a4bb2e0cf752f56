"""Pipeline parallelism: stages, schedules as data, one executor, measured bubbles.

The model's layers are cut into stages, one (or, interleaved, several) per
rank; a batch is cut into m micro-batches that flow through the stages
forward and back, activations going down the pipeline and their gradients
coming back up by point-to-point messages. A *schedule* says in which order
each rank runs its forwards (F), backwards (B), sends and receives; it is
plain data, checked before it runs, drawn, and run by one executor:

    from reference.pipeline_parallel import (build_schedule, split_stages,
                                             local_stages, run_pipeline)
    schedule = build_schedule("1f1b", pp=4, m=8)         # validated: complete, no deadlock
    # or "zb-h1", or build_schedule("zb-v", 4, 8, virtual=2) ("dualpipev"): B split into I and W
    schedule.actions(0)       # rank 0: [F0, SEND_F0->1, F1, SEND_F1->1, ...]
    schedule.bubble_fraction(), schedule.peak_in_flight(0), schedule.plot()

    # on every rank (inside reference.runtime.launch):
    mesh = Mesh(pp=4).build_groups()                      # reference.mesh.Mesh
    tied = build_embedding_group(mesh)                   # once: wte and lm_head's two copies
    stages = local_stages(split_stages(model, 4), 4, mesh.pp_rank, schedule)  # ZB-V: a V
    result = run_pipeline(schedule, stages, idx, targets, group=mesh.pp_group, tied_group=tied)
    result.loss               # mean over micro-batches, on the last stage
    result.trace              # every action with its start and end

Where each part lives:

* `reference.pipeline_parallel.actions`: the six actions (`Action`, `OPS`) and
  `ScheduleError`, the words every other module speaks;
* `reference.pipeline_parallel.schedules`: `Schedule`, `build_schedule` (naive,
  GPipe, 1F1B, interleaved 1F1B, and the kinds of `BUILDERS`) and the textbook
  `bubble_formula`;
* `reference.pipeline_parallel.zero_bubble`: the zero-bubble schedules, ZB-H1 and
  ZB-V (Qi et al., 2024), whose backward is split into I (the input's gradient)
  and W (the weights'), W put where 1F1B idles, and DualPipeV (DeepSeek-V3's
  DualPipe on the V); two chunks per rank in a V (`VSchedule`); their bubble
  (`zero_bubble_formula`) and the peak of held bytes (`peak_bytes`);
* `reference.pipeline_parallel.check`: `validate` (completeness, message matching,
  deadlock), the ideal timeline `simulate`, and `bubble_of` any timeline; the package
  plugs it into every schedule (`Schedule.validate`, `Schedule.simulate`), so that a
  schedule's own module need not import it;
* `reference.pipeline_parallel.stage`: `plan_stages` / `split_stages` (by layers or by
  parameters, embedding and head optionally on stages of their own),
  `GPTStage`, and `DelayedStage` (a stage that takes a fixed time, to time schedules
  on a laptop);
* `reference.pipeline_parallel.tied`: the tied embedding's two copies, on the first
  and last stage, kept equal (`build_embedding_group`, `sync_tied_grads`);
* `reference.pipeline_parallel.costs`: `stage_costs` measures each stage's flops (time
  balance) and stored bytes (memory balance) on one micro-batch, against
  `stage_flops_formula` and `stored_bytes_formula`, and what a split backward holds
  from its I to its W (`held_bytes_formula`; per block and for the head, at any tp,
  `held_bytes_per_block` and `held_bytes_of_head`, which `reference.parallel.estimate` counts with);
* `reference.pipeline_parallel.executor`: `run_schedule`, the loop over a rank's
  steps; each kind of step is done by a part of its own:
  - `reference.pipeline_parallel.forward_backward`: what F and B do to one
    micro-batch on one chunk (the loss on the last stage, divided by m);
  - `reference.pipeline_parallel.split_backward`: what I and W do: I the input's
    gradient alone, catching the gradient at each split point on its way; W, later,
    the weights' gradients from there (`WeightPass`);
  - `reference.pipeline_parallel.recompute`: activation checkpointing, F without the
    autograd graph and B running it again with the random state F saw;
  - `reference.pipeline_parallel.messages`: the batched point-to-point messages,
    sized from the stages' actual outputs by a handshake on micro-batch 0;
    `reference.pipeline_parallel.async_messages`: the zero-bubble schedules' mailbox,
    whose sends are waited for at the end and whose messages to itself (ZB-V's turn)
    are handed over in memory;
* `reference.pipeline_parallel.accounting`: `run_pipeline`, the executor's loop with
  the schedule validated first and a `Recorder` plugged into it, which measures the
  trace of every action and the activation bytes each F stores for its B
  (`PipelineResult`);
* `reference.pipeline_parallel.viz`: timelines, the bubble against its formula, and
  the time and memory balance of a cut into stages;
* `reference.pipeline_parallel.widgets`: the schedule explorer (pp, m, kind and
  virtual stages -> timeline and bubble).
"""
from reference.pipeline_parallel.check import TraceEvent, bubble_of, simulate, validate
from reference.pipeline_parallel.costs import (StageCost, held_bytes_formula, held_bytes_of_head,
                                               held_bytes_per_block, stage_costs, stage_flops_formula,
                                               stored_bytes_formula)
from reference.pipeline_parallel.accounting import PipelineResult, run_pipeline
from reference.pipeline_parallel.schedules import (KINDS, OPS, Action, Schedule, ScheduleError, bubble_formula,
                                 build_schedule)
from reference.pipeline_parallel.stage import (DelayedStage, GPTStage, StageSpec, local_stages, plan_stages,
                                               split_stages)
from reference.pipeline_parallel.tied import build_embedding_group, sync_tied_grads
from reference.pipeline_parallel.viz import plot_bubble_curve, plot_stage_balance, plot_timeline
from reference.pipeline_parallel.zero_bubble import ZB_KINDS, VSchedule, peak_bytes, zero_bubble_formula
from reference.pipeline_parallel import check, executor, schedules, split_backward, zero_bubble  # noqa: E402

# The zero-bubble schedules and the two halves of a split backward join the one
# `build_schedule` and the one executor here, and the checker gives every schedule its
# `validate` and ideal timeline, so that 1F1B's files need not import them.
schedules.BUILDERS.update(zero_bubble.BUILDERS)
executor.COMPUTE.update(split_backward.COMPUTE)
schedules.Schedule.checker = check

__all__ = [
    # schedules as data
    "Action", "Schedule", "ScheduleError", "build_schedule", "bubble_formula", "KINDS", "OPS",
    "validate", "simulate", "bubble_of", "TraceEvent",
    # stages
    "StageSpec", "plan_stages", "GPTStage", "split_stages", "local_stages", "DelayedStage",
    "build_embedding_group", "sync_tied_grads",
    # what a stage costs
    "StageCost", "stage_costs", "stored_bytes_formula", "stage_flops_formula",
    # the executor
    "run_pipeline", "PipelineResult",
    # zero-bubble schedules
    "ZB_KINDS", "VSchedule", "zero_bubble_formula", "held_bytes_formula", "held_bytes_per_block",
    "held_bytes_of_head", "peak_bytes",
    # pictures
    "plot_timeline", "plot_bubble_curve", "plot_stage_balance",
]
