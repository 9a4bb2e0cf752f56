"""Hidden checks of homework 04's interleaved schedule, and of its written question.

* ``interleaved_actions(pp, m, v, rank)``: interleaved 1F1B written by hand. Rank `rank`
  holds ``v`` chunks, chunk ``c`` being model stage ``c * pp + rank``; ``m`` is a
  multiple of ``pp`` or smaller than it. The lecture only built it with
  `build_schedule("interleaved", ...)`; here the student writes the lists (the course's
  schedules are switched off meanwhile, and their code refused). A case passes when
  the lists form a valid schedule (the course's checker, ``virtual=v``), no rank holds
  more (micro-batch, chunk) activations at once than Megatron's warm-up allows,
  ``min((v-1) g + 2 (pp-1-rank) + 1, v m)`` with ``g = min(pp, m)``, and the simulated
  timeline reaches the bubble of `bubble_formula("interleaved", pp, m, v)`. On 2 and 3
  ranks the lists are also run by the course's executor on a tiny GPT cut into
  ``pp * v`` stages (layers that do not always divide); loss and gradients must equal
  one process's (`pipeline_runs`). Cases: m = 1, m < pp, m = pp, m a multiple of pp;
  v = 2, 3 and 4; pipelines of 2 to 5 ranks.
* ``interleaved_peak_bytes(pp, m, v, rank, stage_bytes)``: the written question, graded
  exactly: the activation bytes rank `rank` holds at its peak under interleaved 1F1B,
  when one micro-batch leaves `stage_bytes` on the rank's layers (``stage_bytes / v``
  on each chunk).
"""
from __future__ import annotations

import torch

from reference.course.homework.pipeline_runs import (
    batch_case, judge_run, plain_actions, run_lists, schedule_of, single_process, student_lists,
)
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec, one_line
from reference.pipeline_parallel.registry import build_schedule
from reference.pipeline_parallel.schedules import ScheduleError, bubble_formula
from reference.tolerance import forward

__all__ = ["INTERLEAVED_ACTIONS", "INTERLEAVED_PEAK_BYTES", "course_interleaved_actions",
           "in_flight_bound", "interleaved_peak_bytes_formula"]


def course_interleaved_actions(pp: int, m: int, v: int, rank: int) -> list:
    """The course's answer, with the student's signature (refused to the student's code)."""
    return build_schedule("interleaved", pp, m, v).actions(rank)


def in_flight_bound(pp: int, m: int, v: int, rank: int) -> int:
    """Most (micro-batch, chunk) activations rank holds: its warm-up forwards plus one."""
    g = min(pp, m)  # micro-batches per round
    return min((v - 1) * g + 2 * (pp - 1 - rank) + 1, v * m)


def call_interleaved(fn, case: dict) -> dict:
    """Every rank's list from the student's function; run here when the case says so."""
    lists, error = student_lists("interleaved_actions", fn, case["pp"], case["m"], case["v"])
    out = {"actions": lists, "error": error, "ran": False, "loss": None, "grads": {}}
    if not error and "x" in case:
        out.update(run_lists(lists, case, case["v"]))
    return out


def expect_interleaved(inputs: list) -> list:
    case = inputs[0]
    want = {"bubble": bubble_formula("interleaved", case["pp"], case["m"], case["v"])}
    if "x" in case:
        want.update(single_process(case))
    return [want] * len(inputs)


def _order(schedule, rank: int) -> str:
    return " ".join(f"{a.op}{a.mb}.c{a.chunk}" for a in schedule.actions(rank) if not a.is_comm)


