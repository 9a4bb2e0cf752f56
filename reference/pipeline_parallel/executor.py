"""One executor for every pipeline schedule.

`run_pipeline(schedule, stages, inputs, targets, group=pp_group)` walks this
rank's steps of the schedule (`Schedule.steps`) and does exactly what they say:

* F: forward the micro-batch through the chunk's stage; keep what backward
  needs; on the last stage compute the micro-batch's loss with the stage's own
  ``loss`` (`GPTStage.loss`: the vocab-parallel cross-entropy when the head is
  split over the vocabulary by tensor parallelism), divided by m so the
  gradients add up to those of the full-batch mean;
* B: backward from the received output gradient (or from the loss);
* a run of SEND/RECV: one ``batch_isend_irecv`` holding all of them, waited on
  together, metered (`reference.pipeline_parallel.messages`). What a message
  holds is read from the stage's actual output, never assumed: (B / m, T / tp, C)
  under sequence parallelism, bf16 from a stage that hands on bf16; a handshake
  on micro-batch 0 tells the receiver.

Activation checkpointing (``checkpoint=True``, or one flag per local chunk): F
runs without building the autograd graph and keeps only the stage's input; B
runs the forward again, with the random state F saw, then backward. "The
random state" is every stream the stage draws dropout masks from: the default
generator (and the GPU's), and under tensor parallelism the per-rank stream of
sharded regions (`reference.tensor_parallel.rng.RNGStates`); a recomputation
with other masks would differentiate another network than the one whose output
was sent on. Stored bytes fall from the whole stage's activations to its input,
for one more forward per micro-batch.

Measured, not assumed: every action's start and end (seconds from a common
start; the ranks meet at a barrier first) go into ``result.trace``, and the
bytes each F leaves stored for its B are counted by a saved-tensors hook:
every tensor autograd saves (parameters excluded; each storage counted once)
plus the tensors the executor itself keeps. ``result.peak_activation_bytes``
is the most held at once, a recomputing B's extra bytes included.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from reference.model import lm_loss
from reference.pipeline_parallel.check import TraceEvent
from reference.pipeline_parallel.messages import Mailbox
from reference.pipeline_parallel.schedules import Schedule
from reference.pipeline_parallel.stage import sync_tied_grads
from reference.tensor_parallel.rng import RNGStates

__all__ = ["run_pipeline", "PipelineResult"]


@dataclass
class PipelineResult:
    """What one rank saw running one schedule (one training step's forward and backward)."""

    loss: Optional[torch.Tensor]  # mean loss over the micro-batches, on the last stage; else None
    trace: list[TraceEvent] = field(default_factory=list)
    peak_in_flight: int = 0  # most (micro-batch, chunk) activations held at once
    peak_activation_bytes: int = 0
    activation_bytes: dict = field(default_factory=dict)  # (mb, chunk) -> bytes its F stored
    recompute_bytes: int = 0  # most bytes one checkpointed B's recomputation saved (0 without)


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for backward inside the block.

    Parameters are left out (they are stored whatever the schedule), and so is
    anything in ``exclude`` (storage pointers already counted elsewhere). ``params``,
    when given, are looked at as each tensor is saved: parameters whose storage an
    action hook frees and regathers (ZeRO-3 resharding) move between actions."""

    def __init__(self, param_ptrs: set, exclude: Sequence[torch.Tensor] = (), params=None):
        self.skip = set(param_ptrs) | {t.untyped_storage().data_ptr() for t in exclude}
        self.params = params
        self.storages: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() in self.skip or (self.params is not None and st.data_ptr() in
                                          {p.untyped_storage().data_ptr() for p in self.params}):
            return
        self.storages[st.data_ptr()] = st.nbytes()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        def pack(t):
            self.add(t)
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _run_stage(stage, x, last: bool, target, m: int, loss_fn):
    """Forward one micro-batch: (out, aux, scaled loss or None, loss or None)."""
    out = stage(x)
    out, aux = out if isinstance(out, tuple) else (out, None)
    if not last:
        return out, aux, None, None
    loss = (loss_fn or getattr(stage, "loss", None) or lm_loss)(out, target)
    total = loss if aux is None else loss + aux
    return out, aux, total / m, loss  # / m: the mean over micro-batches


def run_pipeline(schedule: Schedule, stages: Sequence[torch.nn.Module],
                 inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
                 *, group=None, checkpoint: Union[bool, Sequence[bool]] = False, tied_group=None,
                 batch_shape: Optional[tuple] = None, loss_fn: Optional[Callable] = None,
                 loss_scale: float = 1.0,
                 action_hook: Optional[Callable[[str, object], None]] = None) -> PipelineResult:
    """Run this rank's part of ``schedule`` on the full batch ``inputs`` (B, T) -> ``targets`` (B, T).

    ``stages``: this rank's stage modules indexed by chunk (`local_stages`).
    ``group``: the pipeline group (``mesh.group("pp")``); pipeline rank = rank in it.
    The first stage needs ``inputs``, the last ``targets``; a rank with neither
    passes ``batch_shape=(B, T)``. Gradients accumulate into the stages'
    ``.grad`` (zero them before); with ``tied_group`` (`build_embedding_group`) the
    tied embedding's gradient is summed over its two copies at the end.
    ``loss_fn(logits, targets)``: the last stage's loss; by default the stage's
    own ``loss`` method (`GPTStage.loss`), else `lm_loss`. ``loss_scale`` multiplies
    what backward starts from (fp16's loss scaling; the gradients come out scaled by it).
    ``action_hook(when, action)``, if given, is called with "before" and "after" around
    every F and B (composed ZeRO-3 resharding between micro-batches,
    `reference.zero.fsdp_reshard`, gathers and frees parameters there).
    Returns a `PipelineResult`; its ``loss`` is the mean over the m micro-batches (unscaled).
    """
    schedule.validate()
    pp, m, v = schedule.pp, schedule.m, schedule.virtual
    if not loss_scale > 0:
        raise ValueError(f"loss_scale must be positive, got {loss_scale!r}")
    divisor = m / loss_scale  # backward starts from (loss + aux) * loss_scale / m
    distributed = dist.is_available() and dist.is_initialized()
    if pp > 1 and not distributed:
        raise RuntimeError(f"a pipeline of pp={pp} ranks needs torch.distributed initialised "
                           f"(start the ranks with reference.runtime.launch)")
    # pp = 1 without a group: a pipeline of one, whatever else runs in parallel
    alone = not distributed or (pp == 1 and group is None)
    rank = 0 if alone else dist.get_rank(group)
    size = 1 if alone else dist.get_world_size(group)
    if size != pp:
        world = dist.get_world_size() if distributed else 1
        raise ValueError(f"{schedule!r} is for pp={pp} ranks, but the pipeline group has {size} "
                         f"(world_size={world})")
    if len(stages) != v:
        raise ValueError(f"{schedule!r} runs virtual={v} chunks per rank, got {len(stages)} stages")
    last_stage = schedule.n_stages - 1
    for c, st in enumerate(stages):
        spec, s = getattr(st, "spec", None), schedule.stage(rank, c)
        if spec is not None and (spec.stage != s or spec.head != (s == last_stage)):
            raise ValueError(f"pipeline rank {rank} chunk {c} should run model stage {s} of "
                             f"{schedule.n_stages}, got {spec}")
    flags = [bool(checkpoint)] * v if isinstance(checkpoint, bool) else list(checkpoint)
    if len(flags) != v:
        raise ValueError(f"checkpoint needs one flag per chunk ({v}), got {len(flags)}")

    shape = next((t.shape for t in (inputs, targets) if t is not None), batch_shape)
    if shape is None:
        raise ValueError(f"pipeline rank {rank} got neither inputs nor targets: pass batch_shape=(B, T)")
    B = shape[0]  # (B, T): micro-batches cut along B
    if B % m:
        raise ValueError(f"the batch of {B} sequences does not split into m={m} equal micro-batches")
    params = [p for st in stages for p in st.parameters()]
    device = params[0].device if params else torch.device("cpu")
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    moving = params if action_hook is not None else None  # storages a hook may free and regrow
    # clone: a micro-batch's own storage, so its bytes are counted alone
    mb_in = [t.to(device).clone() for t in inputs.split(B // m)] if inputs is not None else None
    mb_tgt = [t.to(device).clone() for t in targets.split(B // m)] if targets is not None else None

    held: dict = {}      # (mb, chunk) -> what B needs
    mail = Mailbox(group, rank, device)
    losses, result = [], PipelineResult(loss=None)
    held_bytes = 0

    def forward(mb, c):
        nonlocal held_bytes
        s, st = schedule.stage(rank, c), stages[c]
        if s == 0:
            x = mb_in[mb]  # (B / m, T) token ids
        else:
            x = mail.take("F", mb, c).requires_grad_()  # (B / m, T, C), or (B / m, T / tp, C) under SP
        target = mb_tgt[mb] if s == last_stage else None
        entry = {"x": x}
        with _SavedBytes(param_ptrs, params=moving) as saved:
            if flags[c]:
                entry["rng"] = RNGStates.capture(st, device)  # every stream F draws from
                with torch.no_grad():
                    out, _, _, loss = _run_stage(st, x, s == last_stage, target, divisor, loss_fn)
            else:
                out, aux, total, loss = _run_stage(st, x, s == last_stage, target, divisor, loss_fn)
                entry.update(aux=aux, total=total)
                if s < last_stage:  # backward starts from it; the last stage's starts from the loss
                    entry["out"] = out
                    saved.add(out)
        saved.add(x)
        if loss is not None:
            losses.append(loss.detach())
        if s < last_stage:
            mail.post("F", mb, c, out.detach())
        entry["bytes"] = saved.bytes
        held[(mb, c)] = entry
        held_bytes += saved.bytes
        result.activation_bytes[(mb, c)] = saved.bytes
        result.peak_in_flight = max(result.peak_in_flight, len(held))
        result.peak_activation_bytes = max(result.peak_activation_bytes, held_bytes)

    def backward(mb, c):
        nonlocal held_bytes
        s, st = schedule.stage(rank, c), stages[c]
        entry = held.pop((mb, c))
        x = entry["x"]
        if flags[c]:  # recompute the forward with the random state F saw
            now = RNGStates.capture(st, device)
            entry["rng"].restore()  # the same dropout masks as the forward that was sent on
            try:
                with _SavedBytes(param_ptrs, exclude=[x], params=moving) as again:
                    out, aux, total, _ = _run_stage(st, x, s == last_stage,
                                                    mb_tgt[mb] if s == last_stage else None, divisor, loss_fn)
            finally:
                now.restore()  # the streams go on as if nothing had been drawn again
            result.recompute_bytes = max(result.recompute_bytes, again.bytes)
            result.peak_activation_bytes = max(result.peak_activation_bytes, held_bytes + again.bytes)
        else:
            out, aux, total = entry.get("out"), entry["aux"], entry["total"]
        if s == last_stage:
            tensors, grads = [total], [None]
        else:
            tensors, grads = [out], [mail.take("B", mb, c)]
            if aux is not None and aux.requires_grad:  # the stage's share of the aux loss
                tensors.append(aux)
                grads.append(torch.full_like(aux, 1.0 / divisor))
        keep = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        if keep:
            torch.autograd.backward([t for t, _ in keep], [g for _, g in keep])
        if s > 0:
            mail.post("B", mb, c, x.grad if x.grad is not None else torch.zeros_like(x))
        held_bytes -= entry["bytes"]

    if not alone and pp > 1:
        dist.barrier(group=group)  # a common start, so the ranks' traces line up
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for step in schedule.steps(rank):
        start = time.perf_counter() - t0
        a = step[0]
        if a.is_comm:
            mail.exchange(step)
        else:
            if action_hook is not None:
                action_hook("before", a)
            (forward if a.op == "F" else backward)(a.mb, a.chunk)
            if action_hook is not None:
                action_hook("after", a)
        sync()  # GPU work is asynchronous: time it to its end
        end = time.perf_counter() - t0
        result.trace += [TraceEvent(rank, x, start, end) for x in step]
    if tied_group is not None:
        sync_tied_grads(stages, tied_group)
    if losses:
        result.loss = torch.stack(losses).mean()
    return result
