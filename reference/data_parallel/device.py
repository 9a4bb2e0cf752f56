"""The device a DDP wrapper's tensors must live on, and the clock of its step on that device.

Device. A process group communicates the tensors of one device: gloo the CPU's, NCCL
those of this rank's GPU (`reference.runtime.device()`). Under the course's NCCL
launches CPU tensors still work, through a gloo side channel ("cpu:gloo,cuda:nccl"),
so a model left on the CPU would train, slowly and over the wrong network, without a
word. `check_module_device` makes that an error: the module goes to the device
*before* it is wrapped (``DDP(model.to(device()))``), as PyTorch's own DDP expects.
Moving it inside the wrapper would be possible, but an optimizer built before wrapping
or a tensor the caller kept would then quietly point at a different device.

Time. On the CPU a collective is over when ``work.wait()`` returns, so
``time.perf_counter()`` read then is its end. On a GPU ``work.wait()`` only makes the
current CUDA stream wait for the NCCL stream: it returns at once, and the host's clock
says nothing about when the all-reduce ran. `StepClock` therefore records, on a GPU,
each moment as a CUDA event on the current stream (it completes when the GPU gets
there: a launch when the bucket's gradients exist, a wait's end when the all-reduce has
finished), and converts the events to ``perf_counter`` seconds once the step is over:
one last event is synchronised, read at host time ``t_end``, and every event lies
``elapsed_time(event, last)`` before it. That costs one synchronisation per traced
step; ``DDP(..., trace=False)`` records nothing and costs nothing. On the CPU the clock
is ``time.perf_counter`` itself, as it always was.
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
