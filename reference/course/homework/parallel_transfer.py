"""Hidden checks of homework 06's transfer exercises and its written question.

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

import torch

from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec

__all__ = ["RESHARD_PLAN", "STEP_BYTES_3D", "course_reshard_plan", "step_bytes_3d_formula"]

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


RESHARD_PLAN = ExerciseSpec(
    id="reshard_plan", title="Loading a TP checkpoint into another TP degree",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_reshard_cases,
    call=call_reshard, expect=expect_reshard, judge=judge_reshard, reference=course_reshard_plan,
    banned=("reference.course.homework.parallel_transfer.course_reshard_plan",
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
    banned=("reference.course.homework.parallel_transfer.step_bytes_3d_formula",))
