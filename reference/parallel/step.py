"""One training step for any combination of dp, cp, tp, pp, ep and ZeRO.

    pm = parallelize(GPT(config), mesh, ParallelConfig.debug_3d())
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    result = train_step(pm, optimizer, idx, targets)        # idx, targets: the GLOBAL batch
    result.loss                                              # the global mean, on every rank

What happens, in order, on every rank:

1. its data: the global batch (B, T) split over the dp ranks, B / dp sequences each, and
   with context parallelism each sequence over the cp ranks, T / cp tokens each (the tp
   ranks of one dp and cp rank see the same tokens; only the first pipeline stage reads
   the ids and only the last the targets);
2. the pipeline schedule over `microbatches` micro-batches (`run_pipeline`; a pipeline of one
   stage when pp = 1), gradients accumulating in `.grad` across micro-batches, with the
   tied embedding's gradient summed over the first and last stage, under autocast for bf16;
3. gradient synchronisation, once per step, after the last micro-batch's backward (no
   reduction before it: that is what `no_sync` buys DDP): the sequence-parallel gradients
   summed over tp, then dense gradients averaged over dp (over dp x cp, the ``dp_cp``
   group, with context parallelism: every cp rank's loss is the mean over its equal share
   of the tokens) and expert gradients over the expert-data-parallel group (ZeRO-1/2 do
   their own reduce-scatter in `step()`, ZeRO-2 during backward, so with SP its shard's
   sequence-parallel slices are summed over tp afterwards; composed ZeRO-3, `pm.sharded`, reduce-scatters each
   whole gradient into its dim-0 shard here, having all-gathered the parameters before 2;
   with ``reshard_after_forward`` the executor's action hook gathers and reduce-scatters per
   block and micro-batch instead, `reference.zero.fsdp_reshard`, and only the SP sum over tp
   is left here, done on the shards);
4. global-norm clipping over every shard (`reference.parallel.clip`), when asked;
5. the optimizer step;
6. the loss made the global mean on every rank: the last stage's mean over micro-batches,
   averaged over dp x cp and sent to every pipeline rank.

`StepResult.trace` lists what the rank did with start and end times (the pipeline's F, B and
messages, then the gradient reduction and the optimizer step), for `plot_step`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from reference import comms
from reference.expert_parallel import moe_all_reduce_gradients
from reference.model import lm_loss
from reference.parallel.context import context_parallel_batch
from reference.pipeline_parallel import run_pipeline
from reference.tensor_parallel import allreduce_sequence_parallel_grads, vocab_parallel_cross_entropy
from reference.zero.fsdp_reshard import ReshardAfterForward

__all__ = ["StepResult", "StepEvent", "train_step", "local_batch"]


@dataclass(frozen=True)
class StepEvent:
    """One thing a rank did in a step: ``kind`` in F, B, SEND, RECV, gather
    (composed ZeRO-3's parameters), reduce, optimizer."""

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


def _autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _loss_fn(pm):
    if pm.mesh.tp == 1:
        return lm_loss
    group, vocab = pm.mesh.group("tp"), pm.model_config.vocab_size

    def loss(logits_shard, targets):  # (B/m, T, V_pad / tp): the vocab stays split
        return vocab_parallel_cross_entropy(logits_shard, targets, group, vocab)
    return loss


def _run_fsdp(pm, idx, targets, device, loss_scale: float = 1.0):
    """ZeRO-3 (pp = 1): micro-batches through the FSDP-wrapped model, gradients accumulating."""
    model, m = pm.fsdp, pm.config.microbatches
    losses = []
    for x, y in zip(idx.split(idx.shape[0] // m), targets.split(targets.shape[0] // m)):
        with _autocast(pm.config.precision, device):
            logits, _ = model(x.to(device))
            loss = lm_loss(logits, y.to(device))
        (loss * (loss_scale / m)).backward()
        losses.append(loss.detach().float())
    return torch.stack(losses).mean()


def _resharding(pm) -> Optional[ReshardAfterForward]:
    """Composed ZeRO-3 with ``reshard_after_forward=True``: gathered and reduce-scattered per
    micro-batch by the executor's action hook (made once, kept in ``pm.extra``); else None."""
    if getattr(pm, "sharded", None) is None or not pm.config.reshard_after_forward:
        return None
    if "reshard" not in pm.extra:
        pm.extra["reshard"] = ReshardAfterForward(pm.sharded, pm.stages, pm.config.microbatches)
    return pm.extra["reshard"]


def _synchronise_gradients(pm, optimizer) -> None:
    mesh = pm.mesh
    if mesh.tp > 1 and pm.config.sequence_parallel:
        for stage in pm.stages:
            allreduce_sequence_parallel_grads(stage, mesh.group("tp"))
    if getattr(pm, "sharded", None) is not None:
        pm.sharded.reduce_scatter()  # after the SP sum above: each whole gradient averaged once
        return
    if mesh.dp_cp == 1 or pm.fsdp is not None or pm.config.zero_stage in (1, 2):
        return  # nothing to average, or the ZeRO optimizer / FSDP reduce-scatters itself
    if pm.has_experts:
        edp = mesh.group("edp") if mesh.ep > 1 else mesh.group("dp")
        for stage in pm.stages:
            moe_all_reduce_gradients(stage, mesh.group("dp"), edp)
        return
    # Dense: one flat all-reduce of every gradient (the bucket is the whole model here:
    # the step's reduction runs after the last backward, so there is nothing to overlap),
    # over every replica of the weights: dp x cp ranks (the dp group when cp = 1).
    grads = [p.grad for p in pm.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comms.all_reduce(flat, group=mesh.group("dp_cp"))
    flat /= mesh.dp_cp
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def _sum_sequence_parallel_shard(pm, optimizer) -> None:
    """ZeRO-2 with sequence parallelism. Its hooks reduce-scatter every gradient over dp during
    backward, the LayerNorms' and row biases' too, while those are still each tp rank's partial
    sums (their tokens only); `allreduce_sequence_parallel_grads` then finds no `.grad` left.
    The tp ranks of one dp rank lay out the same TP-local shapes, so their flat shards cover the
    same ranges: summing those parameters' slices of the shard over tp gives the sum of the
    dp means, which is the dp mean of the sum (both are linear)."""
    from reference.parallel.clip import flat_shard_pieces

    optimizer.reduce_gradients()  # the last buckets; step() will not reduce again
    pieces = [g for p, g in flat_shard_pieces(optimizer.layout, optimizer.params, optimizer.dp_rank,
                                              optimizer.shard.grad)
              if getattr(p, "sequence_parallel", False)]
    if not pieces:  # the same on every tp rank: the same layout
        return
    flat = torch.cat(pieces)  # (k,) this shard's numbers of sequence-parallel parameters
    comms.all_reduce(flat, group=pm.mesh.group("tp"))
    offset = 0
    for g in pieces:
        g.copy_(flat[offset: offset + g.numel()])
        offset += g.numel()


def _global_loss(pm, loss: Optional[torch.Tensor], device) -> torch.Tensor:
    mesh = pm.mesh
    value = (loss.detach().float() if loss is not None else torch.zeros((), device=device)).clone()
    if mesh.world_size == 1:
        return value.cpu()
    value = value.reshape(1).to(device)
    if mesh.pp > 1:  # the last stage has it: send it up the pipeline
        last = mesh.group_ranks_of(mesh.rank, "pp")[-1]
        comms.broadcast(value, src=last, group=mesh.group("pp"))
    if mesh.dp_cp > 1:  # every dp and cp rank's mean over the same number of tokens
        comms.all_reduce(value, group=mesh.group("dp_cp"))
        value /= mesh.dp_cp
    return value.reshape(()).cpu()


def _local_grads(pm, optimizer) -> list:
    """The gradients this rank steps with: the shard's for ZeRO-1/2, else the parameters'."""
    if pm.config.zero_stage in (1, 2) and pm.mesh.dp_cp > 1:
        optimizer.reduce_gradients()  # step() will not reduce again
        return [optimizer.shard.grad] if optimizer.shard.grad is not None else []
    return [p.grad for p in pm.parameters() if p.grad is not None]


def train_step(pm, optimizer, idx: torch.Tensor, targets: torch.Tensor, *,
               max_norm: Optional[float] = None, scaler=None) -> StepResult:
    """One step on the global batch ``idx``, ``targets`` (B, T), the same on every rank.

    With fp16 the loss is scaled by ``scaler`` (default ``pm.scaler``, a
    `DynamicLossScaler`); a step with an inf or NaN on any rank is skipped everywhere."""
    from reference.runtime import device as rank_device

    device = rank_device()
    scaler = scaler if scaler is not None else getattr(pm, "scaler", None)
    scale = scaler.scale if scaler is not None else 1.0
    x, y = local_batch(pm, idx, targets)
    optimizer.zero_grad(set_to_none=True)
    trace: list[StepEvent] = []
    t0 = time.perf_counter()
    peak = 0
    reshard = None
    if pm.fsdp is not None:
        loss = _run_fsdp(pm, x, y, device, scale)
        trace.append(StepEvent("F", "forward and backward", 0.0, time.perf_counter() - t0))
    else:
        reshard = _resharding(pm)
        if getattr(pm, "sharded", None) is not None and reshard is None:  # ZeRO-3: whole for the step
            pm.sharded.gather()
            trace.append(StepEvent("gather", "parameters", 0.0, time.perf_counter() - t0))
        offset = time.perf_counter() - t0  # the executor's clock starts about here
        with _autocast(pm.config.precision, device), \
                (reshard.step() if reshard is not None else contextlib.nullcontext()):
            result = run_pipeline(
                pm.schedule, pm.stages,
                x.to(device) if pm.is_first_stage else None,
                y.to(device) if pm.is_last_stage else None,
                group=pm.mesh.group("pp") if pm.mesh.pp > 1 else None,
                checkpoint=pm.config.activation_checkpointing, tied_group=pm.tied_group,
                batch_shape=tuple(x.shape), loss_fn=_loss_fn(pm), loss_scale=scale,
                action_hook=reshard.hook if reshard is not None else None)
        loss, peak = result.loss, result.peak_activation_bytes
        for e in result.trace:
            kind = e.action.op if e.action.op in ("F", "B") else e.action.op.split("_")[0]
            trace.append(StepEvent(kind, str(e.action), offset + e.start, offset + e.end))
    start = time.perf_counter() - t0
    if reshard is None:
        _synchronise_gradients(pm, optimizer)
    elif pm.mesh.tp > 1 and pm.config.sequence_parallel:
        # resharded: every gradient is its shard's dp mean already; the SP sum over tp, once,
        # on the shards (a tp rank's shard holds the same rows on every tp rank)
        for stage in pm.stages:
            allreduce_sequence_parallel_grads(stage, pm.mesh.group("tp"))
    if (pm.config.zero_stage == 2 and pm.mesh.dp_cp > 1 and pm.mesh.tp > 1
            and pm.config.sequence_parallel):
        _sum_sequence_parallel_shard(pm, optimizer)
    trace.append(StepEvent("reduce", "gradients", start, time.perf_counter() - t0))
    overflow = False
    if scaler is not None:  # unscale, and agree across every rank whether to step
        overflow = scaler.unscale_and_check(_local_grads(pm, optimizer))
        scaler.update(overflow)
    norm = None
    if max_norm is not None and not overflow:
        from reference.parallel.clip import clip_grad_norm_, mark_parallel_params

        if pm.config.zero_stage in (1, 2) and pm.mesh.dp_cp > 1:
            optimizer.reduce_gradients()  # the shards' averaged gradients; step() won't redo it
            # The flat shard mixes tensor-parallel slices, replicas over tp and the tied
            # embedding's second copy: each slice of it is counted by its parameter's marks.
            mark_parallel_params(pm.stages)
            norm = clip_grad_norm_(optimizer, max_norm, pm.mesh)
        else:
            norm = clip_grad_norm_(pm.stages, max_norm, pm.mesh)
    start = time.perf_counter() - t0
    if overflow:
        optimizer.zero_grad(set_to_none=True)  # also clears a ZeRO optimizer's reduced flag
    else:
        optimizer.step()
    trace.append(StepEvent("optimizer", "skipped" if overflow else "step", start,
                           time.perf_counter() - t0))
    return StepResult(loss=_global_loss(pm, loss, device), grad_norm=norm, trace=trace,
                      peak_activation_bytes=peak, skipped=overflow,
                      loss_scale=scale if scaler is not None else None)


def barrier_all(mesh) -> None:
    """Every rank of the mesh waits for the others (between measured steps)."""
    if mesh.world_size > 1:
        dist.barrier()
