"""Hidden checks of homework 02's transfer exercises and its written question.

* ``clip_sharded_grad_norm_(grad_shard, numel, max_norm, norm_type, group)``: gradient
  clipping under ZeRO. Each rank holds its shard ``(S,)`` of the averaged flat gradient
  (S = ceil(numel / N)); positions at or past ``numel`` in the flat layout are padding
  and hold garbage (large values, so a norm that reads them is far off). The function
  returns the norm of the ``numel`` real numbers (2-norm or inf-norm), the same on every
  rank, and scales the real numbers in place by ``min(1, max_norm / (norm + 1e-6))``,
  as ``torch.nn.utils.clip_grad_norm_`` does. One all-reduce of one number, nothing
  else. Cases on 2 and 3 ranks: Psi not divisible by N, float64 with max_norm not
  reached (nothing changes), the inf-norm, bfloat16 gradients, and a model of one number
  (the other ranks hold only padding).
  Tolerances, the course's (reasoned in reference/tolerance.py): the norm within
  `gradient(N)` of the float64 truth, relative to it (a float32 sum of squares over the
  N ranks' shards, added in another order, differs by a few ulps; counting the padding
  or forgetting the other shards is off by far more); the clipped numbers within the
  rtol of `forward()`, `forward(torch.bfloat16)` for bfloat16, and no atol (a product's
  rounding is relative to itself: one rounding of the coefficient and one of the
  product, each at most the unit roundoff, 2^-8 in bfloat16).
* ``fsdp_schedule(n_units, max_whole)``: ZeRO-3's gathers, computations, frees and
  reduce-scatters as a list of actions, judged by a simulator (`simulate`): the
  computations in order (forward 0..n-1, backward n-1..0), a unit whole when it
  computes, at most ``max_whole`` units whole at once, and prefetch: when a computation
  starts, the units of the next ``max_whole - 1`` distinct computations to come are
  already whole (gathered ahead, or never freed). Each gradient reduce-scattered once,
  right after its backward; no more gathers than that requires; nothing whole at the
  end. Cases: one unit, no prefetch (max_whole 1), max_whole above n, several depths.
* ``zero_max_params(memory_bytes, n, stage, k)``: the written question, graded exactly.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.course.homework.data_parallel import collectives_allowed
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.memory import Precision, model_state_bytes
from reference.tolerance import forward, gradient

__all__ = ["CLIP", "FSDP_SCHEDULE", "ZERO_MAX_PARAMS", "course_clip_sharded_grad_norm_",
           "course_fsdp_schedule", "zero_max_params_formula", "simulate", "OPS"]

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


# ------------------------------------------------------------------ clip_sharded_grad_norm_

def course_clip_sharded_grad_norm_(grad_shard, numel, max_norm, norm_type=2.0, group=None):
    """The course's answer: this rank's real numbers, one all-reduce (SUM of squares or MAX)."""
    rank = dist.get_rank(group)
    real = grad_shard[:max(0, min(grad_shard.numel(), numel - rank * grad_shard.numel()))]
    values = real.detach().double()
    if norm_type == math.inf:
        local = values.abs().max() if values.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local.item()
    else:
        local = values.pow(2).sum()
        dist.all_reduce(local, group=group)
        total = math.sqrt(local.item())
    real.mul_(min(1.0, max_norm / (total + EPS)))
    return total


def _norm(values: torch.Tensor, norm_type: float) -> float:
    values = values.double()
    if norm_type == math.inf:
        return values.abs().max().item() if values.numel() else 0.0
    return math.sqrt(values.pow(2).sum().item())


def make_clip_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    n = world_size
    plan = (("float32, 2-norm, clipped, Psi not divisible by N", torch.float32, 2.0, True,
             n * draw(5, 12) + 1),
            ("float64, max_norm not reached", torch.float64, 2.0, False, n * draw(5, 12)),
            ("float32, inf-norm, clipped", torch.float32, math.inf, True, n * draw(5, 12) + n - 1),
            ("bfloat16, 2-norm, clipped", torch.bfloat16, 2.0, True, n * draw(5, 12) + 1),
            ("one number: the other ranks hold only padding", torch.float32, 2.0, True, 1))
    cases = []
    for name, dtype, norm_type, clipped, numel in plan:
        grad = (torch.randn(numel, generator=generator, dtype=torch.float64) * 0.1).to(dtype)
        shard = -(-numel // n)
        garbage = 50.0 + torch.rand(n * shard - numel, generator=generator, dtype=torch.float64)
        flat = torch.cat([grad, garbage.to(dtype)])  # (N S,): the padding is not zero
        true = _norm(grad, norm_type)
        factor = 0.2 + 0.4 * torch.rand((), generator=generator).item() if clipped else 1.5
        max_norm = true * factor  # below the norm (clipped) or above it (left alone)
        cases.append(Case(name, [{"shard": flat[r * shard:(r + 1) * shard].clone(), "numel": numel,
                                  "max_norm": max_norm, "norm_type": norm_type} for r in range(n)]))
    return cases


def call_clip(fn, case: dict) -> dict:
    shard = case["shard"].clone()
    log = []
    with collectives_allowed(("allreduce",), lambda name, numel, *_: log.append(numel)):
        out = fn(shard, case["numel"], case["max_norm"], norm_type=case["norm_type"])
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    norm = float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None
    return {"norm": norm, "type": type(out).__name__, "shard": shard, "all_reduced": log}


def expect_clip(inputs: list) -> list:
    n, case = len(inputs), inputs[0]
    shard = case["shard"].numel()
    flat = torch.cat([r["shard"] for r in inputs])
    real = flat[:case["numel"]]
    total = _norm(real, case["norm_type"])
    scaled = real.double() * min(1.0, case["max_norm"] / (total + EPS))
    return [{"norm": total, "real": scaled[r * shard:(r + 1) * shard]} for r in range(n)]


def _why_norm(inputs, got: float) -> str:
    case = inputs[0]
    flat = torch.cat([r["shard"] for r in inputs])
    mine = [r["shard"][:max(0, min(len(r["shard"]), case["numel"] - i * len(r["shard"])))]
            for i, r in enumerate(inputs)]
    if math.isclose(got, _norm(flat, case["norm_type"]), rel_tol=1e-3):
        return " (the padding was counted: leave out flat positions >= numel)"
    if any(math.isclose(got, _norm(m, case["norm_type"]), rel_tol=1e-3) for m in mine if m.numel()):
        return " (the norm of one shard only: combine the ranks' parts)"
    return ""


def judge_clip(inputs, expected, outputs, world_size) -> str:
    for rank, (out, want) in enumerate(zip(outputs, expected)):  # every rank's norm first
        if out["norm"] is None:
            return f"rank {rank} returned a {out['type']}, not the norm (a number)"
        if not gradient(world_size).allows(out["norm"] - want["norm"], want["norm"]):
            return (f"rank {rank}: norm {out['norm']:.6g}, the gradient's is {want['norm']:.6g}"
                    + _why_norm(inputs, out["norm"]))
    for rank, (out, want, inp) in enumerate(zip(outputs, expected, inputs)):
        got, k = out["shard"], want["real"].numel()
        if not isinstance(got, torch.Tensor) or got.shape != inp["shard"].shape or got.dtype != inp["shard"].dtype:
            return f"rank {rank}: grad_shard changed its shape or dtype (scale it in place)"
        # products, each rounded relative to itself: the forward bound's rtol, no atol
        rtol = forward(torch.bfloat16 if got.dtype == torch.bfloat16 else torch.float32).rtol
        if not torch.allclose(got[:k].double(), want["real"], rtol=rtol, atol=0.0):
            unchanged = torch.equal(got[:k], inp["shard"][:k])
            return (f"rank {rank}: the real numbers of grad_shard are not scaled by "
                    f"min(1, max_norm / (norm + 1e-6))" + (" (left unchanged)" if unchanged else ""))
        if len(out["all_reduced"]) != 1 or out["all_reduced"][0] != 1:
            return (f"rank {rank} all-reduced {out['all_reduced']} numbers; clipping needs one "
                    f"all-reduce of one number")
    return ""


def torch_clip(case: dict) -> float:
    return course_clip_sharded_grad_norm_(case["shard"].clone(), case["numel"], case["max_norm"],
                                          case["norm_type"])


# ------------------------------------------------------------------ fsdp_schedule

OPS = ("gather", "forward", "backward", "free", "reduce_scatter")


def _computations(n: int) -> list:
    return [("forward", u) for u in range(n)] + [("backward", u) for u in reversed(range(n))]


def needed(n: int, max_whole: int, j: int) -> list:
    """Units that must be whole when computation j starts: its own, then the next
    max_whole - 1 distinct units to compute."""
    units = []
    for _, u in _computations(n)[j:]:
        if len(units) == max_whole:
            break
        if u not in units:
            units.append(u)
    return units


def course_fsdp_schedule(n_units: int, max_whole: int) -> list:
    actions, whole = [], []
    for j, (op, unit) in enumerate(_computations(n_units)):
        need = needed(n_units, max_whole, j)
        actions += [("free", u) for u in whole if u not in need]  # free first: memory
        whole = [u for u in whole if u in need]
        actions += [("gather", u) for u in need if u not in whole]
        whole += [u for u in need if u not in whole]
        actions.append((op, unit))
        if op == "backward":
            actions.append(("reduce_scatter", unit))
    return actions + [("free", u) for u in whole]


def simulate(actions, n: int, max_whole: int) -> str:
    """"" when `actions` is a valid ZeRO-3 schedule with prefetch, else the first reason."""
    comps = _computations(n)
    whole, gathers, done, reduced, j = set(), 0, set(), set(), 0
    for i, (op, unit) in enumerate(actions):
        where = f"action {i} {(op, unit)}"
        if op not in OPS or not 0 <= unit < n:
            return f"{where}: not an action (op in {OPS}, unit in 0..{n - 1})"
        if op == "gather":
            if unit in whole:
                return f"{where}: unit {unit} is already whole"
            whole.add(unit)
            gathers += 1
            if len(whole) > max_whole:
                return f"{where}: {len(whole)} units whole at once, max_whole={max_whole}"
        elif op == "free":
            if unit not in whole:
                return f"{where}: unit {unit} is not whole"
            whole.discard(unit)
        elif op == "reduce_scatter":
            if unit not in done or unit in reduced:
                return f"{where}: reduce-scatter once per unit, after its backward"
            reduced.add(unit)
        else:
            if j == len(comps) or (op, unit) != comps[j]:
                nxt = comps[j] if j < len(comps) else "nothing"
                return f"{where}: the next computation is {nxt} (forward 0..n-1, then backward n-1..0)"
            if j and comps[j - 1][0] == "backward" and comps[j - 1][1] not in reduced:
                return (f"{where}: unit {comps[j - 1][1]}'s gradient is not reduce-scattered yet "
                        f"(do it right after its backward)")
            if unit not in whole:
                return f"{where}: unit {unit} is not whole"
            late = [u for u in needed(n, max_whole, j) if u not in whole]
            if late:
                return (f"{where}: unit {late[0]} (needed soon) is not whole yet: with "
                        f"max_whole={max_whole}, prefetch the next {max_whole - 1} unit(s)")
            if op == "backward":
                done.add(unit)
            j += 1
    if j < len(comps):
        return f"the schedule stops before {comps[j]}"
    if len(reduced) < n:
        return f"unit {min(set(range(n)) - reduced)}'s gradient is never reduce-scattered"
    if whole:
        return f"unit {min(whole)} is still whole at the end"
    least = sum(op == "gather" for op, _ in course_fsdp_schedule(n, max_whole))
    if gathers > least:
        return f"{gathers} gathers where {least} do: a unit still needed soon should stay whole"
    return ""


def call_schedule(fn, case: dict) -> dict:
    out = fn(case["n_units"], case["max_whole"])
    try:
        actions = [[str(op), int(unit)] for op, unit in out]
    except (TypeError, ValueError):
        return {"error": f"returned {type(out).__name__}, not a list of (op, unit) pairs"}
    return {"actions": actions, "error": ""}


def expect_schedule(inputs: list) -> list:
    return [course_fsdp_schedule(inputs[0]["n_units"], inputs[0]["max_whole"])]


def judge_schedule(inputs, expected, outputs, world_size) -> str:
    out, case = outputs[0], inputs[0]
    if out.get("error"):
        return out["error"]
    why = simulate([tuple(a) for a in out["actions"]], case["n_units"], case["max_whole"])
    return f"n_units={case['n_units']} max_whole={case['max_whole']}: {why}" if why else ""


def make_schedule_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    plan = [(1, 2), (draw(3, 5), 1), (4, 2), (draw(5, 7), 2), (draw(5, 6), 3), (2, 4),
            (draw(5, 7), 4)]
    return [Case(f"n_units={n} max_whole={k}", [dict(n_units=n, max_whole=k)]) for n, k in plan]


# ------------------------------------------------------------------ the written question

def zero_max_params_formula(memory_bytes, n, stage, k) -> int:
    """Largest Psi whose model states fit: fp16 parameters and gradients (2 + 2 bytes), k bytes
    of optimizer state; one flat buffer padded to N S, S = ceil(Psi / N), for stages 1-3."""
    if stage == 0:
        return memory_bytes // (4 + k)
    per_shard_number = {1: 4 * n + k, 2: 2 * n + 2 + k, 3: 4 + k}[stage]  # bytes per unit of S
    return n * (memory_bytes // per_shard_number)


def fits(psi: int, memory_bytes: int, n: int, stage: int, k: int) -> bool:
    """The course's model: model_state_bytes with 2 + 2 + k bytes per parameter."""
    return model_state_bytes(psi, n, stage, Precision(2, 2, k)).model_states <= memory_bytes


