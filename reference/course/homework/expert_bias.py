"""Hidden checks of homework 05's balancing without an auxiliary loss (DeepSeek-V3's bias).

``balanced_step(probs, bias, k, rate, group=None)``: one training step's routing by a router
that balances with a per-expert bias (`reference.expert_parallel.bias_balance`). ``probs`` is
a list of this rank's micro-batches, each (N_j, E) float32 routing probabilities (N_j differs
and may be 0; every rank of the group has as many micro-batches); ``bias`` (E,) float32 is the
bias at the start of the step. The rank returns ``(expert_idx, weights, new_bias)``:

* ``expert_idx[j]`` (N_j, k) int64: the k largest ``probs[j] + bias``, largest first, every
  micro-batch with the step's ``bias`` (it moves after the step, not between micro-batches);
* ``weights[j]`` (N_j, k) float32: the chosen experts' own probabilities (the bias only
  chooses), renormalised over the k when k > 1 (GShard), raw when k = 1 (Switch): the
  course's `Router`;
* ``new_bias`` (E,) float32, the same on every rank: ``bias + rate * sign(mean(c) - c)``, with
  ``c_i`` the assignments expert i got over the whole step, every micro-batch of every rank
  of the group, summed once; an expert whose load is exactly the mean keeps its bias.
  ``bias`` itself is left as it was.

Only ``all_reduce`` is allowed. The expected answer is the course's own `Router` (an
identity gate fed ``log(probs)``, its ``expert_bias`` set to ``bias``), run in one process
over every rank's micro-batches, whose counts then move the bias by `Router.move_bias`: the
rule's one place. Ties: every case's biased scores ``probs + bias`` of a token are at least
``GAP`` apart among its top k + 1 (rows closer are drawn again from the same generator), so
neither float32's rounding nor the softmax of ``log(probs)`` can change a choice; the load
equal to its mean is an exact integer comparison (sign 0), made on purpose in one case.
Tolerances, the course's fp32 bound `reference.tolerance.forward()`: the weights are one
softmax and a sum of k terms in another order; the bias is one addition (a wrong bias is off
by ``rate``, at least 0.02). Indices and loads are exact.

Cases on 2 and 3 ranks, and two of them again on the subgroup of global ranks 1, 2 of 3:
micro-batches of uneven sizes, an empty micro-batch on every rank, k = 1, 2 and 3, routing
skewed onto two experts whose bias already pushes tokens away, and loads exactly at the mean.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.expert_parallel.router import Router
from reference.tolerance import forward

__all__ = ["BALANCED_STEP", "course_balanced_step", "router_step", "make_balanced_step_cases",
           "GAP"]

GAP = 1e-3  # the smallest distance between two of a token's top k + 1 biased scores
TOLERANCE = forward(torch.float32)


def course_balanced_step(probs, bias, k, rate, group=None):
    """The course's answer: route every micro-batch with the step's bias, count, one
    all-reduce of the counts, then move the bias."""
    E = bias.shape[0]
    load = torch.zeros(E, dtype=torch.int64)
    expert_idx, weights = [], []
    for p in probs:
        idx = (p + bias).topk(k, dim=-1).indices  # (N_j, k)
        w = p.gather(-1, idx)
        expert_idx.append(idx)
        weights.append(w / w.sum(dim=-1, keepdim=True) if k > 1 else w)
        load += torch.bincount(idx.reshape(-1), minlength=E)
    dist.all_reduce(load, group=group)
    load = load.to(bias.dtype)
    return expert_idx, weights, bias + rate * torch.sign(load.mean() - load)


def router_step(inputs: list) -> tuple:
    """One process holding every rank's micro-batches, routed by the course's `Router`:
    (each rank's {"expert_idx", "weights"} lists, the step's loads (E,), the new bias)."""
    bias, k, rate = inputs[0]["bias"], inputs[0]["k"], inputs[0]["rate"]
    E = bias.shape[0]
    router = Router(E, E, k, capacity_factor=None, bias_update_rate=rate)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(E))  # its logits are the input: log(probs)
        router.expert_bias.copy_(bias)
    per_rank = []
    with torch.enable_grad():  # the router counts a micro-batch only in a forward with autograd
        for case in inputs:
            idx, w = [], []
            for p in case["probs"]:
                routing = router(p.log().unsqueeze(0))  # (1, N_j, E): one group
                idx.append(routing.expert_idx[0].detach())
                w.append(routing.weights[0].detach())
            per_rank.append({"expert_idx": idx, "weights": w})
    loads = router.step_tokens_per_expert.clone()
    router.move_bias(loads)  # the rule's one place
    return per_rank, loads, router.expert_bias.clone()


def _tensor_list(x):
    if not isinstance(x, (list, tuple)):
        return None
    return [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in x]


def call_balanced_step(fn, case: dict) -> dict:
    bias = case["bias"].clone()
    out = fn([p.clone() for p in case["probs"]], bias, case["k"], case["rate"])
    parts = list(out) if isinstance(out, (tuple, list)) else []
    result = {"returned_type": type(out).__name__, "n_parts": len(parts),
              "bias_changed": not torch.equal(bias, case["bias"])}
    if len(parts) == 3:
        idx, w, new_bias = parts
        result.update(expert_idx=_tensor_list(idx), weights=_tensor_list(w),
                      new_bias=new_bias.detach().clone() if isinstance(new_bias, torch.Tensor) else None)
    return result


def expect_balanced_step(inputs: list) -> list:
    per_rank, loads, new_bias = router_step(inputs)
    return [dict(mine, loads=loads, new_bias=new_bias) for mine in per_rank]


def _check_list(got, want: list, name: str, kind: str, rank: int) -> str:
    if got is None:
        return f"rank {rank}: {name} is not a list of tensors, one per micro-batch"
    if len(got) != len(want):
        return f"rank {rank}: {name} has {len(got)} entries for {len(want)} micro-batches"
    for j, (g, w) in enumerate(zip(got, want)):
        if g is None:
            return f"rank {rank}: {name}[{j}] is not a tensor"
        if g.shape != w.shape or g.dtype != w.dtype:
            return (f"rank {rank}: {name}[{j}] is {g.dtype} {tuple(g.shape)}; expected {w.dtype} "
                    f"{tuple(w.shape)} ({kind})")
    return ""


def judge_balanced_step(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    k = inputs[0]["k"]
    for rank, (case, want, out) in enumerate(zip(inputs, expected, outputs)):
        if out["n_parts"] != 3:
            return (f"rank {rank} returned {out['returned_type']} of {out['n_parts']} items; "
                    f"expected the tuple (expert_idx, weights, new_bias)")
        if why := _check_list(out["expert_idx"], want["expert_idx"], "expert_idx",
                              "int64 (N_j, k)", rank):
            return why
        if why := _check_list(out["weights"], want["weights"], "weights", "float32 (N_j, k)", rank):
            return why
        for j, (got, w) in enumerate(zip(out["expert_idx"], want["expert_idx"])):
            if not torch.equal(got, w):
                t = int((got != w).any(dim=1).nonzero()[0])
                return (f"rank {rank}, micro-batch {j}, token {t}: experts {got[t].tolist()}, "
                        f"expected {w[t].tolist()} (the {k} largest probs + bias, largest first, "
                        f"with the bias the step started with)")
        for j, (got, w) in enumerate(zip(out["weights"], want["weights"])):
            bad = ~torch.isclose(got, w, **TOLERANCE)
            if bad.any():
                t = int(bad.any(dim=1).nonzero()[0])
                rule = ("k = 1: the raw probability" if k == 1 else
                        "the chosen probabilities renormalised to sum to 1")
                return (f"rank {rank}, micro-batch {j}, token {t}: weights "
                        f"{[round(x, 4) for x in got[t].tolist()]}, expected "
                        f"{[round(x, 4) for x in w[t].tolist()]} (the weights ignore the bias: "
                        f"{rule})")
        got = out["new_bias"]
        if got is None or got.shape != want["new_bias"].shape or got.dtype != want["new_bias"].dtype:
            what = "not a tensor" if got is None else f"{got.dtype} {tuple(got.shape)}"
            return f"rank {rank}: new_bias is {what}; expected float32 ({len(want['new_bias'])},)"
        if not TOLERANCE.close(got, want["new_bias"]):
            return (f"rank {rank}: new_bias {[round(x, 4) for x in got.tolist()]}, expected "
                    f"{[round(x, 4) for x in want['new_bias'].tolist()]}: the step's loads are "
                    f"{want['loads'].tolist()} (every micro-batch of every rank), and "
                    f"b + rate * sign(mean - load) once")
        if out["bias_changed"]:
            return f"rank {rank} changed its bias argument in place: return a new tensor"
    return ""


def _draw_probs(generator, n: int, E: int, k: int, bias: torch.Tensor, favour=()) -> torch.Tensor:
    """(n, E) float32 softmax rows whose biased scores are at least GAP apart among the top
    k + 1 of each row (rows too close drawn again)."""
    rows = []
    while len(rows) < n:
        logits = torch.randn(E, generator=generator, dtype=torch.float64)
        logits[list(favour)] += 2.0
        p = logits.softmax(-1).float()
        top = (p.double() + bias.double()).sort(descending=True).values[:k + 1]
        if len(top) < 2 or bool((top[:-1] - top[1:] >= GAP).all()):
            rows.append(p)
    return torch.stack(rows) if rows else torch.zeros(0, E)


def make_balanced_step_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    P = world_size

    def step(E, k, sizes, favour=(), bias=None, at_mean=False):
        """Per-rank inputs: sizes[r][j] tokens in rank r's micro-batch j."""
        rate = round(0.02 + 0.08 * float(torch.rand((), generator=generator)), 3)
        if bias is None:
            bias = 0.1 * torch.randn(E, generator=generator)
        for _ in range(1000):  # loads exactly at the mean: drawn until one expert's is
            probs = [[_draw_probs(generator, n, E, k, bias, favour) for n in mine] for mine in sizes]
            if not at_mean:
                break
            chosen = torch.cat([(p + bias).topk(k, dim=-1).indices.reshape(-1)
                                for mine in probs for p in mine])
            load = torch.bincount(chosen, minlength=E)
            if load.sum() % E == 0 and bool((load * E == load.sum()).any()) \
                    and not bool((load * E == load.sum()).all()):
                break
        return [{"probs": mine, "bias": bias.clone(), "k": k, "rate": rate} for mine in probs]

    def sizes(m, low, high):
        return [[int(torch.randint(low, high + 1, (), generator=generator)) for _ in range(m)]
                for _ in range(P)]

    empty_each = [[0 if j == r % 2 else n for j, n in enumerate(mine)]
                  for r, mine in enumerate(sizes(2, 2, 6))]
    mean_sizes = [[2, 4] for _ in range(P)]  # 6 tokens a rank: 6 P k assignments, E | 12 P
    skew_bias = 0.05 * torch.randn(8, generator=generator)
    skew_bias[:2] -= 0.3  # experts 0 and 1 already overloaded: their bias pushes tokens away
    return [
        Case("k=2 E=6, 3 micro-batches of uneven sizes", step(6, 2, sizes(3, 1, 7))),
        Case("k=1 E=4 (the raw probability), an empty micro-batch on every rank",
             step(4, 1, empty_each)),
        Case("k=2 E=8, skewed onto experts 0 and 1, whose bias already pushes tokens away",
             step(8, 2, sizes(2, 3, 8), favour=(0, 1), bias=skew_bias)),
        Case("k=2 E=4, an expert's load exactly the mean (its bias stays)",
             step(4, 2, mean_sizes, at_mean=True)),
        Case("k=3 E=8, 4 micro-batches, the last rank's all empty",
             step(8, 3, [[0] * 4 if r == P - 1 else mine for r, mine in enumerate(sizes(4, 1, 5))])),
    ]


def reference_balanced_step(case: dict) -> tuple:
    return course_balanced_step(case["probs"], case["bias"], case["k"], case["rate"])


BALANCED_STEP = on_subgroup(ExerciseSpec(
    id="balanced_step", title="Balancing by a bias, without an auxiliary loss",
    difficulty="★★☆ medium", world_sizes=(2, 3), make_cases=make_balanced_step_cases,
    call=call_balanced_step, expect=expect_balanced_step, judge=judge_balanced_step,
    reference=reference_balanced_step,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.expert_bias.course_balanced_step",
            "reference.expert_parallel.router.Router",
            "reference.expert_parallel.bias_balance")), (3,), (0, 3))
