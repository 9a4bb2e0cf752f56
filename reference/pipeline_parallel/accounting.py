"""`run_pipeline`: the executor's run, its schedule checked first and every step measured.

A `Recorder` watches each step of the executor's loop and writes into a `PipelineResult` the
trace (every action's start and end, in seconds from a barrier before the first step) and the
bytes each F leaves stored (`reference.memory.SavedBytes`: every tensor autograd saves,
parameters excluded, each storage once, plus the input and output F keeps), held until the
micro-batch's B or I; from an I to its W the micro-batch holds instead what its W needs (the X
and dY of each linear layer, `split_backward.WeightStore`). A checkpointed B or I runs the
forward again: its bytes join the peak while it runs.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from reference.memory import SavedBytes
from reference.pipeline_parallel.check import TraceEvent
from reference.pipeline_parallel.executor import run_schedule
from reference.pipeline_parallel.schedules import Schedule

__all__ = ["run_pipeline", "PipelineResult", "Recorder"]


@dataclass
class PipelineResult:
    """What one rank saw running one schedule (one training step's forward and backward)."""

    loss: Optional[torch.Tensor]  # mean loss over the micro-batches, on the last stage; else None
    trace: list[TraceEvent] = field(default_factory=list)
    peak_in_flight: int = 0  # most (micro-batch, chunk) activations held at once
    peak_activation_bytes: int = 0
    activation_bytes: dict = field(default_factory=dict)  # (mb, chunk) -> bytes its F stored
    recompute_bytes: int = 0  # most bytes one checkpointed B's recomputation saved (0 without)


def run_pipeline(schedule: Schedule, stages: Sequence[torch.nn.Module], inputs: Optional[torch.Tensor] = None,
                 targets: Optional[torch.Tensor] = None, **options) -> PipelineResult:
    """`run_schedule` (and its ``options``) of ``schedule``, validated first, every step recorded."""
    recorder = Recorder(stages, moving=options.get("action_hook") is not None)
    recorder.result.loss = run_schedule(schedule.validate(), stages, inputs, targets, recorder=recorder, **options)
    return recorder.result


class Recorder:
    """The executor's ``recorder``: each step timed into ``result.trace``, and the bytes each
    (micro-batch, chunk) holds from its F to its B or W. ``moving``: parameters may be freed and
    regathered between actions (an action hook), so a saved tensor is checked as it is saved."""

    def __init__(self, stages: Sequence[torch.nn.Module], moving: bool = False):
        params = [p for st in stages for p in st.parameters()]
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.moving = params if moving else None
        self.result, self.held, self.bytes, self.t0 = PipelineResult(loss=None), {}, 0, None

    @contextmanager
    def step(self, step: Sequence, state):
        """Around one step of a rank (``state``, its `RankState`): its time, and what its action keeps or frees."""
        a, key = step[0], (step[0].mb, step[0].chunk)
        self.t0 = time.perf_counter() if self.t0 is None else self.t0  # the first step: the common start
        start, kept = time.perf_counter() - self.t0, state.kept.get(key)
        with SavedBytes(self.param_ptrs, [kept.x] if kept and kept.x is not None else [], self.moving) as saved:
            yield  # (a B or I runs a checkpointed forward again here; its input is counted already)
        if state.device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: time it to its end
        end = time.perf_counter() - self.t0
        pieces = state.__dict__.pop("overlap_pieces", None)  # an overlapped F&B's chunks and all-to-alls
        self.result.trace += [TraceEvent(state.rank, b, start, end) for b in step] if pieces is None else \
            [TraceEvent(state.rank, b, s - self.t0, e - self.t0) for b, s, e in pieces]
        if a.op == "F":
            kept = state.kept[key]
            for t in (kept.x, kept.out):  # what F keeps itself
                if t is not None:
                    saved.add(t)
            self.keep(key, saved.bytes)
        elif a.op in ("B", "I"):
            again = saved.bytes if state.checkpoint[a.chunk] else 0
            r = self.result
            r.recompute_bytes = max(r.recompute_bytes, again)
            r.peak_activation_bytes = max(r.peak_activation_bytes, self.bytes + again)
            if a.op == "I":  # from here to its W: what its W needs, in place of what F stored
                self.bytes -= self.held.pop(key)
                self.keep(key, state.kept[key].weights.nbytes())
        for b in step:  # a B or W frees what its F kept (an overlapped pair's B after its F's keep)
            if b.op in ("B", "W"):
                self.bytes -= self.held.pop((b.mb, b.chunk))

    def keep(self, key: tuple, nbytes: int) -> None:
        """``nbytes`` held for ``key`` (by its F, or from its I)."""
        self.held[key] = self.held.get(key, 0) + nbytes
        self.bytes += nbytes
        r = self.result
        r.activation_bytes.setdefault(key, nbytes)  # what its F stored
        r.peak_in_flight = max(r.peak_in_flight, len(self.held))
        r.peak_activation_bytes = max(r.peak_activation_bytes, self.bytes)
