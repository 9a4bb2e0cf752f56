"""Hidden checks of homework 07's transfer exercise: PowerSGD's compressed all-reduce.

``powersgd_all_reduce(grad, q, error)`` runs on every rank of the default group. ``grad``
is this rank's (n, m) gradient, ``q`` the (m, r) matrix every rank holds alike (the
previous step's, for a warm start), ``error`` this rank's (n, m) error feedback. With
M = grad + error (this rank's), it returns (approx, new_q, new_error):

    P = sum over ranks of M q                 (n, r)   all-reduce 1: n r numbers
    P^ = P's columns orthonormalised by Gram-Schmidt, in order (the Q of P = Q R, R's
         diagonal positive)
    new_q = mean over ranks of M^T P^        (m, r)   all-reduce 2: m r numbers
    approx = P^ new_q^T                      (n, m)   the mean gradient's rank-r image
    new_error = M - approx                   (n, m)   this rank's, resent next step

as PyTorch's ``powerSGD_hook`` does for one matrix. Only ``all_reduce`` is allowed, and
the checks count what it carries: exactly two calls of n r and m r numbers (an
all-reduce of the whole gradient, compressed afterwards, gets the same numbers with n m
on the wire and fails). Cases on 2 and 3 ranks, float32: square and oblong matrices,
r from 1 to 3, a first step (zero error). Compared with the float64 truth within the
course's bound for a sum over the ranks in another order, `reference.tolerance.gradient(p)`
(reasoned in reference/tolerance.py), for values of order kappa(P) max|M| rather than 1
(`at_scale`, `tolerance`): float32 products of at most 24 terms round by a few ulps of
max|M|, and Gram-Schmidt, however it is written (this one, classical, a QR with the signs
fixed), loses orthogonality in proportion to the condition number kappa of P (Bjorck), so
every output carries that rounding times kappa; forgetting the error, the mean of Q or
the all-reduce of P is off by far more.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import Tolerance, gradient

__all__ = ["POWERSGD", "course_powersgd_all_reduce", "gram_schmidt", "tolerance"]

SHAPES = ((8, 6, 1), (5, 7, 2), (16, 4, 3), (12, 12, 1))  # (n, m, r)


def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """The columns of p orthonormalised in order (the Q of p = Q R with diag(R) > 0)."""
    out = p.clone()
    for j in range(p.shape[1]):
        col = out[:, j]
        for k in range(j):
            col -= (out[:, k] @ col) * out[:, k]
        out[:, j] = col / col.norm()
    return out


def course_powersgd_all_reduce(grad, q, error):
    m = grad + error
    p = m @ q
    dist.all_reduce(p)                     # (n, r): the sum of the ranks' M q
    p = gram_schmidt(p)
    new_q = m.T @ p
    dist.all_reduce(new_q)                 # (m, r)
    new_q /= dist.get_world_size()
    approx = p @ new_q.T
    return approx, new_q, m - approx


def _counting(original, log: list):
    """ProcessGroup.allreduce that first notes how many numbers it carries."""
    def allreduce(self, tensors, *args, **kwargs):
        items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        log.append(sum(int(t.numel()) for t in items))
        return original(self, tensors, *args, **kwargs)
    return allreduce


def _plain(value):
    return value.detach().clone() if type(value) is torch.Tensor else None


def call_powersgd(fn, case: dict) -> dict:
    log: list = []
    raw = dist.ProcessGroup.__dict__["allreduce"]
    dist.ProcessGroup.allreduce = _counting(dist.ProcessGroup.allreduce, log)
    try:  # every all-reduce, however it is reached, goes through the group's method
        out = fn(case["grad"].clone(), case["q"].clone(), case["error"].clone())
    finally:
        dist.ProcessGroup.allreduce = raw
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        return {"error": f"returned {type(out).__name__}, not (approx, new_q, new_error)", "counts": log}
    parts = [_plain(v) for v in out]
    if any(p is None for p in parts):
        return {"error": "approx, new_q and new_error must be tensors", "counts": log}
    return {"approx": parts[0], "q": parts[1], "new_error": parts[2], "counts": log, "error": ""}


def tolerance(inputs: list) -> Tolerance:
    """gradient(p) at the scale kappa(P) max|M|: the case's M = grad + error of every rank, P
    the sum of the ranks' M q, kappa its condition number (float64)."""
    ms = [c["grad"].double() + c["error"].double() for c in inputs]
    singular = torch.linalg.svdvals(sum(m @ inputs[0]["q"].double() for m in ms))
    kappa = float(singular[0] / singular[-1])
    return gradient(len(inputs)).at_scale(kappa * max(float(m.abs().max()) for m in ms))


def expect_powersgd(inputs: list) -> list:
    ms = [c["grad"].double() + c["error"].double() for c in inputs]
    q = inputs[0]["q"].double()
    p = gram_schmidt(sum(m @ q for m in ms))
    new_q = sum(m.T @ p for m in ms) / len(ms)
    approx = p @ new_q.T
    return [{"approx": approx, "q": new_q, "new_error": m - approx} for m in ms]


def judge_powersgd(inputs, expected, outputs, world_size) -> str:
    n, m = inputs[0]["grad"].shape
    r = inputs[0]["q"].shape[1]
    tol = tolerance(inputs)
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out.get("error"):
            return f"rank {rank}: {out['error']}"
        for key, what in (("approx", "approx"), ("q", "new_q"), ("new_error", "new_error")):
            got = out[key]
            if tuple(got.shape) != tuple(want[key].shape):
                return f"rank {rank}: {what} has shape {tuple(got.shape)}, expected {tuple(want[key].shape)}"
            if not tol.close(got, want[key]):
                error = (got.double() - want[key]).abs().max().item()
                return f"rank {rank}: wrong {what} (max abs error {error:.3g}; n={n} m={m} r={r})"
        if sorted(out["counts"]) != sorted([n * r, m * r]):
            return (f"rank {rank} all-reduced {out['counts']} numbers; PowerSGD sends P ({n * r}) "
                    f"then Q ({m * r}), two calls")
    return ""


def make_powersgd_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    cases = []
    for i, (n, m, r) in enumerate(SHAPES):
        q = torch.randn(m, r, generator=generator)
        scale = 0.0 if i == 0 else 0.1  # the first step has no error yet
        per_rank = [{"grad": torch.randn(n, m, generator=generator),
                     "error": scale * torch.randn(n, m, generator=generator), "q": q.clone()}
                    for _ in range(world_size)]
        cases.append(Case(f"({n}, {m}) rank {r}{', first step' if i == 0 else ''}", per_rank))
    return cases


def torch_powersgd(case: dict):
    """The course's answer in a rank (for the visible checks' reference)."""
    return course_powersgd_all_reduce(case["grad"], case["q"], case["error"])


POWERSGD = ExerciseSpec(
    id="powersgd_all_reduce", title="PowerSGD's compressed all-reduce with error feedback",
    difficulty="★★★ hard", world_sizes=(2, 3), make_cases=make_powersgd_cases, call=call_powersgd,
    expect=expect_powersgd, judge=judge_powersgd, reference=torch_powersgd,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.performance_powersgd.course_powersgd_all_reduce",
            "reference.data_parallel.compression",
            "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"))
