"""Homework 05's shared checks: the experts the grader hands in, and the all-to-all let through.

Every dispatch exercise of homework 05 runs the student's function with an expert
function of the grader's own (`expert_fn_value`: nonlinear, row by row, different for
each expert) that records where it runs and on how many rows, and with
`dist.all_to_all_single` let through (`all_to_all_single_allowed`) while every other
collective stays switched off, each call's elements sent and received recorded. The
cases' expert assignments come from `assignments` (k different experts per token).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference.tolerance import UNIT_ROUNDOFF, forward

__all__ = ["TOLERANCE", "close", "rounding_bounds", "expert_fn_value", "assignments", "plain", "all_to_all_single_allowed",
           "call_dispatch_combine", "call_dispatch_combine_backward"]

# The course's fp32 bound for a forward or a single reduction (reference/tolerance.py):
# the answer is float32, compared with the float64 reference.
TOLERANCE = forward(torch.float32)
# float32's unit roundoff (the policy's), and how many roundings an element of the answer
# may gather: the argument (x * (e + 1)), sin or cos, the + e, the weight, and one per
# term of a sum.
_U = UNIT_ROUNDOFF[torch.float32]
_ROUNDINGS = 8


def rounding_bounds(case: dict) -> dict:
    """How far a correct float32 answer may sit from the float64 reference, element by element.

    `expert_fn_value` takes sin(x (e + 1)): float32 rounds the argument by |x (e + 1)| u, and
    sin, cos and the vector kernels PyTorch picks on each CPU (AVX-512, AVX2, plain) differ
    by about that much. Where sin or cos is near zero that error is not small next to the
    value, so `TOLERANCE` alone fails a right answer on some machines (measured: 3e-6 on
    the token gradient of a 12-expert case). The bound is the sum of the absolute terms of
    each element times `_ROUNDINGS` u (u float32's unit roundoff,
    `reference.tolerance.UNIT_ROUNDOFF`); it is added to the tolerance, and it is far below
    any mistake the checks look for (a wrong expert or weight moves an element by O(1))."""
    x, idx, w = case["tokens"].double(), case["expert_idx"], case["weights"].double()
    k = idx.shape[1]
    g = case.get("grad_out")
    g = g.double().abs() if g is not None else torch.ones_like(x)
    out, gx, gw = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(w)
    for j in range(k):
        e = idx[:, j].clamp(min=0).double()[:, None]  # (N, 1)
        kept = (idx[:, j] >= 0).double()[:, None]
        arg = (x * (e + 1)).abs()  # (N, C)
        wj = w[:, j, None].abs() * kept
        out += wj * (arg + 2 + e)
        gx += g * wj * (e + 1) * (arg + 3)
        gw[:, j] = (g * (arg + 2 + e) * kept).sum(dim=1)
    C = x.shape[1]
    scale = _ROUNDINGS * _U
    return {"out": scale * (k + 1) * out, "grad_tokens": scale * (k + 1) * gx,
            "grad_weights": scale * (C + 1) * gw}


def close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Elementwise: within TOLERANCE of the reference, widened by the rounding bound."""
    limit = TOLERANCE.atol + TOLERANCE.rtol * want.abs() + bound.to(want.dtype)
    return (got - want).abs() <= limit


def expert_fn_value(e: int, rows: torch.Tensor) -> torch.Tensor:
    """What expert e computes in the checks: nonlinear, row by row, different for each expert."""
    return torch.sin(rows * (e + 1)) + e  # (n, C)


def assignments(generator, n: int, n_experts: int, k: int) -> torch.Tensor:
    """(n, k) int64: k different experts for each token."""
    if n == 0:
        return torch.empty(0, k, dtype=torch.long)
    return torch.stack([torch.randperm(n_experts, generator=generator)[:k] for _ in range(n)])


def plain(value):
    """A tensor the rank may send back (a detached copy), or None for anything else."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else None


# Taken when this module is imported in a rank, before the exercise rules are set.
_GROUP_ALL_TO_ALL_SINGLE = next(k.__dict__["all_to_all_single"] for k in dist.ProcessGroup.__mro__
                                if "all_to_all_single" in k.__dict__)


@contextlib.contextmanager
def all_to_all_single_allowed(log: list):
    """Let `dist.all_to_all_single` through for the student's call, recording each call's
    (elements sent, elements received) in `log`.

    It goes through the ProcessGroup method of the same name: whatever the rules left
    there (the method, or a refusal when they switch off every collective method)
    is put back afterwards."""
    before = dist.ProcessGroup.__dict__.get("all_to_all_single")

    def recorded(self, output, input, *args, **kwargs):
        log.append((int(input.numel()), int(output.numel())))
        return _GROUP_ALL_TO_ALL_SINGLE(self, output, input, *args, **kwargs)

    dist.ProcessGroup.all_to_all_single = recorded
    try:
        yield log
    finally:
        if before is None:  # the method was inherited: uncover it again
            del dist.ProcessGroup.all_to_all_single
        else:
            dist.ProcessGroup.all_to_all_single = before


def call_dispatch_combine(fn, case: dict) -> dict:
    """In a rank: the student's dispatch-and-combine on this rank's case, every expert call
    and every all-to-all recorded (both exercises of homework 05 that move tokens)."""
    ran = []  # [expert, rows] per call of the expert function on this rank

    def expert_fn(e, rows):
        ran.append([int(e), int(rows.shape[0])])
        return expert_fn_value(int(e), rows)

    traffic = []
    with all_to_all_single_allowed(traffic):
        out = fn(case["tokens"].clone(), case["expert_idx"].clone(), case["weights"].clone(),
                 case["experts_per_rank"], expert_fn)
    return {"returned": plain(out), "returned_type": type(out).__name__, "ran": ran,
            "all_to_all": [list(t) for t in traffic]}


def call_dispatch_combine_backward(fn, case: dict) -> dict:
    """As `call_dispatch_combine`, then backward from the case's `grad_out` on every rank:
    the gradients of this rank's tokens and weights come back too. A result that does not
    require grad gets no backward (no rank waits for it: an answer whose backward has no
    all-to-all never communicates in backward)."""
    ran = []

    def expert_fn(e, rows):
        ran.append([int(e), int(rows.shape[0])])
        return expert_fn_value(int(e), rows)

    tokens = case["tokens"].clone().requires_grad_()
    weights = case["weights"].clone().requires_grad_()
    traffic = []
    with all_to_all_single_allowed(traffic):
        out = fn(tokens, case["expert_idx"].clone(), weights, case["experts_per_rank"], expert_fn)
        forward_calls = len(traffic)
        differentiable = isinstance(out, torch.Tensor) and out.requires_grad
        if differentiable and out.shape == case["grad_out"].shape:
            out.backward(case["grad_out"])
    return {"returned": plain(out), "returned_type": type(out).__name__, "ran": ran,
            "all_to_all": [list(t) for t in traffic], "forward_calls": forward_calls,
            "grad_tokens": plain(tokens.grad), "grad_weights": plain(weights.grad)}
