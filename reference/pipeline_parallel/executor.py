"""One executor for every pipeline schedule: a rank walks its steps and does what they say.

`run_schedule` takes this rank's steps (`Schedule.steps`) one after the other: a compute step
by the schedule's table of handlers, a run of SEND/RECV by `reference.pipeline_parallel.messages`.
`HANDLERS`, the executor's own table, runs F and B (`reference.pipeline_parallel.forward_backward`);
a schedule that runs other actions carries its own table (`Schedule.handlers`), built from this
one: the zero-bubble schedules add the split backward's I and W
(`reference.pipeline_parallel.zero_bubble`), DualPipe's overlapped pair F&B, a step of two compute
actions, is added by `reference.pipeline_parallel.overlap`. A ``recorder`` watches every step
(`run_pipeline` measures with it).

It is the one loop over micro-batches of the course: at pp = 1 (one stage, F0 B0 F1 B1 ...) it
runs the composed step's micro-batches (`reference.parallel.train_step`, ZeRO-3 by blocks
included: FSDP wraps the one stage) and the single-process oracle's
(`reference.train.single.accumulate_gradients`), so each micro-batch's loss is built in one
place (`forward_backward`: its share of the step's loss plus the routers' auxiliary losses).
Its callers run it under the one autocast, `reference.model.autocast`.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from reference.loss import TokenMean
from reference.pipeline_parallel.forward_backward import RankState, backward, forward
from reference.pipeline_parallel.messages import Mailbox
from reference.pipeline_parallel.schedules import Schedule
from reference.pipeline_parallel.tied import sync_tied_grads

__all__ = ["run_schedule", "HANDLERS"]

# What each compute action runs: handler(state, action). A schedule whose actions need more
# (`Schedule.handlers`) brings a table built from this one.
HANDLERS = {"F": forward, "B": backward}


def run_schedule(schedule: Schedule, stages: Sequence[torch.nn.Module],
                 inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
                 *, group=None, checkpoint: Union[bool, Sequence[bool]] = False, tied_group=None,
                 batch_shape: Optional[tuple] = None, loss_fn: Optional[Callable] = None,
                 loss_scale: float = 1.0, loss_mean=None, action_hook: Optional[Callable] = None,
                 recorder=None) -> Optional[torch.Tensor]:
    """Run this rank's part of a valid ``schedule`` on the full batch ``inputs`` (B, T) -> ``targets`` (B, T).

    ``stages``: this rank's stages by chunk (`local_stages`); ``group``: the pipeline group. The
    first stage needs ``inputs``, the last ``targets``, a rank with neither ``batch_shape=(B, T)``.
    ``checkpoint``: True, or one flag per chunk (`recompute`). Gradients accumulate into ``.grad``;
    ``tied_group`` sums the tied embedding's gradient over its two copies at the end.
    ``loss_fn``: by default the stage's own ``loss``; ``loss_scale`` multiplies what
    backward starts from (fp16); ``loss_mean`` (`reference.loss`) makes each micro-batch's loss its
    share of the step's (default `TokenMean` of ``targets``: the sum over its counted tokens over
    the batch's count, as one process's mean). ``action_hook(when, action)`` is
    called "before" and "after" every compute action (ZeRO-3 resharding, `reference.zero.fsdp_reshard`);
    ``recorder.step(step, state)`` is a context manager around every step.
    Returns the sum of this rank's shares of the loss (unscaled) on the last stage, None elsewhere.
    """
    if not loss_scale > 0:
        raise ValueError(f"loss_scale must be positive, got {loss_scale!r}")
    rank = _pipeline_rank(schedule, stages, group)
    flags = [bool(checkpoint)] * schedule.virtual if isinstance(checkpoint, bool) else list(checkpoint)
    if len(flags) != schedule.virtual:
        raise ValueError(f"checkpoint needs one flag per chunk ({schedule.virtual}), got {len(flags)}")
    device = next((p.device for st in stages for p in st.parameters()), torch.device("cpu"))
    handlers, steps = schedule.handlers or HANDLERS, schedule.steps(rank)
    # a compute step: one action, or DualPipe's overlapped pair [F, B] (overlap.py)
    unknown = {"F&B" if len(step) == 2 else step[0].op for step in steps if not step[0].is_comm} - handlers.keys()
    if unknown:
        raise ValueError(f"{schedule!r} runs {sorted(unknown)}, which its table of handlers "
                         f"({', '.join(handlers)}) does not name: a schedule with a split backward "
                         f"is a zero_bubble.ZeroBubbleSchedule")
    mb_in, mb_tgt = _micro_batches(inputs, targets, batch_shape, schedule.m, rank, device)
    state = RankState(schedule, stages, rank, device, mb_in, mb_tgt, flags, loss_mean or TokenMean.of(targets),
                      loss_scale, loss_fn, (schedule.mailbox or Mailbox)(group, rank, device))
    hook = action_hook or (lambda when, action: None)
    watch = recorder.step if recorder is not None else (lambda step, state: nullcontext())
    if schedule.pp > 1:
        dist.barrier(group=group)  # a common start, so the ranks' traces line up
    for step in steps:
        with watch(step, state):
            if step[0].is_comm:
                state.mail.exchange(step)  # every SEND and RECV of the step at once
            else:
                for a in step:
                    hook("before", a)
                handlers["F&B" if len(step) == 2 else step[0].op](state, *step)
                for a in step:
                    hook("after", a)
    state.mail.finish()  # sends a zero-bubble schedule left going
    if schedule.sum_copies is not None:  # a stage held twice (DualPipe's): its copies' gradients summed
        schedule.sum_copies(stages, group, tied_group)
    sync_tied_grads(stages, tied_group)  # nothing without a group
    return torch.stack(state.losses).sum() if state.losses else None


def _pipeline_rank(schedule: Schedule, stages: Sequence[torch.nn.Module], group) -> int:
    """This rank's place in the pipeline group, once the group and the stages fit the schedule."""
    pp, v = schedule.pp, schedule.virtual
    distributed = dist.is_available() and dist.is_initialized()
    if pp > 1 and not distributed:
        raise RuntimeError(f"a pipeline of pp={pp} ranks needs torch.distributed initialised "
                           f"(start the ranks with reference.runtime.launch)")
    # pp = 1 without a group: a pipeline of one, whatever else runs in parallel
    alone = not distributed or (pp == 1 and group is None)
    rank, size = (0, 1) if alone else (dist.get_rank(group), dist.get_world_size(group))
    if size != pp:
        raise ValueError(f"{schedule!r} is for pp={pp} ranks, but the pipeline group has {size} "
                         f"(world_size={dist.get_world_size() if distributed else 1})")
    if len(stages) != v:
        raise ValueError(f"{schedule!r} runs virtual={v} chunks per rank, got {len(stages)} stages")
    for c, st in enumerate(stages):
        spec, s = getattr(st, "spec", None), schedule.stage(rank, c)
        if spec is not None and (spec.stage != schedule.model_stage(s) or spec.head != schedule.ends(s)[1]):
            raise ValueError(f"pipeline rank {rank} chunk {c} should run model stage {s} of "
                             f"{schedule.n_stages}, got {spec}")
    return rank


def _micro_batches(inputs, targets, batch_shape, m: int, rank: int, device) -> tuple:
    """``inputs`` and ``targets`` (B, T) cut into m micro-batches along B, each its own storage
    (a clone, so that its bytes are counted alone); None where the rank has none."""
    shape = next((t.shape for t in (inputs, targets) if t is not None), batch_shape)
    if shape is None:
        raise ValueError(f"pipeline rank {rank} got neither inputs nor targets: pass batch_shape=(B, T)")
    if shape[0] % m:
        raise ValueError(f"the batch of {shape[0]} sequences does not split into m={m} equal micro-batches")
    return tuple(None if t is None else [x.to(device).clone() for x in t.split(shape[0] // m)]
                 for t in (inputs, targets))
