"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as LambdaLR.

    sched = make_scheduler(optimizer, config)   # config: a TrainConfig or a SchedulerConfig
    for step in range(steps):
        ...; optimizer.step(); sched.step()

The formulas and defaults are DeepSpeed's (deepspeed/runtime/lr_schedules.py), with s the
optimizer step (0, 1, 2, ...) and W = max(2, warmup_num_steps):

* warm-up, s < W: gamma = log(s + 1) / log(W) ("log", the default) or s / W ("linear");
* WarmupLR: lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) x gamma, then warmup_max_lr;
* WarmupDecayLR: the same warm-up, then gamma = max(0, (T - s) / max(1, T - W)), a linear
  decay to 0 at T = total_num_steps;
* WarmupCosineLR: a ratio of the optimizer's own lr: warmup_min_ratio + (1 - warmup_min_ratio)
  x gamma during warm-up, then cos_min_ratio + (1 - cos_min_ratio) x (1 + cos(pi p)) / 2 with
  p = min(1, (s - W + 1) / max(1, T - W)).

Optimizer step s runs at the schedule's value for s (DeepSpeed's engine runs its first two steps
at warmup_min_lr, before any `step()` and at s = 0; here s = 0 is not repeated). WarmupLR and
WarmupDecayLR set the lr outright: `make_scheduler` writes warmup_max_lr (DeepSpeed's default
0.001, not the optimizer's lr) into the optimizer, and the LambdaLR factor is lr(s) /
warmup_max_lr. total_num_steps defaults to the configuration's `steps`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from reference.train.jsonconfig import spec

DEFAULT_WARMUP_MAX_LR = 0.001  # WarmupLR's and WarmupDecayLR's peak, whatever the optimizer's lr

__all__ = ["DEFAULT_WARMUP_MAX_LR", "SCHEDULERS", "SchedulerParams", "SchedulerConfig", "make_scheduler", "lr_factor"]

# the params each DeepSpeed schedule takes (its constructor's keyword arguments)
SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps"),
}


@dataclass
class SchedulerParams:
    """None: DeepSpeed's default, which `SchedulerConfig.resolved` fills in."""
    warmup_min_lr: Optional[float] = spec(None, min=0.0)
    warmup_max_lr: Optional[float] = spec(None, min=0.0)
    warmup_num_steps: Optional[int] = spec(None, min=1)
    warmup_type: Optional[str] = spec(None, choices=("log", "linear"))
    total_num_steps: Optional[int] = spec(None, min=1)
    warmup_min_ratio: Optional[float] = spec(None, min=0.0)
    cos_min_ratio: Optional[float] = spec(None, min=0.0)


@dataclass
class SchedulerConfig:
    type: str = spec(choices=tuple(SCHEDULERS))
    params: SchedulerParams = field(default_factory=SchedulerParams)

    def __post_init__(self):
        if self.type not in SCHEDULERS:
            raise ValueError(f"scheduler.type={self.type!r} must be one of {', '.join(SCHEDULERS)}")
        takes = SCHEDULERS[self.type]
        for name, value in vars(self.params).items():
            if value is not None and name not in takes:
                raise ValueError(f"scheduler.params.{name}={value!r} is not a parameter of "
                                 f"{self.type} (it takes {', '.join(takes)})")

    def resolved(self, optimizer_lr: float, steps: Optional[int]) -> dict:
        """Every parameter of this schedule, DeepSpeed's defaults filled in."""
        p = self.params
        full = dict(warmup_min_lr=p.warmup_min_lr or 0.0,
                    warmup_max_lr=DEFAULT_WARMUP_MAX_LR if p.warmup_max_lr is None else p.warmup_max_lr,
                    warmup_num_steps=p.warmup_num_steps or 1000,
                    warmup_type=p.warmup_type or "log",
                    total_num_steps=p.total_num_steps or steps,
                    warmup_min_ratio=p.warmup_min_ratio or 0.0,
                    cos_min_ratio=1e-4 if p.cos_min_ratio is None else p.cos_min_ratio)
        out = {k: full[k] for k in SCHEDULERS[self.type]}
        if "total_num_steps" in out and out["total_num_steps"] is None:
            raise ValueError(f"{self.type} needs scheduler.params.total_num_steps (or the run's steps)")
        return out


def _gamma(s: int, warmup: int, kind: str) -> float:
    """DeepSpeed's warm-up fraction gamma at step s < W."""
    return math.log(s + 1) / math.log(warmup) if kind == "log" else s / warmup


def lr_factor(kind: str, p: dict, s: int) -> float:
    """The schedule at optimizer step s: the lr itself, or WarmupCosineLR's ratio of the lr."""
    W = max(2, p["warmup_num_steps"])
    if kind == "WarmupCosineLR":
        if s < W:
            return p["warmup_min_ratio"] + (1.0 - p["warmup_min_ratio"]) * _gamma(s, W, p["warmup_type"])
        progress = min(1.0, (s - W + 1) / max(1, p["total_num_steps"] - W))
        cos = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * cos)
    if s < W:
        gamma = _gamma(s, W, p["warmup_type"])
    elif kind == "WarmupDecayLR":
        gamma = max(0.0, (p["total_num_steps"] - s) / max(1, p["total_num_steps"] - W))
    else:
        gamma = 1.0
    return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * gamma


def make_scheduler(optimizer: torch.optim.Optimizer, config) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR running the schedule of ``config`` (a TrainConfig or a SchedulerConfig), or 1."""
    sched, steps = (config.scheduler, config.steps) if hasattr(config, "scheduler") else (config, None)
    if sched is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    p = sched.resolved(optimizer.param_groups[0]["lr"], steps)
    if sched.type == "WarmupCosineLR":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(sched.type, p, s))
    top = p["warmup_max_lr"]
    for group in optimizer.param_groups:       # the schedule owns the lr: LambdaLR scales this
        group["lr"] = top
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(sched.type, p, s) / top if top else 0.0)
