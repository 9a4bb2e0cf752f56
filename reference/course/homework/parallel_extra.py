"""Hidden checks of homework 06's transfer exercises and its written question.

* ``global_grad_norm(grads, tp_split, tp_group, pp_group)``: the gradient norm of the
  whole model on a tp x pp mesh, each number counted once. A rank holds its stage's
  gradients; a tensor with ``tp_split[i]`` True is this tp rank's own slice, one with
  False is replicated (the same numbers on every tp rank of the stage). Only
  ``all_reduce`` is allowed. Cases on 2, 3 and 4 ranks: tp only, pp only, tp x pp,
  stages with different numbers of tensors, slices of uneven sizes, float32 and
  float64. Every rank must return the same norm, relative to the float64 truth within
  `reference.tolerance.gradient(n)`, a sum over the n ranks (float32 sums of squares in
  another order differ by a few ulps, and the float64 cases are held to the same bound;
  counting the replicated tensors tp times, or forgetting the pp reduction, is off by far
  more: each case holds replicated and split tensors of comparable size).
* ``reshard_plan(n_rows, old_tp, new_tp)``: loading a checkpoint saved with one TP
  degree into another. Rows are split as ``torch.tensor_split`` splits them (the first
  ``n_rows % tp`` shards one row longer). For each new rank, the list of
  ``(old_rank, start, stop)`` pieces (row ranges in the old rank's local numbering)
  whose concatenation is its new shard; empty pieces may be left out. Cases: sizes
  that divide and do not, growing and shrinking tp, more ranks than rows, tp 1.
* ``step_bytes_3d(n_params, n_layer, b, s, h, microbatches, dp, tp, pp, pp_rank,
  bytes_per_element)``: the written question, graded exactly: every byte one rank of a
  3D run sends in one training step, the three dimensions together: tensor parallelism's
  four ring all-reduces of a (b, s, h) activation per layer of its stage and
  micro-batch, the pipeline's activation forward and gradient backward per micro-batch
  (none forward from the last stage, none backward from the first), and data
  parallelism's ring all-reduce of the rank's n_params / (tp pp) gradients. Cases with
  one-stage pipelines, first, middle and last stages, dp, tp or pp of 1.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import gradient

__all__ = ["GLOBAL_GRAD_NORM", "RESHARD_PLAN", "STEP_BYTES_3D", "course_global_grad_norm",
           "course_reshard_plan", "step_bytes_3d_formula"]

# ------------------------------------------------------------------ global_grad_norm


def course_global_grad_norm(grads, tp_split, tp_group, pp_group) -> float:
    """The course's answer: sum g^2 of what this rank counts, all-reduce over tp, then pp."""
    first_tp = dist.get_rank(tp_group) == 0
    total = torch.zeros((), dtype=torch.float64)
    for g, split in zip(grads, tp_split):
        if split or first_tp:
            total += g.double().pow(2).sum()
    dist.all_reduce(total, group=tp_group)
    dist.all_reduce(total, group=pp_group)
    return math.sqrt(total.item())


