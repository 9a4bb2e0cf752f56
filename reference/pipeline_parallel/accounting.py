"""What the executor measures: each action's time, and the activation bytes each F stores.

Measured, not assumed. Every action's start and end (seconds from a common start;
the ranks meet at a barrier first) go into ``PipelineResult.trace`` (`Trace`). The
bytes each F leaves stored for its B are counted by a saved-tensors hook
(`SavedBytes`): every tensor autograd saves, parameters excluded and each storage
counted once, plus the tensors the executor itself keeps. `ActivationStore` holds
what each F keeps until its B (or, split, its W) and adds up those bytes as they come and go:
``peak_activation_bytes`` is the most held at once, a recomputing B's extra bytes
included.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from reference.pipeline_parallel.check import TraceEvent

__all__ = ["PipelineResult", "SavedBytes", "ActivationStore", "Trace"]


@dataclass
class PipelineResult:
    """What one rank saw running one schedule (one training step's forward and backward)."""

    loss: Optional[torch.Tensor]  # mean loss over the micro-batches, on the last stage; else None
    trace: list[TraceEvent] = field(default_factory=list)
    peak_in_flight: int = 0  # most (micro-batch, chunk) activations held at once
    peak_activation_bytes: int = 0
    activation_bytes: dict = field(default_factory=dict)  # (mb, chunk) -> bytes its F stored
    recompute_bytes: int = 0  # most bytes one checkpointed B's recomputation saved (0 without)


class SavedBytes:
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


class ActivationStore:
    """What this rank keeps from each F until its B, keyed by (micro-batch, chunk), and its bytes.

    ``moving``: the stages' parameters may be freed and regathered between actions (an
    action hook), so a saved tensor is checked against their storages as it is saved."""

    def __init__(self, stages: Sequence[torch.nn.Module], result: PipelineResult, moving: bool = False):
        params = [p for st in stages for p in st.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.moving = params if moving else None
        self.result, self.held, self.bytes = result, {}, 0

    def saving(self, exclude: Sequence[torch.Tensor] = ()) -> SavedBytes:
        """Count what autograd saves inside a ``with`` block, parameters left out."""
        return SavedBytes(self.param_ptrs, exclude, params=self.moving)

    def keep(self, key: tuple, kept, nbytes: int) -> None:
        """F of ``key`` keeps ``kept`` for its B, ``nbytes`` of stored activations. Kept again
        (a split backward's I, `split_backward`), ``nbytes`` more are held until its W."""
        self.held[key] = (kept, self.held.get(key, (kept, 0))[1] + nbytes)
        self.bytes += nbytes
        r = self.result
        r.activation_bytes.setdefault(key, nbytes)  # what its F stored
        r.peak_in_flight = max(r.peak_in_flight, len(self.held))
        r.peak_activation_bytes = max(r.peak_activation_bytes, self.bytes)

    def get(self, key: tuple):
        return self.held[key][0]

    def recomputed(self, nbytes: int) -> None:
        """A checkpointed B's forward ran again and holds ``nbytes`` more for its backward."""
        r = self.result
        r.recompute_bytes = max(r.recompute_bytes, nbytes)
        r.peak_activation_bytes = max(r.peak_activation_bytes, self.bytes + nbytes)

    def drop(self, key: tuple) -> None:
        """B of ``key`` is done: what its F kept is freed."""
        self.bytes -= self.held.pop(key)[1]


class Trace:
    """Each step's actions with their start and end, in seconds from the trace's start."""

    def __init__(self, rank: int, device: torch.device, events: list):
        self.rank, self.events = rank, events
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.t0 = time.perf_counter()

    @contextmanager
    def step(self, step: Sequence):
        start = time.perf_counter() - self.t0
        yield
        self.sync()  # GPU work is asynchronous: time it to its end
        end = time.perf_counter() - self.t0
        self.events += [TraceEvent(self.rank, a, start, end) for a in step]
