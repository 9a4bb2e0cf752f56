"""Dynamic loss scaling for fp16, across every rank of a parallel run (DeepSpeed's rule).

fp16 keeps 5 bits of exponent: gradients below about 6e-8 flush to zero. Multiplying the loss
by a scale s multiplies every gradient by s, lifting the small ones into range; the optimizer
sees them divided by s again. Too large an s overflows to inf, so the scale is dynamic:

* a step whose gradients hold an inf or a NaN on *any* rank is skipped on every rank (one
  rank skipping alone would desynchronise the replicas);
* `hysteresis` (DeepSpeed's `delayed_shift`) is a budget of overflows tolerated before the
  scale drops: each overflow spends one, and once one is left every overflow multiplies the
  scale by `backoff` (1/2), never below `min_scale` (where the run goes on, skipping steps);
* the budget is refilled only when the scale grows, or with `consecutive_hysteresis=True`
  after every step without overflow (then only overflows in a row lower the scale);
* the scale is multiplied by `growth` (2) every `window` steps counted from the last overflow.

`DynamicLossScaler(static=s)` keeps s fixed (DeepSpeed's `loss_scale: s`). bf16 has fp32's
exponent range and needs none of this."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from reference import comms

__all__ = ["DynamicLossScaler", "OverflowCheck"]


class OverflowCheck:
    """fp16's overflow check started by `DynamicLossScaler.start_check`: the flag and its
    all-reduce in flight (None on one rank)."""

    def __init__(self, flag: torch.Tensor, work=None):
        self.flag, self.work = flag, work

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        return bool(self.flag.item())


class DynamicLossScaler:
    def __init__(self, initial_scale_power: int = 16, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, growth: float = 2.0, backoff: float = 0.5,
                 static: Optional[float] = None, consecutive_hysteresis: bool = False):
        if static is not None and not static > 0:
            raise ValueError(f"a static loss scale must be positive, got {static!r}")
        if window < 1 or hysteresis < 1 or not min_scale > 0:
            raise ValueError(f"window={window} and hysteresis={hysteresis} must be >= 1 and "
                             f"min_scale={min_scale} positive")
        self.scale = float(static if static is not None else 2.0 ** initial_scale_power)
        self.static = static is not None
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.growth, self.backoff = growth, backoff
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_hysteresis = hysteresis            # overflows left before the scale drops
        self.iteration, self.last_overflow = 0, -1  # DeepSpeed's cur_iter, last_overflow_iter
        self.skipped = 0

    def start_check(self, grads, group=None) -> "OverflowCheck":
        """Start the check of this step: this rank's flag (1.0 when ``grads`` hold an inf or a NaN),
        its MAX all-reduce over ``group`` (default: the world) started without waiting for it,
        then ``grads`` divided by the scale (an overflowing step's gradients are thrown away, so
        unscaling them does no harm). `finish_check` completes it; between the two a rank may
        compute (optimizer post-validation steps there)."""
        local = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([float(local)], device=grads[0].device if grads else "cpu")
        work = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            work = comms.all_reduce(flag, op=comms.ReduceOp.MAX, group=group, async_op=True)  # metered: 4 bytes
        for g in grads:
            g.mul_(1.0 / self.scale)
        return OverflowCheck(flag, work)

    def finish_check(self, check: "OverflowCheck") -> bool:
        """Wait for ``check``'s all-reduce, `update` the scale; True when any rank overflowed
        (then the step must be skipped, or undone, everywhere)."""
        overflow = check.wait()
        self.update(overflow)
        return overflow

    def unscale_and_check(self, grads, group=None) -> bool:
        """`start_check` and wait for it, without `update` (the caller updates): True when any rank
        of ``group`` found an inf or a NaN."""
        return self.start_check(grads, group).wait()

    def update(self, overflow: bool) -> None:
        """After each step: DeepSpeed's `update_scale` (see the module docstring)."""
        if overflow:
            self.skipped += 1
            if not self.static:
                if self.hysteresis == 1 or self.cur_hysteresis == 1:
                    self.scale = max(self.scale * self.backoff, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
            self.last_overflow = self.iteration
        elif not self.static:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.iteration - self.last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.growth
        self.iteration += 1

    def state_dict(self) -> dict:
        return dict(scale=self.scale, cur_hysteresis=self.cur_hysteresis, iteration=self.iteration,
                    last_overflow=self.last_overflow, skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.iteration, self.last_overflow = int(state["iteration"]), int(state["last_overflow"])
        self.skipped = int(state["skipped"])

    def __repr__(self) -> str:
        kind = "static" if self.static else "dynamic"
        return f"DynamicLossScaler({kind}, scale={self.scale:g}, skipped={self.skipped})"