def _groups(tp: int, pp: int):
    """(this rank's tp group, its pp group); every rank creates every group, in one order."""
    rank, mine = dist.get_rank(), {}
    for stage in range(pp):
        ranks = [stage * tp + t for t in range(tp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["tp"] = group
    for t in range(tp):
        ranks = [stage * tp + t for stage in range(pp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["pp"] = group
    return mine["tp"], mine["pp"]


def call_global_grad_norm(fn, case: dict) -> dict:
    tp_group, pp_group = _groups(case["tp"], case["pp"])
    grads = [g.clone() for g in case["grads"]]
    out = fn(grads, list(case["tp_split"]), tp_group, pp_group)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    value = float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None
    return {"norm": value, "type": type(out).__name__,
            "changed": any(not torch.equal(a, b) for a, b in zip(grads, case["grads"]))}


def expect_global_grad_norm(inputs: list) -> list:
    tp = inputs[0]["tp"]
    total = 0.0
    for rank, case in enumerate(inputs):
        for g, split in zip(case["grads"], case["tp_split"]):
            if split or rank % tp == 0:
                total += float(g.double().pow(2).sum())
    return [math.sqrt(total)] * len(inputs)


def judge_global_grad_norm(inputs, expected, outputs, world_size) -> str:
    case = inputs[0]
    where = f"tp={case['tp']} pp={case['pp']}"
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out["norm"] is None:
            return f"rank {rank} returned a {out['type']}, not a number ({where})"
        if out["changed"]:
            return f"rank {rank} changed its gradients (the norm only reads them)"
        if not gradient(world_size).allows(out["norm"] - want, want):
            return (f"rank {rank}: norm {out['norm']:.6g}, the model's is {want:.6g} ({where}; "
                    f"ratio {out['norm'] / want:.4g})")
    return ""


def _rand(generator, shape, dtype):
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def make_norm_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    meshes = [(tp, world_size // tp) for tp in (world_size, 1) if world_size % tp == 0]
    if world_size == 4:
        meshes.append((2, 2))
    cases = []
    for tp, pp in meshes:
        for dtype in (torch.float32, torch.float64):
            per_rank = [None] * world_size
            for stage in range(pp):
                n = draw(2, 4)
                split = [True, False] + [bool(draw(0, 1)) for _ in range(n - 2)]
                stage_grads = [[] for _ in range(tp)]
                for s in split:
                    if s:   # each tp rank its own slice, of uneven lengths
                        for t in range(tp):
                            stage_grads[t].append(_rand(generator, (draw(3, 9), 4), dtype))
                    else:   # the same numbers on every tp rank of the stage
                        g = _rand(generator, (draw(10, 30),), dtype)
                        for t in range(tp):
                            stage_grads[t].append(g.clone())
                for t in range(tp):
                    per_rank[stage * tp + t] = {"tp": tp, "pp": pp, "grads": stage_grads[t],
                                                "tp_split": split}
            cases.append(Case(f"tp={tp} pp={pp} {str(dtype).split('.')[-1]}", per_rank))
    return cases


def torch_global_grad_norm(case: dict) -> float:
    return course_global_grad_norm(case["grads"], case["tp_split"], *_groups(case["tp"], case["pp"]))


# ------------------------------------------------------------------ reshard_plan

def _bounds(n: int, tp: int) -> list[tuple[int, int]]:
    """(start, stop) of each rank's rows in the full tensor, as torch.tensor_split cuts them."""
    base, extra = divmod(n, tp)
    out, start = [], 0
    for r in range(tp):
        stop = start + base + (r < extra)
        out.append((start, stop))
        start = stop
    return out


def course_reshard_plan(n_rows: int, old_tp: int, new_tp: int) -> list:
    old = _bounds(n_rows, old_tp)
    plan = []
    for lo, hi in _bounds(n_rows, new_tp):
        pieces = []
        for r, (a, b) in enumerate(old):
            s, e = max(lo, a), min(hi, b)
            if s < e:
                pieces.append((r, s - a, e - a))
        plan.append(pieces)
    return plan


def call_reshard(fn, case: dict) -> dict:
    out = fn(case["n_rows"], case["old_tp"], case["new_tp"])
    try:
        plan = [[tuple(int(x) for x in piece) for piece in pieces] for pieces in out]
    except (TypeError, ValueError):
        return {"error": f"returned {type(out).__name__}, not a list (per new rank) of "
                         f"(old_rank, start, stop) lists"}
    if any(len(p) != 3 for pieces in plan for p in pieces):
        return {"error": "every piece is (old_rank, start, stop)"}
    return {"plan": [[list(p) for p in pieces if p[1] != p[2]] for pieces in plan], "error": ""}


def expect_reshard(inputs: list) -> list:
    c = inputs[0]
    return [[[list(p) for p in pieces]
             for pieces in course_reshard_plan(c["n_rows"], c["old_tp"], c["new_tp"])]]


def judge_reshard(inputs, expected, outputs, world_size) -> str:
    out, want, c = outputs[0], expected[0], inputs[0]
    if out.get("error"):
        return out["error"]
    got = out["plan"]
    if len(got) != len(want):
        return f"{len(got)} lists for new_tp={c['new_tp']} ranks"
    for rank, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return (f"new rank {rank} of {c['new_tp']} (n_rows={c['n_rows']}, old_tp="
                    f"{c['old_tp']}): {g}, expected {w}")
    return ""


def make_reshard_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    specs = [(8 * draw(2, 6), 2, 4), (8 * draw(2, 6), 4, 2), (draw(20, 40) * 6 + 1, 3, 2),
             (draw(20, 40) * 6 + 5, 2, 3), (draw(2, 3), 2, 4), (draw(9, 17), 1, 3),
             (draw(9, 17), 4, 1), (draw(30, 50), 3, 3)]
    return [Case(f"n_rows={n} tp {a}->{b}", [dict(n_rows=n, old_tp=a, new_tp=b)])
            for n, a, b in specs]


# ------------------------------------------------------------------ the written question

def step_bytes_3d_formula(n_params, n_layer, b, s, h, microbatches, dp, tp, pp, pp_rank,
                          bytes_per_element) -> int:
    """Bytes one rank sends in one step of a dp x tp x pp run (1F1B, ring collectives, no SP)."""
    act = b * s * h                                     # one (b, s, h) activation, elements
    # TP: 2 all-reduces forward and 2 backward per layer of the stage and micro-batch; a ring
    # all-reduce of n elements sends 2 (tp - 1) / tp n of them (tp divides b s h).
    tp_sent = (n_layer // pp) * microbatches * 4 * 2 * (tp - 1) * act // tp
    # PP: per micro-batch an activation to the next stage, a gradient to the previous one.
    pp_sent = microbatches * act * ((pp_rank < pp - 1) + (pp_rank > 0))
    # DP: the ring all-reduce of this rank's gradients, 2 (dp - 1) chunks of ceil(m / dp).
    m = n_params // (tp * pp)
    dp_sent = 2 * (dp - 1) * -(-m // dp)
    return (tp_sent + pp_sent + dp_sent) * bytes_per_element


GLOBAL_GRAD_NORM = ExerciseSpec(
    id="global_grad_norm", title="The gradient norm of a tp x pp model, each number once",
    difficulty="★★☆ medium", world_sizes=(2, 3, 4), make_cases=make_norm_cases,
    call=call_global_grad_norm, expect=expect_global_grad_norm, judge=judge_global_grad_norm,
    reference=torch_global_grad_norm,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.parallel_extra.course_global_grad_norm",
            "reference.parallel.clip"))
RESHARD_PLAN = ExerciseSpec(
    id="reshard_plan", title="Loading a TP checkpoint into another TP degree",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_reshard_cases,
    call=call_reshard, expect=expect_reshard, judge=judge_reshard, reference=course_reshard_plan,
    banned=("reference.course.homework.parallel_extra.course_reshard_plan",
            "reference.train.reshard"))
# pp_rank is drawn below 1 (the first stage) or 2: with pp = 1 the only stage sends no
# activation and no gradient, with pp = 2 a rank is first or last, with pp = 3 or more
# rank 1 is a middle stage. n_params divides by tp pp and b s h by tp in every draw.
STEP_BYTES_3D = question(
    "step_bytes_3d", "Every byte a rank sends in one step of a 3D run",
    step_bytes_3d_formula,
    {"n_params": (124_439_808, 6_000_000_000, 1_200, 350_000_016), "n_layer": (12, 24, 48, 96),
     "b": (1, 2, 4), "s": (1024, 2048), "h": (768, 2048, 12288), "microbatches": (1, 4, 8, 16),
     "dp": (1, 2, 3, 8), "tp": (1, 2, 4), "pp": (1, 2, 3, 4), "pp_rank": (0, 1),
     "bytes_per_element": (2, 4)},
    fixed=({"n_params": 1_200, "n_layer": 6, "b": 1, "s": 4, "h": 6, "microbatches": 5,
            "dp": 7, "tp": 2, "pp": 3, "pp_rank": 2, "bytes_per_element": 4},
           {"n_params": 1_200, "n_layer": 4, "b": 2, "s": 4, "h": 4, "microbatches": 3,
            "dp": 1, "tp": 1, "pp": 1, "pp_rank": 0, "bytes_per_element": 2}),
    banned=("reference.course.homework.parallel_extra.step_bytes_3d_formula",))
