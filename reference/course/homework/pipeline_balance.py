"""Hidden checks of homework 04's stage balancing: by time, within each rank's memory.

``balance_stages(times, weight_bytes, activation_bytes, pp, m, memory)``: the model is a
chain of units (the embedding, the blocks, the head); unit i takes ``times[i]`` for one
micro-batch's forward and backward, holds ``weight_bytes[i]`` of weights, gradients and
optimizer state, and leaves ``activation_bytes[i]`` stored per micro-batch in flight.
Cut it into ``pp`` contiguous, non-empty stages so that the slowest stage (the pipeline's
pace) is as fast as possible, while every stage fits in ``memory`` under 1F1B, where
stage r holds ``min(pp - r, m)`` micro-batches in flight:

    weights(stage r) + min(pp - r, m) * activations(stage r) <= memory

Return the list of ``pp`` stage sizes (units per stage, in order), or None when no cut
fits. The lecture balanced parameter counts; this balances time, and the memory a stage
needs depends on where it sits in the pipeline. Any cut whose slowest stage equals the
optimum passes (ties are common). Expected answers: `course_balance_stages`, a dynamic
programme over (stages used, units taken); the cases' budgets are chosen by trying every
cut (`best_cut`), so that in some the fastest cut does not fit and the next one must be
found. Cases: a GPT-like chain (an embedding that is nearly free in time but heavy in
weights, a head heavy in both and holding the logits), random chains, equal times (many
best cuts), m < pp, one stage, a stage per unit, a budget met exactly, and no cut that fits.
One rank per case; nothing is communicated.
"""
from __future__ import annotations

import itertools
import numbers

import torch

from reference.course.homework.scoring import Case, ExerciseSpec

__all__ = ["BALANCE_STAGES", "course_balance_stages", "stage_memory", "best_cut"]


def _prefix(values) -> list:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def stage_memory(weight_bytes, activation_bytes, pp: int, m: int, sizes) -> list:
    """Bytes each stage of the cut `sizes` holds under 1F1B."""
    out, start = [], 0
    for r, n in enumerate(sizes):
        part = slice(start, start + n)
        out.append(sum(weight_bytes[part]) + min(pp - r, m) * sum(activation_bytes[part]))
        start += n
    return out


def _stage_times(times, sizes) -> list:
    bounds = _prefix(sizes)
    return [sum(times[a:b]) for a, b in zip(bounds, bounds[1:])]


