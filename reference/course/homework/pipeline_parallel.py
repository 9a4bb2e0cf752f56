"""Hidden checks of homework 04: GPipe's and 1F1B's action lists, written by hand.

The student writes `fn(pp, m, rank)`, the list of `Action`s (or plain tuples
``(op, mb, chunk, peer)``) that pipeline rank `rank` runs for `m` micro-batches.
Inside a rank the check calls it for every rank of the pipeline (the course's
`build_schedule` is switched off meanwhile: the list must be the student's own)
and sends back the lists as plain data. Here, in the grader, they are rebuilt
into a `Schedule` and judged:

* the course's checker: every list complete, every message matched, no deadlock;
* the order of computation: GPipe runs the m forwards, in order, before any
  backward; 1F1B keeps at most ``pp - rank`` micro-batches in flight on rank `rank`;
* the simulated timeline (a forward takes 1, a backward 2, messages are free) has
  the textbook bubble (p - 1) / (m + p - 1): a message posted too late, or a
  schedule that pipelines less, makes it larger;
* 1F1B only: the ranks also *run* their lists with the course's executor on a
  tiny GPT (pp = 2 and 4 ranks, untied weights, layers that do not always divide
  by pp); the loss and every parameter's gradient must equal those of one
  process on the full batch (the course's bounds, `reference.tolerance.loss()` and
  `gradient(m)` for a sum over the m micro-batches).

Cases: GPipe on one rank for pipelines of 1 to 5 stages; 1F1B on 2 and 4 ranks;
both with m = 1, m < pp, m = pp and m > pp, some m not a multiple of pp.

The course's own lists (`course_gpipe_actions`, `course_one_f_one_b_actions`, and the
code of `build_schedule` that writes them) are refused to the student's code. The
homework's other exercises live in `pipeline_interleaved` (interleaved 1F1B's lists
and the written question on its memory), `pipeline_zero_bubble` (1F1B turned into ZB-H1)
and `pipeline_balance` (stages balanced by time within memory); what the schedule
exercises share, in `pipeline_runs`.
"""
from __future__ import annotations

import torch

from reference.course.homework.pipeline_runs import (  # noqa: F401 (the checks' names, re-exported)
    batch_case, judge_run, model_config, no_course_schedules, plain_actions,
    run_lists, schedule_of, single_process, student_lists,
)
from reference.course.homework.scoring import Case, ExerciseSpec, one_line
from reference.pipeline_parallel.registry import build_schedule
from reference.pipeline_parallel.schedules import Schedule, ScheduleError, bubble_formula
from reference.tolerance import forward

__all__ = ["GPIPE", "ONE_F_ONE_B", "EXERCISES", "plain_actions", "schedule_from",
           "no_course_schedules", "model_config", "course_gpipe_actions",
           "course_one_f_one_b_actions"]

schedule_from = schedule_of  # (pp, m, lists) -> Schedule, one chunk per rank
# The code that writes the course's lists (build_schedule itself is switched off by
# `no_course_schedules` with its own message).
COURSE_SCHEDULES = ("reference.pipeline_parallel.schedules._compute_groups",
                    "reference.pipeline_parallel.schedules._with_comms")


# ------------------------------------------------------------------ inside a rank

def call_gpipe(fn, case: dict) -> dict:
    lists, error = student_lists("gpipe_actions", fn, case["pp"], case["m"])
    return {"actions": lists, "error": error}


def call_one_f_one_b(fn, case: dict) -> dict:
    """Build the schedule from the student's lists and, when it is valid, run it here."""
    lists, error = student_lists("one_f_one_b_actions", fn, case["pp"], case["m"])
    out = {"actions": lists, "error": error, "ran": False, "loss": None, "grads": {}}
    if not error:
        out.update(run_lists(lists, case))
    return out


def course_actions(case: dict, kind: str) -> list:
    """The course's own lists for the case, as plain data."""
    s = build_schedule(kind, case["pp"], case["m"])
    return [plain_actions(s.actions(r))[0] for r in range(case["pp"])]


def course_gpipe(case: dict) -> list:
    return course_actions(case, "gpipe")


def course_one_f_one_b(case: dict) -> list:
    return course_actions(case, "1f1b")


def course_gpipe_actions(pp: int, m: int, rank: int) -> list:
    """The course's answer, with the student's signature (refused to the student's code)."""
    return build_schedule("gpipe", pp, m).actions(rank)


def course_one_f_one_b_actions(pp: int, m: int, rank: int) -> list:
    return build_schedule("1f1b", pp, m).actions(rank)


# ------------------------------------------------------------------ in the grader

def _compute_order(schedule: Schedule, rank: int) -> str:
    return " ".join(f"{a.op}{a.mb}" for a in schedule.actions(rank) if not a.is_comm)


