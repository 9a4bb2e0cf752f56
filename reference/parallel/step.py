"""One training step for any combination of dp, cp, tp, pp, ep and ZeRO.

    pm = parallelize(GPT(config), mesh, ParallelConfig.debug_3d())
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    result = train_step(pm, optimizer, idx, targets)        # idx, targets: the GLOBAL batch
    result.loss                                              # the global mean, on every rank

What happens, in order, on every rank:

1. its data (`local_batch`): B / dp sequences of the global batch (B, T), and with context
   parallelism T / cp tokens of each (the tp ranks of one dp and cp rank see the same tokens);
2. the pipeline schedule over `microbatches` micro-batches (`run_pipeline`; one stage when
   pp = 1), gradients accumulating in `.grad`, the tied embedding's summed over the first and
   last stage, under autocast for bf16 and fp16;
3. gradient synchronisation, once, after the last backward (what `no_sync` buys DDP), by the
   run's data-parallel way (`pm.data_parallel`, `reference.parallel.data_parallelism`): the
   sequence-parallel gradients summed over tp, then each gradient averaged over its replicas
   (dp x cp; experts over their expert-data-parallel group), by an all-reduce or ZeRO's
   reduce-scatter;
4. global-norm clipping over whatever this rank holds (`reference.parallel.clip`), when asked;
5. the optimizer step (skipped on every rank when fp16 overflows on any); with
   ``optimizer_post_validation`` the step comes first and the checks of 4 after it, a step that
   fails them undone (`reference.parallel.post_validation`);
6. the loss made the global mean on every rank: the last stage's, averaged over dp x cp.

The loss is one process's (`reference.loss.TokenMean`): every counted token's loss (targets
of -100 count for nothing) over the global batch's count of them; each micro-batch on each
rank backpropagates its sum times dp x cp / count, which the gradient average over dp x cp
turns into the whole batch's mean. `StepResult.trace` lists what the rank did, with start
and end times, for `plot_step`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from reference import comms
from reference.context_parallel.apply import context_parallel_batch
from reference.loss import counted_tokens, step_mean
from reference.model import autocast, lm_loss
from reference.pipeline_parallel import run_pipeline
from reference.tensor_parallel import vocab_parallel_cross_entropy

__all__ = ["StepResult", "StepEvent", "StepRun", "train_step", "local_batch"]


@dataclass(frozen=True)
class StepEvent:
    """One thing a rank did in a step: ``kind`` in F, B, I, W, SEND, RECV, A2A (an overlapped F&B
    pair's all-to-all in flight), gather (composed ZeRO-3's parameters), reduce, optimizer."""

    kind: str
    label: str
    start: float
    end: float


@dataclass
class StepResult:
    loss: torch.Tensor                       # the global mean loss (0-dim, fp32), on every rank
    grad_norm: Optional[torch.Tensor] = None  # before clipping, when clipping was asked
    trace: list = field(default_factory=list)
    peak_activation_bytes: int = 0
    skipped: bool = False                    # fp16: an inf or NaN somewhere, the step was skipped
    loss_scale: Optional[float] = None       # fp16: the scale this step used
    tokens: int = 0                          # the step's counted tokens (targets not -100)


def local_batch(pm, idx: torch.Tensor, targets: torch.Tensor):
    """This rank's share of the global batch: rows [dp_rank * B/dp, (dp_rank + 1) * B/dp),
    and of each row its cp rank's T / cp tokens (`context_parallel_batch`)."""
    B = idx.shape[0]
    dp, r = pm.mesh.dp, pm.mesh.dp_rank
    if B % (dp * pm.config.microbatches):
        raise ValueError(f"global batch {B} does not divide into dp={dp} x microbatches="
                         f"{pm.config.microbatches}")
    rows = slice(r * (B // dp), (r + 1) * (B // dp))
    if pm.mesh.cp == 1:
        return idx[rows], targets[rows]
    return context_parallel_batch(idx[rows], targets[rows], pm.mesh.cp, pm.mesh.cp_rank,
                                  pm.config.cp_kind)


def _loss_fn(pm):
    if pm.mesh.tp == 1:
        return lm_loss
    group, vocab = pm.mesh.group("tp"), pm.model_config.vocab_size

    def loss(logits_shard, targets, reduction="mean"):  # (B/m, T, V_pad / tp): the vocab stays split
        return vocab_parallel_cross_entropy(logits_shard, targets, group, vocab, reduction=reduction)
    return loss


def _global_loss(pm, loss: Optional[torch.Tensor], device) -> torch.Tensor:
    mesh = pm.mesh
    value = (loss.detach().float() if loss is not None else torch.zeros((), device=device)).clone()
    if mesh.world_size == 1:
        return value.cpu()
    value = value.reshape(1).to(device)
    s = pm.schedule
    lasts = {s.rank_of(k) for k in range(s.n_stages) if s.ends(k)[1]}
    if mesh.pp > 1 and len(lasts) > 1:  # DualPipe: each end has the loss of what the other fed
        comms.all_reduce(value, group=mesh.group("pp"))
    elif mesh.pp > 1:  # the last stage's rank has it (ZB-V's: pipeline rank 0): to every stage
        last = mesh.group_ranks_of(mesh.rank, "pp")[s.rank_of(s.n_stages - 1)]
        comms.broadcast(value, src=last, group=mesh.group("pp"))
    if mesh.dp_cp > 1:  # every dp and cp rank's mean over the same number of tokens
        comms.all_reduce(value, group=mesh.group("dp_cp"))
        value /= mesh.dp_cp
    return value.reshape(()).cpu()


class StepRun:
    """What the data-parallel way's `forward_backward` is handed: this rank's batch, the loss scale,
    the step's clock and trace, and `pipeline(hook)`, which runs the schedule (under the
    precision's autocast) with ``hook`` called around each of its actions."""

    def __init__(self, pm, x, y, device, loss_scale: float, loss_mean):
        self.pm, self.x, self.y, self.device, self.loss_scale = pm, x, y, device, loss_scale
        self.loss_mean = loss_mean  # each micro-batch's share of the step's loss (reference.loss)
        self.trace: list[StepEvent] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, kind: str, label: str, start: float) -> None:
        self.trace.append(StepEvent(kind, label, start, self.now()))

    def pipeline(self, hook) -> tuple:
        """(the last stage's mean loss or None, the peak of activation bytes)."""
        pm, x, y = self.pm, self.x, self.y
        offset = self.now()  # the executor's clock starts about here
        with autocast(pm.config.precision, self.device.type):  # the oracle's too
            result = run_pipeline(
                pm.schedule, pm.stages,
                x.to(self.device) if pm.is_first_stage else None,
                y.to(self.device) if pm.is_last_stage else None,
                group=pm.mesh.group("pp") if pm.mesh.pp > 1 else None,
                checkpoint=pm.config.activation_checkpointing, tied_group=pm.tied_group,
                batch_shape=tuple(x.shape), loss_fn=_loss_fn(pm), loss_scale=self.loss_scale,
                loss_mean=self.loss_mean, action_hook=hook)
        for e in result.trace:
            kind = e.action.op if e.action.op in ("F", "B") else e.action.op.split("_")[0]
            self.trace.append(StepEvent(kind, str(e.action), offset + e.start, offset + e.end))
        return result.loss, result.peak_activation_bytes


def _checked_step(pm, optimizer, max_norm, scaler, run) -> tuple:
    """Steps 4 and 5: the global checks, then the optimizer; (the norm or None, overflowed)."""
    dp, overflow = pm.data_parallel, False
    if scaler is not None:  # unscale, and agree across every rank whether to step
        overflow = scaler.finish_check(scaler.start_check(dp.local_grads(pm, optimizer)))
    norm = dp.clip(pm, optimizer, max_norm) if max_norm is not None and not overflow else None  # 4
    start = run.now()
    if overflow:
        optimizer.zero_grad(set_to_none=True)  # also clears a ZeRO optimizer's reduced flag
    else:
        optimizer.step()                                # 5
    run.event("optimizer", "skipped" if overflow else "step", start)
    return norm, overflow


def train_step(pm, optimizer, idx: torch.Tensor, targets: torch.Tensor, *,
               max_norm: Optional[float] = None, scaler=None) -> StepResult:
    """One step on the global batch ``idx``, ``targets`` (B, T), the same on every rank; with fp16
    the loss is scaled by ``scaler`` (default ``pm.scaler``, a `DynamicLossScaler`)."""
    from reference.runtime import device as rank_device

    device, dp = rank_device(), pm.data_parallel
    scaler = scaler if scaler is not None else getattr(pm, "scaler", None)
    scale = scaler.scale if scaler is not None else 1.0
    x, y = local_batch(pm, idx, targets)
    optimizer.zero_grad(set_to_none=True)
    mean = step_mean(pm.config.loss_mean, targets, pm.config.microbatches, pm.mesh.dp_cp)
    run = StepRun(pm, x, y, device, scale, mean)
    loss, peak = dp.forward_backward(pm, run)          # 1-2: the batch through the schedule
    start = run.now()
    reduced = dp.reduce_gradients(pm, optimizer)       # 3: once, after the last backward
    if reduced:  # (ZeRO-1 without SP: nothing here, the optimizer's step reduce-scatters)
        run.event("reduce", reduced, start)
    if pm.config.optimizer_post_validation:  # 5 before 4: step, then check, undo on a failure
        from reference.parallel.post_validation import post_validated_step  # this option's own module

        norm, overflow = post_validated_step(pm, optimizer, max_norm, scaler, run)
    else:
        norm, overflow = _checked_step(pm, optimizer, max_norm, scaler, run)
    return StepResult(loss=_global_loss(pm, loss, device), grad_norm=norm, trace=run.trace,  # 6
                      peak_activation_bytes=peak, skipped=overflow,
                      loss_scale=scale if scaler is not None else None, tokens=counted_tokens(targets))
