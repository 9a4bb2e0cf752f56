"""What homework 01's checks share (and homework 02's, 03's reuse): small MLP cases and
the collectives an exercise may use.

* `model_case` draws a case: an MLP's sizes and weights (the same on every rank), each
  rank its own (STEPS, BATCH, ...) data; `build_mlp` builds it in a rank or in the grader;
  `full_batch_loss` is the mean-squared error every case trains on;
* `collectives_allowed` puts back, inside the rules, the process group's methods an
  exercise may call, and records each call (method, elements, dtype);
* `judge_grads` compares every rank's gradients with the full-batch ones, within the
  tolerance its caller gives: the course's bound for a gradient summed over n ranks or
  micro-batches in another order (`reference.tolerance.gradient(n)`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from reference.tolerance import Tolerance

__all__ = ["STEPS", "BATCH", "collectives_allowed", "build_mlp", "full_batch_loss",
           "model_case", "judge_grads"]

STEPS, BATCH = 2, 3  # backward passes per case, examples per rank and step

# The guard switches off every method of the process group, whatever the exercise
# forbids; `collectives_allowed` puts back the ones an exercise may use. They are
# taken here, when the module is imported, before any rank enters the rules.
_GROUP_ORIGINALS = {name: dist.ProcessGroup.__dict__[name] for name in (
    "allreduce", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "allgather", "all_gather_single", "_allgather_base") if name in dist.ProcessGroup.__dict__}


@contextlib.contextmanager
def collectives_allowed(methods, record=None):
    """Inside the rules: the process group's `methods` work again; `record(method, numel,
    dtype)` is called before each call, numel being the elements of its input tensor(s)
    and dtype that of the first."""
    saved = {m: dist.ProcessGroup.__dict__.get(m) for m in methods}

    def wrap(name, original):
        def counted(self, tensors, *args, **kwargs):
            if record is not None:
                items = [t for t in (tensors if isinstance(tensors, (list, tuple)) else [tensors])
                         if isinstance(t, torch.Tensor)]
                record(name, sum(t.numel() for t in items), items[0].dtype if items else None)
            return original(self, tensors, *args, **kwargs)
        return counted

    try:
        for m in methods:
            setattr(dist.ProcessGroup, m, wrap(m, _GROUP_ORIGINALS[m]))
        yield
    finally:
        for m, value in saved.items():
            if value is None:
                delattr(dist.ProcessGroup, m)
            else:
                setattr(dist.ProcessGroup, m, value)


# ------------------------------------------------------------------ models and cases

def build_mlp(case: dict) -> nn.Sequential:
    """The case's MLP: Linear(sizes[0], sizes[1]), Tanh, ..., Linear(sizes[-2], sizes[-1])."""
    sizes, bias = case["sizes"], case.get("bias", True)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(fan_in, fan_out, bias=bias)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    model = nn.Sequential(*layers)
    model.load_state_dict(case["state"])
    for name, p in model.named_parameters():
        p.requires_grad_(name not in case["frozen"])
    return model


def full_batch_loss(model, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def model_case(generator, world_size, sizes, frozen=(), bias=True, **extra) -> list:
    """Per-rank inputs: the same weights, each rank its own (STEPS, BATCH, ...) data."""
    shapes = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        shapes[f"{2 * i}.weight"] = (fan_out, fan_in)
        if bias:
            shapes[f"{2 * i}.bias"] = (fan_out,)
    state = {k: torch.randn(s, generator=generator) * 0.5 for k, s in shapes.items()}
    common = {"sizes": list(sizes), "bias": bias, "frozen": list(frozen), "state": state, **extra}
    return [{**common, "x": torch.randn(STEPS, BATCH, sizes[0], generator=generator),
             "y": torch.randn(STEPS, BATCH, sizes[-1], generator=generator)}
            for _ in range(world_size)]


def judge_grads(expected: dict, outputs: list, tol: Tolerance) -> str:
    """"" when every rank's gradients at every step are the expected ones within `tol`."""
    for rank, out in enumerate(outputs):
        for step, (got, want) in enumerate(zip(out["grads"], expected["grads"])):
            extra = sorted(set(got) - set(want))
            if extra:
                return f"rank {rank}, step {step}: frozen parameter(s) {extra} got a gradient"
            for name, g in want.items():
                if name not in got:
                    return f"rank {rank}, step {step}: {name}.grad is None after the averaging"
                if got[name].shape != g.shape:
                    return f"rank {rank}, step {step}: {name}.grad has shape {tuple(got[name].shape)}"
                if not tol.close(got[name], g):
                    local = "" if not tol.close(got[name] / len(outputs), g) else (
                        " (it is the sum over ranks: divide by the world size)")
                    error = (got[name] - g).abs().max().item()
                    return (f"rank {rank}, step {step}: {name}.grad is not the full-batch gradient "
                            f"(max abs error {error:.3g}){local}")
    return ""