def _judge_schedule(case: dict, out: dict, expected: dict, order_rule) -> str:
    """The checks both exercises share: valid, ordered as the schedule says, smallest bubble."""
    pp, m = case["pp"], case["m"]
    if out["error"]:
        return one_line(out["error"])
    try:
        schedule = schedule_from(pp, m, out["actions"]).validate()
    except ScheduleError as err:
        return "invalid schedule: " + one_line(err, 180)
    for rank in range(pp):
        if why := order_rule(schedule, rank):
            return f"rank {rank}: {why}"
    bubble = schedule.bubble_fraction()
    # the simulated fraction and the formula, the same number in float64's last bits
    if bubble > expected["bubble"] and not forward(torch.float64).allows(bubble - expected["bubble"],
                                                                          expected["bubble"]):
        return (f"bubble {bubble:.3f} in the simulated timeline, more than (p-1)/(m+p-1) = "
                f"{expected['bubble']:.3f}: some rank waits for a message posted later than "
                f"needed, or the ranks pipeline less than they could")
    return ""


def _gpipe_order(schedule: Schedule, rank: int) -> str:
    m = schedule.m
    ops = [(a.op, a.mb) for a in schedule.actions(rank) if not a.is_comm]
    if ops[:m] != [("F", i) for i in range(m)]:
        return (f"GPipe runs the forwards F0..F{m - 1} in order before any backward; yours "
                f"computes {_compute_order(schedule, rank)}")
    return ""


def _one_f_one_b_order(schedule: Schedule, rank: int) -> str:
    pp = schedule.pp
    peak = schedule.peak_in_flight(rank)
    if peak > pp - rank:
        return (f"holds the activations of {peak} micro-batches at once; 1F1B holds at most "
                f"pp - rank = {pp - rank} (yours computes {_compute_order(schedule, rank)})")
    return ""


def expect_gpipe(inputs: list) -> list:
    case = inputs[0]
    return [{"bubble": bubble_formula("gpipe", case["pp"], case["m"])}] * len(inputs)


def judge_gpipe(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    return _judge_schedule(inputs[0], outputs[0], expected[0], _gpipe_order)


def expect_one_f_one_b(inputs: list) -> list:
    """The single-process truth: the full batch through the whole model."""
    case = inputs[0]
    return [dict(single_process(case), bubble=bubble_formula("1f1b", case["pp"], case["m"]))
            ] * len(inputs)


def judge_one_f_one_b(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    case, want = inputs[0], expected[0]
    # The list each rank ran is its own; the ranks' copies of the others' are not needed.
    mine = dict(outputs[0], actions=[o["actions"][r] if len(o["actions"]) > r else []
                                     for r, o in enumerate(outputs)])
    return _judge_schedule(case, mine, want, _one_f_one_b_order) or judge_run(outputs, want, case["m"])


# ------------------------------------------------------------------ cases

def make_gpipe_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    # a pipeline of one, m = 1, m < pp, m = pp, m > pp (a multiple of pp or not)
    sizes = [(1, draw(1, 4)), (2, 1), (3, 2), (4, 4), (4, draw(5, 9)), (5, draw(2, 11))]
    return [Case(f"pp={pp} m={m}", [{"pp": pp, "m": m}] * world_size) for pp, m in sizes]


def make_one_f_one_b_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    """pp = world_size; m = 1, below pp, pp and above; micro-batches of 1 or 2 sequences."""
    pp = world_size
    cases = []
    for m in sorted({1, max(pp - 1, 2), pp, pp + 1, 2 * pp + 1}):
        n_layer = pp + int(torch.randint(0, 2, (), generator=generator))  # uneven split or not
        case = batch_case(generator, pp, m, n_layer)
        cases.append(Case(f"pp={pp} m={m} ({n_layer} layers)", [case] * world_size))
    return cases


GPIPE = ExerciseSpec(
    id="gpipe_actions", title="GPipe's action list for one rank", difficulty="★☆☆ easy",
    world_sizes=(1,), make_cases=make_gpipe_cases, call=call_gpipe, expect=expect_gpipe,
    judge=judge_gpipe, reference=course_gpipe,
    banned=("reference.course.homework.pipeline_parallel.course_gpipe_actions",
            *COURSE_SCHEDULES))
ONE_F_ONE_B = ExerciseSpec(
    id="one_f_one_b_actions", title="1F1B's action list for one rank, run by the executor",
    difficulty="★★☆ medium", world_sizes=(2, 4), make_cases=make_one_f_one_b_cases,
    call=call_one_f_one_b, expect=expect_one_f_one_b, judge=judge_one_f_one_b,
    reference=course_one_f_one_b,
    banned=("reference.course.homework.pipeline_parallel.course_one_f_one_b_actions",
            *COURSE_SCHEDULES))
HOMEWORK_ID = "04_pipeline_parallel"
# Two warm-ups (the lecture's GPipe and 1F1B written by hand), three transfers to what the
# lecture did not build (interleaved lists; 1F1B turned into ZB-H1; stages balanced by
# time under a memory budget) and the written question.
from reference.course.homework.pipeline_balance import BALANCE_STAGES  # noqa: E402
from reference.course.homework.pipeline_interleaved import (  # noqa: E402 - after the specs
    INTERLEAVED_ACTIONS, INTERLEAVED_PEAK_BYTES,
)
from reference.course.homework.pipeline_zero_bubble import ZB_H1_ACTIONS  # noqa: E402

# An answer failing any case keeps at most half: a rule broken alone shows only in the
# cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (GPIPE, ONE_F_ONE_B, INTERLEAVED_ACTIONS, ZB_H1_ACTIONS, BALANCE_STAGES,
             INTERLEAVED_PEAK_BYTES)
