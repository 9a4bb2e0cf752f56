"""Hidden checks of homework 04's zero-bubble exercise: 1F1B turned into ZB-H1 by hand.

``zb_h1_actions(pp, m, rank)``: the list of `Action`s of pipeline rank `rank` (one stage per
rank, ``m >= pp`` micro-batches) when every backward is split into I (the input's gradient,
which the previous stage waits for) and W (the weights' gradients, which nobody waits for),
and the W's are placed where 1F1B idles. The messages are the student's too: I carries B's
(``RECV_B`` just before, ``SEND_B`` just after), W none. The lecture built ZB-H1 only with
`build_schedule("zb-h1", ...)`; here the student writes it from 1F1B's lists (exercise 2).
Its rules, all checked on every case:

* no B: every backward in its two halves I and W;
* the lists form a valid zero-bubble schedule: `ZeroBubbleSchedule(pp, m, lists).validate()`
  (complete, each W after its I, every message matched, no deadlock; sends are not waited
  for, as the executor's `AsyncMailbox` posts them);
* no rank holds more than ``pp`` micro-batches at once, from F to W
  (`Schedule.peak_in_flight`): 1F1B's peak on rank 0;
* with F = I = W (``bubble_fraction(1, 2, 1)``) the simulated idle share is at most ZB-H1's,
  `zero_bubble_formula("zb-h1", pp, m, 1, 2, 1)` = (p - 1) F / (m (F + B) + (p - 1) F), a
  third of 1F1B's idle time. Under the memory rule it is also the least any list reaches:
  rank 0 cannot run an (pp + 1)-th forward before its first I, which comes back at
  pp F + (pp - 1) I;
* on 2 and 4 ranks the lists are run by the course's executor (`run_pipeline`, I and W by
  `reference.pipeline_parallel.split_backward`) on a tiny GPT; the loss and every gradient
  equal one process's (`pipeline_runs.judge_run`, the bounds of `reference.tolerance`).
  Lists that break a rule above (`list_rules`, the same in the rank and here) are not run:
  a wrong answer costs the grader no executor.

Cases: pp in {2, 3, 4} and every m from pp to 2 pp + 1. The launch on 2 ranks runs every
pipeline of 2 and judges the lists of the pipelines of 3 and 4 ranks (no process needs
them); the launch on 4 ranks runs two pipelines of 4, m drawn in pp .. pp + 2 and in
pp + 3 .. 2 pp + 1 (17 cases). The course's ZB-H1 (`build_zb_h1`, the order it
writes, its messages) is refused to the student's code.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.course.homework.pipeline_runs import (
    batch_case, judge_run, model_config, plain_actions, schedule_of, single_process, student_lists,
)
from reference.course.homework.scoring import Case, ExerciseSpec, one_line
from reference.pipeline_parallel.schedules import ScheduleError
from reference.pipeline_parallel.zero_bubble import ZeroBubbleSchedule, build_zb_h1, zero_bubble_formula
from reference.tolerance import forward

__all__ = ["ZB_H1_ACTIONS", "course_zb_h1_actions", "zb_schedule_of", "list_rules", "run_zb_lists",
           "TIMES"]

TIMES = (1.0, 2.0, 1.0)  # F, B = I + W, W: F = I = W, the paper's and the lecture's


def course_zb_h1_actions(pp: int, m: int, rank: int) -> list:
    """The course's answer, with the student's signature (refused to the student's code)."""
    return build_zb_h1(pp, m).validate().actions(rank)


def zb_schedule_of(pp: int, m: int, lists: list) -> ZeroBubbleSchedule:
    """A `ZeroBubbleSchedule` (sends not waited for) from plain lists, one chunk per rank."""
    plain = schedule_of(pp, m, lists)
    return ZeroBubbleSchedule(pp, m, {r: plain.actions(r) for r in range(pp)}, 1, "yours")


# ------------------------------------------------------------------ inside a rank

def run_zb_lists(lists: list, case: dict) -> dict:
    """In a rank: run this rank's list with the executor when the lists meet the rules a list
    alone shows (`list_rules`; {"ran": False} otherwise: the grader says why from the same
    lists, and a wrong answer costs no run)."""
    from reference.model import GPT
    from reference.pipeline_parallel import run_pipeline
    from reference.pipeline_parallel.stage import local_stages, split_stages

    out = {"ran": False, "loss": None, "grads": {}}
    if list_rules(case["pp"], case["m"], lists):
        return out
    schedule = zb_schedule_of(case["pp"], case["m"], lists).validate()
    model = GPT.from_config_seed(model_config(case["n_layer"]), seed=case["seed"])
    stages = local_stages(split_stages(model, case["pp"]), case["pp"], dist.get_rank())
    result = run_pipeline(schedule, stages, case["x"], case["y"])
    out.update(ran=True, loss=None if result.loss is None else result.loss.detach().clone(),
               grads={n: p.grad.detach().clone() for s in stages
                      for n, p in s.named_parameters() if p.grad is not None})
    return out


def call_zb_h1(fn, case: dict) -> dict:
    """Every rank's list from the student's function; run here when the case says so."""
    lists, error = student_lists("zb_h1_actions", fn, case["pp"], case["m"])
    out = {"actions": lists, "error": error, "ran": False, "loss": None, "grads": {}}
    if not error and "x" in case:
        out.update(run_zb_lists(lists, case))
    return out


# ------------------------------------------------------------------ in the grader

def expect_zb_h1(inputs: list) -> list:
    """One process's loss and gradients for a run case (the list rules need no answer)."""
    case = inputs[0]
    return [single_process(case) if "x" in case else {}] * len(inputs)


def _order(schedule, rank: int) -> str:
    return " ".join(f"{a.op}{a.mb}" for a in schedule.actions(rank) if not a.is_comm)


def list_rules(pp: int, m: int, lists: list) -> str:
    """"" when plain lists (one per rank) meet every rule a list alone shows: no B, a valid
    zero-bubble schedule, at most pp micro-batches held, ZB-H1's idle share; else why not."""
    for rank, items in enumerate(lists):
        whole = next((mb for op, mb, _, _ in items if op == "B"), None)
        if whole is not None:
            return (f"rank {rank} runs B{whole}: split every backward into I (the input's "
                    f"gradient) and W (the weights')")
    try:
        schedule = zb_schedule_of(pp, m, lists).validate()
    except ScheduleError as err:
        return "invalid schedule: " + one_line(err, 180)
    for rank in range(pp):
        peak = schedule.peak_in_flight(rank)
        if peak > pp:
            return (f"rank {rank} holds the activations of {peak} micro-batches at once (from F "
                    f"to W); ZB-H1 holds at most pp = {pp} (yours computes "
                    f"{one_line(_order(schedule, rank), 90)})")
    bubble, want = schedule.bubble_fraction(*TIMES), zero_bubble_formula("zb-h1", pp, m, *TIMES)
    # the simulated fraction and the formula, the same number in float64's last bits
    if bubble > want and not forward(torch.float64).allows(bubble - want, want):
        return (f"idle share {bubble:.3f} in the simulated timeline with F = I = W, more than "
                f"ZB-H1's {want:.3f}: a W sits where a rank could run an I or an F that a "
                f"neighbour waits for, or a message is posted later than needed")
    return ""


def judge_zb_h1(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    case, want = inputs[0], expected[0]
    first = outputs[0]
    if first["error"]:
        return one_line(first["error"])
    # A run case: each rank's list is the one it ran; a list case: all are rank 0's.
    lists = [o["actions"][r] if len(o["actions"]) > r else [] for r, o in enumerate(outputs)] \
        if "x" in case else first["actions"]
    if why := list_rules(case["pp"], case["m"], lists):
        return why
    return judge_run(outputs, want, case["m"]) if "x" in case else ""


def make_zb_h1_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    """pp in {2, 3, 4}, every m from pp to 2 pp + 1. On 2 ranks: pipelines of 2 run, the
    lists of pipelines of 3 and 4 judged; on 4 ranks: two pipelines of 4 run; on one
    (the visible check, in its own process): every list judged, none run."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    if world_size == 1:  # the lists alone, no process (the visible check's first pass)
        return [Case(f"pp={pp} m={m}", [{"pp": pp, "m": m}])
                for pp in (2, 3, 4) for m in range(pp, 2 * pp + 2)]
    if world_size == 4:  # one m from the first half of the range, one from the second
        cases = []
        for m in (draw(4, 6), draw(7, 9)):
            n_layer = 4 + draw(0, 1)  # every stage a block; sometimes one stage two
            cases.append(Case(f"pp=4 m={m} ({n_layer} layers, run)",
                              [batch_case(generator, 4, m, n_layer)] * 4))
        return cases
    cases = []
    for m in range(2, 6):
        n_layer = 2 + draw(0, 1)
        cases.append(Case(f"pp=2 m={m} ({n_layer} layers, run)",
                          [batch_case(generator, 2, m, n_layer)] * 2))
    for pp in (3, 4):
        for m in range(pp, 2 * pp + 2):
            cases.append(Case(f"pp={pp} m={m}", [{"pp": pp, "m": m}] * world_size))
    return cases


def course_zb_h1(case: dict) -> list:
    """The course's lists for the case, as plain data."""
    return [plain_actions(course_zb_h1_actions(case["pp"], case["m"], r))[0]
            for r in range(case["pp"])]


ZB_H1_ACTIONS = ExerciseSpec(
    id="zb_h1_actions", title="1F1B turned into ZB-H1: the backward split, the W's placed",
    difficulty="★★☆ medium", world_sizes=(2, 4), make_cases=make_zb_h1_cases,
    call=call_zb_h1, expect=expect_zb_h1, judge=judge_zb_h1, reference=course_zb_h1,
    banned=("reference.course.homework.pipeline_zero_bubble.course_zb_h1_actions",
            "reference.pipeline_parallel.zero_bubble.build_zb_h1",
            "reference.pipeline_parallel.zero_bubble._zb_h1_order",
            "reference.pipeline_parallel.zero_bubble._with_messages",
            "reference.pipeline_parallel.zero_bubble._message"))