def judge_interleaved(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    case, want = inputs[0], expected[0]
    pp, m, v = case["pp"], case["m"], case["v"]
    first = outputs[0]
    if first["error"]:
        return one_line(first["error"])
    # Run on pp ranks, each rank's list is the one it ran; on one rank, all are rank 0's.
    lists = first["actions"] if world_size == 1 else \
        [o["actions"][r] if len(o["actions"]) > r else [] for r, o in enumerate(outputs)]
    try:
        schedule = schedule_of(pp, m, lists, virtual=v).validate()
    except ScheduleError as err:
        return "invalid schedule: " + one_line(err, 180)
    for rank in range(pp):
        peak, bound = schedule.peak_in_flight(rank), in_flight_bound(pp, m, v, rank)
        if peak > bound:
            return (f"rank {rank} holds the activations of {peak} (micro-batch, chunk) pairs at "
                    f"once; interleaved 1F1B holds at most {bound} (yours computes "
                    f"{one_line(_order(schedule, rank), 90)})")
    bubble = schedule.bubble_fraction()
    # the simulated fraction and the formula, the same number in float64's last bits
    if bubble > want["bubble"] and not forward(torch.float64).allows(bubble - want["bubble"],
                                                                      want["bubble"]):
        return (f"bubble {bubble:.3f} in the simulated timeline, more than interleaved 1F1B's "
                f"{want['bubble']:.3f}: a rank waits for a message posted later than needed, "
                f"or warms up with too few forwards")
    return judge_run(outputs, want, m) if "x" in case else ""


def make_interleaved_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    """One rank: the lists of pipelines of 2 to 5 ranks, judged here. pp = world_size
    ranks: the same, then run by the executor."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    if world_size == 1:  # m = pp, m = 1, multiples of pp, m < pp, v = 2, 3, 4
        sizes = [(2, 2, 2), (2, 1, 3), (3, 6, 2), (4, 8, 2), (4, 2, 3), (3, 3, 4),
                 (5, 5 * draw(1, 2), 2)]
        return [Case(f"pp={pp} m={m} v={v}", [{"pp": pp, "m": m, "v": v}]) for pp, m, v in sizes]
    sizes = {2: [(2, 4, 2), (2, 1, 3)], 3: [(3, 3, 2), (3, 2, 2)]}[world_size]
    cases = []
    for pp, m, v in sizes:
        n_layer = pp * v + draw(0, 1)  # every stage a block; sometimes one stage two
        case = batch_case(generator, pp, m, n_layer, v=v)
        cases.append(Case(f"pp={pp} m={m} v={v} ({n_layer} layers, run)", [case] * world_size))
    return cases


def course_interleaved(case: dict) -> list:
    """The course's lists for the case, as plain data."""
    return [plain_actions(course_interleaved_actions(case["pp"], case["m"], case["v"], r))[0]
            for r in range(case["pp"])]


# ------------------------------------------------------------------ the written question

def interleaved_peak_bytes_formula(pp, m, v, rank, stage_bytes) -> int:
    """Megatron's warm-up (v-1) g + 2 (pp-1-rank) forwards, plus the steady state's one,
    at most all v m, each (micro-batch, chunk) pair stage_bytes / v."""
    return in_flight_bound(pp, m, v, rank) * (stage_bytes // v)


INTERLEAVED_ACTIONS = ExerciseSpec(
    id="interleaved_actions", title="Interleaved 1F1B's action lists, run by the executor",
    difficulty="★★★ hard", world_sizes=(1, 2, 3), make_cases=make_interleaved_cases,
    call=call_interleaved, expect=expect_interleaved, judge=judge_interleaved,
    reference=course_interleaved,
    banned=("reference.course.homework.pipeline_interleaved.course_interleaved_actions",
            "reference.pipeline_parallel.registry.build_schedule",
            "reference.pipeline_parallel.schedules.build_interleaved",
            "reference.pipeline_parallel.schedules._compute_groups",
            "reference.pipeline_parallel.schedules._with_comms"))
INTERLEAVED_PEAK_BYTES = question(
    "interleaved_peak_bytes", "The activation bytes a rank holds under interleaved 1F1B",
    interleaved_peak_bytes_formula,
    # every m is a multiple of every pp or below it; every stage_bytes divides by every v
    {"pp": (2, 3, 4, 8), "m": (1, 2, 24, 48), "v": (2, 3, 4), "rank": (0, 1),
     "stage_bytes": (120, 12_582_912, 402_653_184, 1_207_959_552)},
    fixed=({"pp": 4, "m": 1, "v": 2, "rank": 3, "stage_bytes": 120},
           {"pp": 3, "m": 2, "v": 3, "rank": 0, "stage_bytes": 1_207_959_552},
           {"pp": 8, "m": 48, "v": 2, "rank": 7, "stage_bytes": 402_653_184}),
    banned=("reference.course.homework.pipeline_interleaved.interleaved_peak_bytes_formula",
            "reference.course.homework.pipeline_interleaved.in_flight_bound",
            "reference.pipeline_parallel.schedules"), difficulty="★★☆ medium")
