"""Hidden checks of homework 07: reading a profile, diagnosing a step, and the MFU question.

* ``step_breakdown(compute, communication, step)`` (the warm-up): one rank's step from its
  trace. ``compute`` is a list of (start, end) intervals of the main thread's operators
  (nested and overlapping: an operator inside another), ``communication`` maps a kind
  ("all_reduce", ...) to the (start, end) intervals of its collectives, ``step`` is the
  step's (start, end); everything outside the step is ignored. Returns seconds:
  ``compute`` (the union of the compute intervals), ``communication`` (the union of every
  kind's intervals where nothing computes), ``hidden`` (communication under computation)
  and ``idle`` (the rest of the step). Compared within `time_tolerance`: the course's
  float64 bound for a sum of n lengths in another order (`reference.tolerance.gradient(n,
  torch.float64)`, reasoned in reference/tolerance.py), for times of order the trace's
  largest rather than 1 (`at_scale`): a union summed in another order differs by a few
  float64 ulps of the times (1e-3 to 1 s), a missed merge or clip by at least 1e-4.
  Cases: nested operators, communication under compute, kinds overlapping each other,
  intervals crossing the step's ends, no communication, intervals out of order.
* ``diagnose(profile)``: a step's per-rank profile with one planted problem (or none);
  returns (problem, fix) with problem one of PROBLEMS: a straggler (fix: its rank), a
  pipeline bubble above the target (fix: the fewest micro-batches that meet it), a
  communication share over 30 % of many small all-reduces (latency: fix the bucket size
  in bytes at which a ring all-reduce's latency and bandwidth terms are equal, N alpha /
  beta, relative to it within `QUESTION_RTOL`, a float64's last bits) or of large ones
  (bandwidth: fix None), or healthy (None). The profile's `beta` is seconds per byte
  (1 / bandwidth), the convention of notebook 00 and homework 00. Cases are clear-cut (a
  straggler computes at least 1.8 times the others; where the share decides, it is below
  20 % or above 35 %; bytes per call are a quarter of N alpha / beta or less, or 4 times
  or more; no bubble target sits on a whole number of micro-batches) and set traps: a straggler's and a bubble's waiting also raise the
  communication share, and a pipeline with enough micro-batches has no bubble problem.
  Half the cases are latency-bound, on 2 to 64 ranks: the one diagnosis whose fix is a
  number, which reading beta as a bandwidth (N alpha beta) gets wrong in every case.
* ``mfu(...)``: the written question, graded on other values to `QUESTION_RTOL` relative.
PowerSGD's compressed all-reduce, the transfer exercise on ranks, is checked in
`performance_powersgd`.
"""
from __future__ import annotations

import math
import numbers
import statistics

import torch

from reference.course.homework.questions import QUESTION_RTOL, question
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import Tolerance, gradient

__all__ = ["STEP_BREAKDOWN", "DIAGNOSE", "MFU", "EXERCISES", "PROBLEMS", "course_step_breakdown",
           "course_diagnose", "mfu_formula", "time_tolerance", "COMM_LIMIT"]

COMM_LIMIT = 0.3  # the article's "communication over 30 % of the step"
PROBLEMS = ("straggler", "bubble", "latency", "bandwidth", "healthy")
KEYS = ("compute", "communication", "hidden", "idle")


def _draw(generator, lo, hi) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=generator, dtype=torch.float64))


def _pick(generator, options):
    return options[int(torch.randint(len(options), (), generator=generator))]


# ------------------------------------------------------------------ step_breakdown

