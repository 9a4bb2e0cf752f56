"""Pipeline parallelism: stages, schedules as data, one executor, measured bubbles.

The model's layers are cut into stages, one (or, interleaved, several) per rank; a batch is
cut into m micro-batches whose activations go down the stages and whose gradients come back
up. A *schedule* says in which order each rank runs its forwards (F), backwards (B), sends
and receives; it is plain data, checked before it runs, drawn, and run by one executor:

    from reference.pipeline_parallel import (build_schedule, split_stages,
                                             local_stages, run_pipeline)
    schedule = build_schedule("1f1b", pp=4, m=8)         # validated: complete, no deadlock
    # or "zb-h1", "zb-h2", or build_schedule("zb-v", 4, 8, virtual=2) ("dualpipev", "dualpipe"): B split into I and W
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

* `actions`: the eight actions, the trace's two all-to-alls in flight (`Action`, `OPS`) and `ScheduleError`, the words every other module speaks;
* `schedules`: `Schedule`, the builders of naive, GPipe, 1F1B and interleaved, and the textbook
  `bubble_formula`;
* `registry`: `build_schedule`, every kind by its name (`BUILDERS`: one table naming each kind's builder);
* `zero_bubble`: ZB-H1, ZB-H2 and ZB-V (Qi et al., 2024), whose backward is split into I (the input's
  gradient) and W (the weights'), and DualPipeV (DualPipe's V-shaped half); `VSchedule`,
  `zero_bubble_formula`, `peak_bytes`;
* `overlap`: DualPipe's overlapped F&B (`overlap_pairs`): a forward and a backward in turns, each
  all-to-all of experts in flight while the other micro-batch computes;
* `dualpipe`: DualPipe in two directions (DeepSeek-V3): micro-batches fed from both ends, every
  stage held twice (`DualPipeSchedule`), the two copies' gradients summed after the step
  (`DualPipeSchedule.sum_copies`, which the executor calls);
* `multistep`: consecutive steps, overlapping (optimizer post-validation) or not: `repeat`,
  `idle_per_step`, and the paper's and DualPipe's bubble formulas;
* `check`: `validate` (completeness, message matching, deadlock), the ideal timeline `simulate`, and
  `bubble_of` any timeline, plugged into every `Schedule` here;
* `stage`: `plan_stages` / `split_stages` (by layers or by parameters), `GPTStage`, and `DelayedStage`
  (a stage that takes a fixed time, to time schedules on a laptop);
* `tied`: the tied embedding's two copies, on the first and last stage, kept equal;
* `costs`: each stage's flops and stored bytes measured (`stage_costs`) against their formulas, and what
  a split backward holds from its I to its W, each linear layer's X and dY (`held_bytes_formula`,
  `held_bytes_per_block`), and the peak per rank of a GPT they give (`peak_bytes_by_rank`);
* `executor`: `run_schedule`, the loop over a rank's steps, each kind of step done by a part of its own:
  `forward_backward` (F and B, the executor's `HANDLERS`), `recompute` (activation checkpointing),
  `messages` (batched point-to-point, sized by a handshake on each chunk's first activation); a
  schedule that runs more brings its own table and mailbox: the zero-bubble ones `split_backward`
  (I and W) and `async_messages`, DualPipe's overlapped F&B `overlap` (`overlap_pairs`); DualPipe's
  brings its `sum_copies`, run after the last step;
* `accounting`: `run_pipeline`, the executor with the schedule validated first and the time and stored
  bytes of every action measured (`PipelineResult`);
* `viz`: timelines, the bubble against its formula, the balance of a cut; `widgets`: the schedule explorer.
"""
from reference.pipeline_parallel.check import TraceEvent, bubble_of, simulate, validate
from reference.pipeline_parallel.costs import (StageCost, held_bytes_formula, held_bytes_of_head,
                                               held_bytes_per_block, peak_bytes_by_rank, stage_costs,
                                               stage_flops_formula, stored_bytes_formula)
from reference.pipeline_parallel.accounting import PipelineResult, run_pipeline
from reference.pipeline_parallel.schedules import KINDS, OPS, Action, Schedule, ScheduleError, bubble_formula
from reference.pipeline_parallel.registry import build_schedule
from reference.pipeline_parallel.stage import (DelayedStage, GPTStage, StageSpec, local_stages, plan_stages,
                                               split_stages)
from reference.pipeline_parallel.tied import build_embedding_group, sync_tied_grads
from reference.pipeline_parallel.zero_bubble import ZB_KINDS, VSchedule, peak_bytes, zero_bubble_formula
from reference.pipeline_parallel.overlap import OverlappedSchedule, overlap_pairs
from reference.pipeline_parallel.dualpipe import DualPipeSchedule

_PICTURES = ("plot_timeline", "plot_bubble_curve", "plot_stage_balance", "plot_overlap")


def __getattr__(name: str):
    """The pictures, loaded when first asked for: a rank that only runs a schedule never imports
    matplotlib (PEP 562's module ``__getattr__``)."""
    if name in _PICTURES:
        from reference.pipeline_parallel import viz

        return getattr(viz, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    "held_bytes_of_head", "peak_bytes", "peak_bytes_by_rank",
    # DualPipe's forward and backward overlapped; DualPipe in two directions
    "OverlappedSchedule", "overlap_pairs", "DualPipeSchedule",
    # pictures
    "plot_timeline", "plot_bubble_curve", "plot_stage_balance", "plot_overlap",
]
