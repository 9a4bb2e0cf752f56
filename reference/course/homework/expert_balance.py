"""Hidden checks of homework 05's global-batch load-balancing loss.

``global_balance_loss(probs, expert_idx, group=None)``: Switch's balance loss
``E * sum_i f_i * P_i``, with ``f_i`` the fraction of all k-way assignments that chose
expert i and ``P_i`` the mean router probability of expert i, both taken over the tokens
of **every rank of the group** (the global batch), not over one rank's. A rank holds
``probs`` (N, E), its tokens' router probabilities (N differs between ranks and may be
0), and ``expert_idx`` (N, k), their chosen experts. Every rank must return the same
0-dim tensor in the dtype of ``probs``, equal to the loss of one process holding every
rank's tokens, and its gradient with respect to this rank's ``probs`` must be that
process's gradient for these rows, ``E * f_i / N_total`` in column i (f_i counts no
gradient: it is a count). Only ``all_reduce`` is allowed. Tolerances, the course's fp32
bounds (reasoned in reference/tolerance.py): the value is a loss, `loss()` (sums of a few
dozen numbers, added in another order than here); the gradient `forward()` (a few
roundings of counts the all-reduce sums exactly). The float64 case is held to them too:
it checks the dtype of the result, and a count turned into a fraction in float32 on the
way is still the right loss. Cases on 2 and 3 ranks: uneven tokens per rank, a rank with none,
k = 1, 2 and 3, routing skewed onto two experts, uniform routing (the loss is 1), and
float64 probabilities.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.tolerance import forward, loss as loss_tolerance

__all__ = ["GLOBAL_BALANCE_LOSS", "course_global_balance_loss", "global_loss_and_grads"]



def course_global_balance_loss(probs, expert_idx, group=None):
    """The course's answer: all-reduce the counts, the probability sums (detached) and the
    token count; keep this rank's own sum in the graph."""
    E, k = probs.shape[1], expert_idx.shape[1]
    local = probs.sum(dim=0)  # (E,), differentiable
    stats = torch.cat([torch.bincount(expert_idx.reshape(-1), minlength=E).to(probs.dtype),
                       local.detach(), probs.new_tensor([probs.shape[0]])])
    dist.all_reduce(stats, group=group)
    n = stats[-1]
    f = stats[:E] / (k * n)
    P = (stats[E:2 * E] - local.detach() + local) / n
    return E * (f * P).sum()


def global_loss_and_grads(inputs: list) -> tuple:
    """One process holding every rank's tokens: (loss in float64, each rank's gradient)."""
    probs = torch.cat([c["probs"].double() for c in inputs]).requires_grad_(True)
    idx = torch.cat([c["expert_idx"] for c in inputs])
    N, E = probs.shape
    f = torch.bincount(idx.reshape(-1), minlength=E).double() / idx.numel()
    loss = E * (f * probs.mean(dim=0)).sum()
    loss.backward()
    sizes = [c["probs"].shape[0] for c in inputs]
    return loss.detach(), [g.to(c["probs"].dtype) for g, c in zip(probs.grad.split(sizes), inputs)]


def call_global_balance(fn, case: dict) -> dict:
    probs = case["probs"].clone().requires_grad_(True)
    out = fn(probs, case["expert_idx"].clone())
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        return {"error": f"returned {type(out).__name__}, not a 0-dim tensor"}
    grad = None
    if out.requires_grad:
        out.reshape(()).backward()
        grad = None if probs.grad is None else probs.grad.detach().clone()
    return {"error": "", "value": out.detach().reshape(()).clone(), "grad": grad,
            "graph": bool(out.requires_grad)}


def expect_global_balance(inputs: list) -> list:
    loss, grads = global_loss_and_grads(inputs)
    return [{"value": loss, "grad": g} for g in grads]


def judge_global_balance(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    for rank, (case, want, out) in enumerate(zip(inputs, expected, outputs)):
        if out.get("error"):
            return f"rank {rank} {out['error']}"
        dtype = case["probs"].dtype
        if out["value"].dtype != dtype:
            return f"rank {rank} returned {out['value'].dtype}; expected {dtype}, the dtype of probs"
        got, value = float(out["value"]), float(want["value"])
        if not loss_tolerance().allows(got - value, value):
            return (f"rank {rank}: loss {got:.6g}, the global batch's is {value:.6g} (ratio "
                    f"{got / value:.4g}): f and P are fractions of every rank's tokens")
        n = case["probs"].shape[0]
        grad = out["grad"] if out["grad"] is not None or n else torch.zeros(0, case["probs"].shape[1])
        if grad is None:
            return (f"rank {rank}: the loss has no gradient with respect to this rank's probs"
                    + ("" if out["graph"] else " (it is detached)"))
        if grad.shape != want["grad"].shape or not forward().close(grad, want["grad"]):
            err = (grad.double() - want["grad"].double()).abs().max().item() \
                if grad.shape == want["grad"].shape else float("nan")
            return (f"rank {rank}: the gradient with respect to probs differs from the global "
                    f"loss's (max abs error {err:.3g}): E f_i / N_total in column i")
    return ""


def make_global_balance_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    P = world_size

    def rank_input(n, E, k, dtype=torch.float32, favour=None, uniform=False, offset=0):
        logits = torch.randn(n, E, generator=generator, dtype=torch.float64)
        if favour is not None:
            logits[:, list(favour)] += 4.0
        probs = torch.full((n, E), 1.0 / E, dtype=torch.float64) if uniform else logits.softmax(-1)
        if uniform:  # every expert chosen equally often over the ranks
            idx = (torch.arange(n * k).view(n, k) + offset) % E
        else:
            idx = probs.topk(k, dim=-1).indices
        return {"probs": probs.to(dtype), "expert_idx": idx}

    def sizes(low, high):
        return [int(torch.randint(low, high + 1, (), generator=generator)) for _ in range(P)]

    n_uniform = [2 * (r + 1) for r in range(P)]  # 2, 4, 6 tokens: k * sum is a multiple of E
    offsets = [sum(n_uniform[:r]) * 2 for r in range(P)]
    return [
        Case("k=2 E=4, uneven tokens per rank", [rank_input(n, 4, 2) for n in sizes(1, 9)]),
        Case("k=1 E=6, the last rank has no tokens",
             [rank_input(0 if r == P - 1 else n, 6, 1) for r, n in enumerate(sizes(2, 7))]),
        Case("k=2 E=8, routing skewed onto experts 0 and 1",
             [rank_input(n, 8, 2, favour=(0, 1)) for n in sizes(3, 8)]),
        Case("k=2 E=4, uniform routing (the loss is 1)",
             [rank_input(n, 4, 2, uniform=True, offset=o) for n, o in zip(n_uniform, offsets)]),
        Case("k=3 E=8, float64 probabilities",
             [rank_input(n, 8, 3, dtype=torch.float64) for n in sizes(2, 9)]),
    ]


def reference_global_balance(case: dict) -> torch.Tensor:
    return course_global_balance_loss(case["probs"], case["expert_idx"])


GLOBAL_BALANCE_LOSS = on_subgroup(ExerciseSpec(
    id="global_balance_loss", title="The load-balancing loss of the global batch",
    difficulty="★★☆ medium", world_sizes=(2, 3), make_cases=make_global_balance_cases,
    call=call_global_balance, expect=expect_global_balance, judge=judge_global_balance,
    reference=reference_global_balance,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.expert_balance.course_global_balance_loss",
            "reference.expert_parallel.router.Router")), (3,), (1, 2))
