"""Optimizer post-validation (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", section 4):
step first, check afterwards, undo the step when the check fails.

    ParallelConfig(pp=4, microbatches=8, schedule="zb-h2", optimizer_post_validation=True)
    # trainer JSON: "parallelism": {"optimizer_post_validation": true}

A synchronous step waits, after the last backward, for two global checks before any rank may
step: the gradient norm that clipping needs (one all-reduce of every rank's sum of squares) and,
with fp16, whether any rank's gradients hold an inf or a NaN (one all-reduce of a flag). Every
pipeline stage waits there for the slowest, which is what keeps ZB-H2 and ZB-V from a bubble of
zero (`reference.pipeline_parallel.multistep` measures it). Post-validation assumes that the
checks pass, as they almost always do in a stable run:

1. each rank starts the two all-reduces without waiting for them (``async_op``), keeps an exact
   copy of what the step changes (its parameters and its optimizer state), and steps at once;
2. then it completes the all-reduces: every rank gets the same flag and norm;
3. an overflow (fp16): every rank puts the copy back, the step is skipped, as a synchronous run
   skips it; a norm above ``max_norm``: every rank puts the copy back, scales its gradients by
   ``max_norm / (norm + 1e-6)`` and steps again, as a synchronous run steps once.

The copy is restored bit for bit (`Backup`), and the checks are computed exactly as the
synchronous step computes them (`reference.parallel.clip.local_norm`, the same all-reduce), so a
post-validated run ends with the same weights as a synchronous one, bit for bit. What it costs:
one copy of the parameters and of the optimizer state on every rank (the authors' implementation
keeps the same for its exact mode; it can also undo an Adam step arithmetically, with rounding),
and, when a check fails, a second optimizer step.

Where the course differs from the paper: the paper completes the checks while the next step's
first forwards run (the partial norms travel down the pipeline with them) and rolls back before
that step's own update. Here the checks' all-reduces run while the eager optimizer step computes,
and complete at the end of the same `train_step`: the result (loss, norm, skipped) is final when
`train_step` returns, but the next step's forwards do not overlap the check. The ideal timeline
of overlapping steps is the simulator's (`multistep`). Refused with ZeRO (its sharded step
all-gathers the parameters; undoing it is not built), and with experts balanced by a bias (it
moves in an optimizer pre-hook, outside the copy).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from reference import comms
from reference.expert_parallel.bias_balance import biased_routers
from reference.parallel.clip import clipped, global_norm, local_norm, scale_gradients

__all__ = ["Backup", "post_validated_step"]


class Backup:
    """An exact copy of what ``optimizer.step()`` changes: every parameter it updates and its
    state (Adam's moments and step count); `restore` puts them back bit for bit."""

    @torch.no_grad()
    def __init__(self, optimizer):
        self.params = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
        self.values = [p.detach().clone() for p in self.params]
        self.state = {id(p): copy.deepcopy(optimizer.state[p]) for p in self.params if p in optimizer.state}

    @torch.no_grad()
    def restore(self, optimizer) -> None:
        for p, value in zip(self.params, self.values):
            p.copy_(value)
            if id(p) in self.state:
                optimizer.state[p] = self.state[id(p)]
            else:  # the first step created it: gone again
                optimizer.state.pop(p, None)


def post_validated_step(pm, optimizer, max_norm: Optional[float], scaler, run) -> tuple:
    """Steps 4 and 5 of `reference.parallel.step.train_step` the other way round (module
    docstring): (the global norm before clipping or None, whether fp16 overflowed)."""
    if any(biased_routers(stage) for stage in pm.stages):
        raise ValueError("optimizer_post_validation with bias-balanced experts (bias_update_rate > 0): "
                         "their bias moves in an optimizer pre-hook, outside what a rollback restores; "
                         "turn one of them off")
    if scaler is None and max_norm is None:  # nothing to check: nothing to undo
        start = run.now()
        optimizer.step()
        run.event("optimizer", "step", start)
        return None, False
    dp, norm_work = pm.data_parallel, None
    # fp16: the synchronous step's own check (flag, all-reduce, unscale), its all-reduce not waited for
    check = scaler.start_check(dp.local_grads(pm, optimizer)) if scaler is not None else None
    if max_norm is not None:  # clip_grad_norm_'s sum of squares, its all-reduce not waited for
        norm_part, targets, _ = local_norm(*dp.norm_pieces(pm, optimizer), pm.mesh)
        if norm_part.dim() == 1:
            norm_work = comms.all_reduce(norm_part, async_op=True)
    start = run.now()
    backup = Backup(optimizer)
    optimizer.step()                                   # eager: assume the checks pass
    run.event("optimizer", "step (eager)", start)
    start = run.now()
    if norm_work is not None:
        norm_work.wait()
    overflow = scaler.finish_check(check) if check is not None else False
    norm = None
    if overflow:                                       # every rank: undo, skip
        backup.restore(optimizer)
        optimizer.zero_grad(set_to_none=True)
        run.event("optimizer", "rolled back (overflow)", start)
    elif max_norm is not None:
        norm = global_norm(norm_part)
        if clipped(norm, max_norm):                    # every rank: undo, clip, step again
            backup.restore(optimizer)
            scale_gradients(targets, norm, max_norm)
            optimizer.step()
            run.event("optimizer", "rolled back, clipped, stepped", start)
    return norm, overflow