def course_balance_stages(times, weight_bytes, activation_bytes, pp, m, memory):
    """The course's answer: best[j][i] is the fastest slowest stage of the first i units
    cut into j stages that fit, from best[j - 1][h] and the stage h..i."""
    L = len(times)
    T, W, A = _prefix(times), _prefix(weight_bytes), _prefix(activation_bytes)
    best = [[None] * (L + 1) for _ in range(pp + 1)]
    cut = [[0] * (L + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for j in range(1, pp + 1):
        held = min(pp - (j - 1), m)  # micro-batches stage j - 1 keeps in flight
        for i in range(j, L + 1):
            for h in range(j - 1, i):
                if best[j - 1][h] is None or W[i] - W[h] + held * (A[i] - A[h]) > memory:
                    continue
                worst = max(best[j - 1][h], T[i] - T[h])
                if best[j][i] is None or worst < best[j][i]:
                    best[j][i], cut[j][i] = worst, h
    if best[pp][L] is None:
        return None
    sizes, i = [], L
    for j in range(pp, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def best_cut(times, weight_bytes, activation_bytes, pp, m, memory=None) -> tuple:
    """By trying every cut: (fastest slowest stage, least memory among those cuts, least
    memory of any cut), memory None meaning no budget. For building cases only."""
    L, found = len(times), []
    for cuts in itertools.combinations(range(1, L), pp - 1):
        sizes = [b - a for a, b in zip((0,) + cuts, cuts + (L,))]
        need = max(stage_memory(weight_bytes, activation_bytes, pp, m, sizes))
        if memory is None or need <= memory:
            found.append((max(_stage_times(times, sizes)), need))
    if not found:
        return None, None, None
    fastest = min(t for t, _ in found)
    return fastest, min(n for t, n in found if t == fastest), min(n for _, n in found)


# ------------------------------------------------------------------ in a rank and here

def call_balance(fn, case: dict) -> dict:
    out = fn(list(case["times"]), list(case["weight_bytes"]), list(case["activation_bytes"]),
             case["pp"], case["m"], case["memory"])
    if out is None:
        return {"sizes": None, "error": ""}
    if not isinstance(out, (list, tuple)) or not all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in out):
        return {"error": f"returned {type(out).__name__}, not a list of stage sizes (ints) or None"}
    return {"sizes": [int(n) for n in out], "error": ""}


def expect_balance(inputs: list) -> list:
    c = inputs[0]
    sizes = course_balance_stages(c["times"], c["weight_bytes"], c["activation_bytes"],
                                  c["pp"], c["m"], c["memory"])
    return [{"sizes": sizes, "slowest": None if sizes is None else max(_stage_times(c["times"], sizes))}]


def judge_balance(inputs, expected, outputs, world_size) -> str:
    c, want, out = inputs[0], expected[0], outputs[0]
    if out.get("error"):
        return out["error"]
    got, pp, L = out["sizes"], c["pp"], len(c["times"])
    if got is None:
        return ("" if want["sizes"] is None else
                f"returned None, but a cut fits: {want['sizes']} (slowest stage {want['slowest']})")
    if len(got) != pp or min(got) < 1 or sum(got) != L:
        return f"{got} is not {pp} non-empty stages covering the {L} units"
    for r, need in enumerate(stage_memory(c["weight_bytes"], c["activation_bytes"], pp, c["m"], got)):
        if need > c["memory"]:
            held = min(pp - r, c["m"])
            return (f"stage {r} of {got} needs {need} bytes: its weights plus min(pp - r, m) = "
                    f"{held} micro-batches of activations; the budget is {c['memory']}"
                    + ("" if want["sizes"] else " (no cut fits: return None)"))
    if want["sizes"] is None:
        return f"{got} fits, yet the course's search finds no cut that fits (report this)"
    slowest = max(_stage_times(c["times"], got))
    if slowest > want["slowest"]:
        return (f"your slowest stage takes {slowest}; the cut {want['sizes']} fits and its "
                f"slowest takes {want['slowest']}")
    return ""


# ------------------------------------------------------------------ cases

def make_balance_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    def gpt(n_blocks):
        """An embedding (fast, heavy weights), blocks, a head (slow, heavy, the logits)."""
        return ([1] + [draw(8, 12) for _ in range(n_blocks)] + [draw(16, 24)],
                [draw(300, 400)] + [draw(100, 140) for _ in range(n_blocks)] + [draw(300, 400)],
                [draw(1, 3)] + [draw(20, 30) for _ in range(n_blocks)] + [draw(60, 90)])

    def chain(n):
        return ([draw(1, 20) for _ in range(n)], [draw(10, 100) for _ in range(n)],
                [draw(5, 50) for _ in range(n)])

    def binding(make, pp, m):
        """A chain and a budget under which the fastest cut does not fit, but another does."""
        for _ in range(50):
            units = make()
            _, fastest_needs, least = best_cut(*units, pp, m)
            if least < fastest_needs:
                return units, draw(least, fastest_needs - 1)
        raise RuntimeError("no binding budget found")  # never met with these chains

    plenty = 10**9
    cases = []

    def add(name, units, pp, m, memory):
        cases.append(Case(f"{name}: {len(units[0])} units, pp={pp} m={m}",
                          [dict(times=units[0], weight_bytes=units[1], activation_bytes=units[2],
                                pp=pp, m=m, memory=memory)]))

    add("GPT-like, time only", gpt(8), 4, 8, plenty)
    add("random chain, time only", chain(9), 3, 6, plenty)
    units, budget = binding(lambda: gpt(10), 4, 8)
    add("GPT-like, the budget binds", units, 4, 8, budget)
    units, budget = binding(lambda: chain(10), 4, 2)
    add("random chain, m < pp, the budget binds", units, 4, 2, budget)
    units, budget = binding(lambda: chain(19), 6, 12)
    add("longer chain, the budget binds", units, 6, 12, budget)
    units = chain(8)
    add("nothing fits", units, 3, 4, best_cut(*units, 3, 4)[2] - 1)
    units = chain(7)
    add("one stage, the budget met exactly", units, 1, 3, sum(units[1]) + sum(units[2]))
    add("a stage per unit", chain(5), 5, 5, plenty)
    add("equal times, many best cuts", ([5] * 12, [10] * 12, [draw(1, 9) for _ in range(12)]),
        4, 4, plenty)
    return cases


def course_balance(case: dict):
    return course_balance_stages(case["times"], case["weight_bytes"], case["activation_bytes"],
                                 case["pp"], case["m"], case["memory"])


BALANCE_STAGES = ExerciseSpec(
    id="balance_stages", title="Stages balanced by time within each rank's memory",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_balance_cases,
    call=call_balance, expect=expect_balance, judge=judge_balance, reference=course_balance,
    banned=("reference.course.homework.pipeline_balance.course_balance_stages",
            "reference.pipeline_parallel.stage._min_max_cut",
            "reference.pipeline_parallel.stage.plan_stages"))