CLIP = on_subgroup(ExerciseSpec(
    id="clip_sharded_grad_norm_", title="Gradient clipping under ZeRO: one norm over the shards",
    difficulty="★★☆ medium", world_sizes=(2, 3), make_cases=make_clip_cases, call=call_clip,
    expect=expect_clip, judge=judge_clip, reference=torch_clip,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.zero_transfer.course_clip_sharded_grad_norm_",
            "reference.parallel.clip")), (3,), (0, 4))
FSDP_SCHEDULE = ExerciseSpec(
    id="fsdp_schedule", title="ZeRO-3 with prefetch, as a schedule of actions",
    difficulty="★★★ hard", world_sizes=(1,), make_cases=make_schedule_cases, call=call_schedule,
    expect=expect_schedule, judge=judge_schedule, reference=course_fsdp_schedule,
    banned=("reference.course.homework.zero_transfer.course_fsdp_schedule",
            "reference.zero.fsdp", "reference.zero.units"))
ZERO_MAX_PARAMS = question(
    "zero_max_params", "The largest model whose model states fit", zero_max_params_formula,
    {"memory_bytes": (80_000_000_000, 40_000_000_000, 24 * 2**30, 16 * 2**30, 999_999_937),
     "n": (1, 2, 3, 8, 64, 100), "stage": (0, 1, 2, 3), "k": (12, 8, 6, 4)},
    fixed=({"memory_bytes": 1_000, "n": 3, "stage": 2, "k": 12},
           {"memory_bytes": 80_000_000_000, "n": 8, "stage": 1, "k": 12}),
    banned=("reference.course.homework.zero_transfer.zero_max_params_formula",
            "reference.memory.model_state_bytes"))