def _union(intervals, lo, hi) -> list:
    """The intervals clipped to [lo, hi], merged and sorted."""
    out = []
    for a, b in sorted([max(a, lo), min(b, hi)] for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(xs, ys) -> float:
    """Length of the intersection of two merged, sorted interval lists."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


def course_step_breakdown(compute, communication, step) -> dict:
    lo, hi = step
    busy = _union(compute, lo, hi)
    comm = _union([iv for ivs in communication.values() for iv in ivs], lo, hi)
    computing = sum(b - a for a, b in busy)
    hidden = _overlap(comm, busy)
    exposed = sum(b - a for a, b in comm) - hidden
    return {"compute": computing, "communication": exposed, "hidden": hidden,
            "idle": (hi - lo) - computing - exposed}


def call_breakdown(fn, case: dict) -> dict:
    out = fn([list(iv) for iv in case["compute"]],
             {k: [list(iv) for iv in v] for k, v in case["communication"].items()}, list(case["step"]))
    if not isinstance(out, dict):
        return {"error": f"returned a {type(out).__name__}, not a dict"}
    values = {}
    for key in KEYS:
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return {"error": f"no number under {key!r} (got {type(value).__name__})"}
        values[key] = float(value)
    return {"values": values, "error": ""}


def time_tolerance(case: dict) -> Tolerance:
    """gradient(n, float64) at the scale of the trace's times: n lengths (the intervals' and
    the step's), each an end minus a start rounded relative to the times, added in another
    order than here."""
    intervals = list(case["compute"]) + [iv for ivs in case["communication"].values() for iv in ivs]
    scale = max(abs(t) for iv in intervals + [case["step"]] for t in iv)
    return gradient(len(intervals) + 1, torch.float64).at_scale(scale)


def expect_breakdown(inputs: list) -> list:
    case = inputs[0]
    return [course_step_breakdown(case["compute"], case["communication"], case["step"])]


def judge_breakdown(inputs, expected, outputs, world_size) -> str:
    out, want = outputs[0], expected[0]
    if out.get("error"):
        return out["error"]
    tol = time_tolerance(inputs[0])
    for key in KEYS:
        got = out["values"][key]
        if not tol.allows(got - want[key], want[key]):  # NaN never is
            return f"{key}: {got * 1e3:.4f} ms, the trace says {want[key] * 1e3:.4f} ms"
    return ""


def make_breakdown_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    ms = 1e-3

    def span(lo, hi):  # a random interval inside [lo, hi] ms
        a = _draw(generator, lo, (lo + hi) / 2)
        return [a * ms, _draw(generator, a + (hi - a) / 4, hi) * ms]

    ops = [span(10 * i, 10 * i + 8) for i in range(6)]           # forward/backward operators
    nested = ops + [[a + (b - a) / 4, b - (b - a) / 4] for a, b in ops[::2]]
    specs = {
        "disjoint": (ops[:3], {"all_reduce": [span(32, 38), span(42, 48)]}, [0.0, 0.06]),
        "nested operators": (nested, {"all_reduce": [span(62, 70)]}, [0.0, 0.075]),
        "communication under compute": (ops, {"all_reduce": [span(12, 30), span(41, 56)]}, [0.0, 0.06]),
        "kinds overlapping each other": (ops[:2], {"all_gather": [span(5, 30)], "reduce_scatter": [span(18, 40)],
                                                   "send": [span(35, 45)]}, [0.0, 0.05]),
        "crossing the step's ends": ([[-0.004, 0.003]] + ops[1:4], {"all_reduce": [span(36, 39), [0.038, 0.051]]},
                                     [0.0, 0.045]),
        "no communication": (nested[:4], {"all_reduce": []}, [0.0, 0.045]),
    }
    shuffled = [ops[i] for i in torch.randperm(len(ops), generator=generator).tolist()]
    specs["out of order"] = (shuffled, {"recv": [span(55, 64), span(26, 33)][::-1]}, [0.0, 0.066])
    return [Case(name, [dict(compute=c, communication=m, step=s)]) for name, (c, m, s) in specs.items()]


# ------------------------------------------------------------------ diagnose

def course_diagnose(profile):
    ranks = profile["ranks"]
    compute = [r["compute"] for r in ranks]
    slowest = max(range(len(ranks)), key=compute.__getitem__)
    if compute[slowest] > 1.25 * statistics.median(compute):    # the others wait for it
        return "straggler", slowest
    p, m, target = profile["pp"], profile["microbatches"], profile["target_bubble"]
    if p > 1 and (p - 1) / (m + p - 1) > target:                # the stages wait in recv
        while (p - 1) / (m + p - 1) > target:
            m += 1
        return "bubble", m
    share = statistics.mean(sum(r["communication"].values()) /
                            (r["compute"] + sum(r["communication"].values()) + r["idle"]) for r in ranks)
    if share <= COMM_LIMIT:
        return "healthy", None
    calls = sum(r["calls"].get("all_reduce", 0) for r in ranks)
    per_call = sum(r["bytes"].get("all_reduce", 0) for r in ranks) / calls
    # 2(N-1) alpha = 2(N-1)/N S beta: the latency and bandwidth terms are equal at S = N alpha / beta.
    crossover = profile["world_size"] * profile["alpha"] / profile["beta"]
    return ("latency", crossover) if per_call < crossover else ("bandwidth", None)


def call_diagnose(fn, case: dict) -> dict:
    out = fn(case)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return {"error": f"returned {type(out).__name__}, not (problem, fix)"}
    problem, fix = out
    if isinstance(fix, torch.Tensor) and fix.numel() == 1:
        fix = fix.item()
    if fix is not None and (isinstance(fix, bool) or not isinstance(fix, numbers.Real)):
        return {"error": f"the fix is a {type(fix).__name__}: a number or None"}
    if fix is not None:  # plain Python numbers (numpy's too), an int staying an int
        fix = int(fix) if isinstance(fix, numbers.Integral) else float(fix)
    return {"problem": str(problem), "fix": fix, "fix_type": type(fix).__name__, "error": ""}


def expect_diagnose(inputs: list) -> list:
    return [course_diagnose(inputs[0])]


def judge_diagnose(inputs, expected, outputs, world_size) -> str:
    out, (problem, fix) = outputs[0], expected[0]
    if out.get("error"):
        return out["error"]
    if out["problem"] != problem:
        return f"diagnosed {out['problem']!r}; the planted problem is {problem!r}"
    if fix is None:
        return "" if out["fix"] is None else f"{problem}: the fix is None, got {out['fix']!r}"
    if out["fix"] is None:
        return f"{problem}: no fix given"
    if isinstance(fix, int):
        if out["fix_type"] != "int" or out["fix"] != fix:
            return f"{problem}: fix {out['fix']!r}, expected {fix}"
        return ""
    if not math.isclose(float(out["fix"]), fix, rel_tol=QUESTION_RTOL):
        return f"{problem}: fix {float(out['fix']):.6g} bytes, expected {fix:.6g}"
    return ""


def _rank(compute, waiting, kind="all_reduce", idle=0.0, calls=0, nbytes=0.0):
    comm = {"all_reduce": 0.0, "send": 0.0, "recv": 0.0}
    comm[kind] += waiting
    return {"compute": compute, "communication": comm, "idle": idle,
            "calls": {"all_reduce": calls}, "bytes": {"all_reduce": nbytes * calls}}


def make_diagnose_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return _draw(generator, lo, hi)

    def profile(kind, n, pp=1, m=1, target=0.13):
        alpha = _pick(generator, (5e-6, 1e-5, 2e-5))
        beta = 1 / _pick(generator, (12.5e9, 25e9, 50e9))       # seconds per byte
        cross, c = n * alpha / beta, draw(0.05, 0.2)
        ranks = []
        slow = int(torch.randint(n, (), generator=generator))
        factor = draw(1.8, 3.0)
        for r in range(n):
            cr = c * draw(0.97, 1.03)
            calls = int(torch.randint(4, 12, (), generator=generator))
            if kind == "straggler":
                lag = (factor - 1) * c
                ranks.append(_rank(c * factor if r == slow else cr, draw(0.01, 0.03) * c + (0 if r == slow else lag),
                                   idle=0.01 * c, calls=calls, nbytes=cross * draw(4, 20)))
            elif kind == "bubble":
                b = (pp - 1) / (m + pp - 1)
                ranks.append(_rank(cr, cr * b / (1 - b), kind="recv", idle=0.01 * c, calls=2, nbytes=cross * 8))
            elif kind in ("latency", "bandwidth"):
                size = cross * (draw(0.02, 0.25) if kind == "latency" else draw(4, 50))
                ranks.append(_rank(cr, cr * draw(0.6, 1.5), idle=0.02 * c, calls=calls * 20, nbytes=size))
            else:
                ranks.append(_rank(cr, cr * draw(0.05, 0.2), idle=0.01 * c, calls=calls,
                                   nbytes=cross * _pick(generator, (0.1, 10.0))))
        return dict(world_size=n, pp=pp, microbatches=m, target_bubble=target, alpha=alpha, beta=beta, ranks=ranks)

    specs = [("straggler, 4 ranks", profile("straggler", 4)), ("straggler, 8 ranks", profile("straggler", 8)),
             ("bubble, pp 4", profile("bubble", 4, pp=4, m=int(torch.randint(1, 5, (), generator=generator)),
                                      target=_pick(generator, (0.11, 0.13)))),
             ("bubble, pp 8 x dp 2", profile("bubble", 16, pp=8, m=8, target=_pick(generator, (0.17, 0.23)))),
             ("latency", profile("latency", 8)), ("latency, 2 ranks", profile("latency", 2)),
             ("latency, 16 ranks", profile("latency", 16)), ("latency, 32 ranks", profile("latency", 32)),
             ("latency, 64 ranks", profile("latency", 64)),
             ("latency, a pipeline with enough micro-batches", profile("latency", 4, pp=2, m=16, target=0.11)),
             ("bandwidth", profile("bandwidth", 8)), ("healthy", profile("healthy", 4))]
    return [Case(name, [p]) for name, p in specs]


# ------------------------------------------------------------------ the written question

def mfu_formula(n_params, n_layer, seq_len, n_embd, tokens_per_step, step_seconds, n_gpus, peak_flops) -> float:
    """Training FLOPs of the step's tokens (6 N + 12 L T C each), over the time and the GPUs' peak."""
    flops = tokens_per_step * (6 * n_params + 12 * n_layer * seq_len * n_embd)
    return flops / (step_seconds * n_gpus * peak_flops)


STEP_BREAKDOWN = ExerciseSpec(
    id="step_breakdown", title="A step's time from its trace: compute, communication, hidden, idle",
    difficulty="★☆☆ easy", world_sizes=(1,), make_cases=make_breakdown_cases, call=call_breakdown,
    expect=expect_breakdown, judge=judge_breakdown, reference=course_step_breakdown,
    banned=("reference.course.homework.performance.course_step_breakdown", "reference.profile"))
DIAGNOSE = ExerciseSpec(
    id="diagnose", title="Find the planted problem in a profile, and its fix", difficulty="★★☆ medium",
    world_sizes=(1,), make_cases=make_diagnose_cases, call=call_diagnose, expect=expect_diagnose,
    judge=judge_diagnose, reference=course_diagnose,
    banned=("reference.course.homework.performance.course_diagnose", "reference.comms.cost",
            "reference.pipeline_parallel.schedules"))
MFU = question(
    "mfu", "The MFU of a training run", mfu_formula,
    {"n_params": (124_439_808, 1_315_723_264, 6_656_000_000, 174_604_259_328),
     "n_layer": (12, 24, 32, 96), "seq_len": (1024, 2048, 4096), "n_embd": (768, 2048, 4096, 12288),
     "tokens_per_step": (524_288, 1_048_576, 3_145_728), "step_seconds": (0.9, 2.5, 12.0, 31.4),
     "n_gpus": (8, 64, 1024), "peak_flops": (312e12, 989e12)},
    kind="real", fixed=({"n_params": 1_315_723_264, "n_layer": 24, "seq_len": 2048, "n_embd": 2048,
                         "tokens_per_step": 1_048_576, "step_seconds": 1.5, "n_gpus": 64,
                         "peak_flops": 312e12},),
    banned=("reference.course.homework.performance.mfu_formula", "reference.profile"))
HOMEWORK_ID = "07_performance"
from reference.course.homework.performance_powersgd import POWERSGD  # noqa: E402 - after the specs

# An answer failing any case keeps at most half: a rule broken alone shows only in the
# cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (STEP_BREAKDOWN, DIAGNOSE, POWERSGD, MFU)
