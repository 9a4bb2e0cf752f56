"""The device a DDP wrapper's tensors must live on, and the clock of its step on that device.

Device. A process group communicates one device's tensors: gloo the CPU's, NCCL this rank's
GPU's. Under the course's NCCL launches CPU tensors still go through a gloo side channel, so a
model left on the CPU would train slowly over the wrong network without a word:
`check_module_device` makes that an error. The module moves *before* wrapping, as PyTorch's
DDP expects, so an optimizer built before wrapping points at the right tensors.

Time. On a GPU ``work.wait()`` only makes the current stream wait for NCCL's and returns at
once, so the host's clock says nothing about when the all-reduce ran. `StepClock` records each
moment as a CUDA event and, once the step is over, synchronises one last event read at host
time ``t_end``: every event lies ``elapsed_time(event, last)`` before it (one synchronisation
per traced step). On the CPU the clock is ``time.perf_counter``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["backend_device", "check_module_device", "StepClock"]


def backend_device(group=None) -> torch.device:
    """The device whose tensors `group` communicates: this rank's GPU under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_module_device(module: nn.Module, group=None, wrapper: str = "DDP") -> torch.device:
    """Raise unless every parameter and buffer of `module` is on `backend_device(group)`."""
    expected = backend_device(group)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    wrong = [(name, t.device) for name, t in tensors if t.device != expected]
    if wrong:
        name, where = wrong[0]
        k = len(wrong) - 1
        more = f" (and {k} more tensor{'s' if k > 1 else ''})" if k else ""
        raise ValueError(
            f"{wrapper}: the process group's backend {dist.get_backend(group)!r} communicates "
            f"tensors on {expected}, but {name!r} is on {where}{more}. Move the model to the "
            f"rank's device before wrapping it: {wrapper}(model.to(reference.runtime.device()))")
    return expected


class StepClock:
    """Moments of a step (`now()`), turned into ``perf_counter`` seconds by `resolve(trace)`.

    `event` is the event class (``torch.cuda.Event``; a test may pass a stand-in)."""

    def __init__(self, device: torch.device, event=None):
        self.on_gpu = device.type == "cuda"
        self.event = event if event is not None else (torch.cuda.Event if self.on_gpu else None)

    def now(self):
        if not self.on_gpu:
            return time.perf_counter()
        mark = self.event(enable_timing=True)
        mark.record()  # on the current stream: completes when the GPU reaches this point
        return mark

    def resolve(self, trace: list[dict]) -> None:
        if not self.on_gpu:
            return
        last = self.event(enable_timing=True)
        last.record()
        last.synchronize()  # the one wait for the GPU in a traced step
        t_end = time.perf_counter()
        for entry in trace:
            if not isinstance(entry["time"], float):
                entry["time"] = t_end - entry["time"].elapsed_time(last) / 1e3  # ms -> s
