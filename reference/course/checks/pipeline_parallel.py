"""Visible self-checks of homework 04 (pipeline schedules): feedback while you work, never the grade.

    check_gpipe_actions(gpipe_actions)                # prints one PASS or FAIL line, with a hint
    check_one_f_one_b_actions(one_f_one_b_actions)
    check_interleaved_actions(interleaved_actions)    # pipelines of 2 to 5, then run on 2 ranks
    check_zb_h1_actions(zb_h1_actions)                # the text's worked example, then as above
    check_balance_stages(balance_stages)
    check_interleaved_peak_bytes(interleaved_peak_bytes)   # the text's worked values, then the kind

Both call your function for every rank of several pipelines (m = 1, m < pp,
m = pp, m > pp), build a `Schedule` from the lists and check it with the
course's checker (complete, messages matched, no deadlock), then check its
order (GPipe: all forwards first; 1F1B: at most pp - rank micro-batches in
flight on rank `rank`) and its simulated bubble against (p - 1) / (m + p - 1).
The 1F1B check also runs your lists with the course's executor on 2 and 3
ranks (`reference.runtime.launch`) and compares the loss and the gradients with
one process. The course's `build_schedule` is switched off while your function
runs. A wrong answer, an exception or a hang is reported, never raised.

The interleaved check does the same with ``virtual = v`` chunks per rank, asks for at most
Megatron's number of (micro-batch, chunk) activations in flight and the interleaved
bubble, and runs your lists on 2 ranks. The ZB-H1 check first asserts the text's worked
example (pp = 3, m = 4: an idle share of 2/14 with F = I = W, rank 0 holding 3
micro-batches at its peak), then judges the lists of pipelines of 2 to 4 ranks (no B, valid,
at most pp micro-batches held, ZB-H1's idle share) and runs those of 2 ranks. The balance
check compares the slowest stage of your cut with the best cut that fits in memory.

The grade comes from the hidden checks (`reference.course.homework.pipeline_parallel`
and its `pipeline_interleaved`, `pipeline_zero_bubble`, `pipeline_balance`) on other inputs, not from these: while grading, `skip=True` is passed and the
check does nothing.
"""
from __future__ import annotations

import os
import traceback

import torch

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import VISIBLE_SEED, run_cases, run_visible
from reference.course.homework.pipeline_balance import BALANCE_STAGES
from reference.course.homework.pipeline_interleaved import (
    INTERLEAVED_ACTIONS, INTERLEAVED_PEAK_BYTES,
)
from reference.course.homework.pipeline_parallel import GPIPE, ONE_F_ONE_B
from reference.course.homework.pipeline_zero_bubble import TIMES, ZB_H1_ACTIONS, zb_schedule_of
from reference.course.homework.refuse import refusal_for
from reference.course.homework.scoring import ExerciseSpec, one_line

__all__ = ["check_gpipe_actions", "check_one_f_one_b_actions", "check_interleaved_actions",
           "check_zb_h1_actions", "check_balance_stages", "check_interleaved_peak_bytes",
           "run_check", "ZB_WORKED"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))

_MESSAGES = ("a message is missing, extra or out of its place: reread exercise 1's four rules "
             "for add_messages (which ranks receive and send around F and around B)")
_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` lines with your code",
    "not allowed": ("build_schedule was called inside your function: reread the exercise's "
                    "last line (it is for comparing, outside)"),
    "not an Action": "an item is not an Action: reread exercise 1 (Action(op, mb, peer=...))",
    "not a list of actions": "the return value is not a list of actions: reread exercise 1",
    "never runs": _MESSAGES,
    "which it needs": _MESSAGES,
    "repeats": "an action appears twice in a rank's list: reread exercise 1's order",
    "lives on rank": ("a message names the wrong peer: reread exercise 1's rules (activations "
                      "travel to rank + 1, gradients to rank - 1)"),
    "talk to": "the first or last rank sends or receives too much: reread exercise 1's exceptions",
    "takes no peer": "a computation names a peer: reread exercise 1 (F and B are local)",
    "arrive in the order": ("two neighbours list the messages between them in different orders: "
                            "reread exercise 1's 'just before / just after'"),
    "matching": _MESSAGES,
    "deadlock": ("two ranks each wait for the other's message: reread exercise 1's 'Why just "
                 "before and just after'"),
    "GPipe runs": "the computations are not GPipe's order: reread exercise 1's first paragraph",
    "holds the activations": ("a rank holds more micro-batches than 1F1B's pp - rank: reread "
                              "exercise 2's warm-up, steady state and cool-down"),
    "bubble": ("the simulated timeline idles more than the schedule's bubble: reread exercise "
               "1's 'Why just before and just after' and exercise 2's warm-up count"),
    "timed out": ("the ranks ran lists that do not match: is your function the same on every "
                  "rank? Reread exercise 2's last paragraph"),
}


# Looked up before the 1F1B hints (the first key found in a reason picks the hint).
_INTERLEAVED_HINTS = {
    "(micro-batch, chunk) pairs": ("a rank holds more (micro-batch, chunk) pairs than this order "
                                   "needs: reread exercise 3's warm-up count, w = min((v - 1) g "
                                   "+ 2 (pp - 1 - rank), v m)"),
    "interleaved 1F1B's": ("the simulated bubble is larger than interleaved 1F1B's: reread "
                           "exercise 3's warm-up count and its groups and steps"),
    "which it needs": ("an action comes before what it needs (a backward before its forward?): "
                       "reread exercise 3's order and its warm-up count"),
    "deadlock": ("two neighbours each wait in a send for the other: reread exercise 3's "
                 "paragraph on groups and steps"),
    "lives on rank": ("a message names the wrong peer or chunk: reread exercise 3's layout "
                      "(chunk c of rank r is stage c * pp + r)"),
    "talk to": ("the first or last stage sends or receives too much: reread exercise 3's last "
                "rule on stage 0 and stage pp * v - 1"),
}
# Looked up before the 1F1B hints (the first key found in a reason picks the hint).
_ZB_HINTS = {
    "runs B": "a whole backward is left: reread exercise 4's first rule (I, then W, never B)",
    "never runs": ("an action is missing: every micro-batch needs its F, I and W on every rank, "
                   "and I carries the messages B carried (exercise 4's first rule)"),
    "which it needs": ("an action comes before what it needs (a W before its I?): reread "
                       "exercise 4's first rule"),
    "from F to W": ("a rank keeps too many W's waiting: a micro-batch is held from its F to its "
                    "W, and at most pp at once; reread exercise 4's memory rule and which ranks "
                    "idle at the end of 1F1B"),
    "idle share": ("a rank idles where a W could run, or runs a W where a neighbour waits for an "
                   "I: reread exercise 4's paragraph on which ranks idle, and when"),
    "the text says": ("your lists for the text's example differ from its numbers: draw them "
                      "(exercise 4's last paragraph) and compare each rank's row with 1F1B's"),
}
_BALANCE_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` lines with your code",
    "not a list of stage sizes": ("the return value is not a list of pp stage sizes or None: "
                                  "reread exercise 5's last bullet"),
    "non-empty stages": "the stages are not pp contiguous, non-empty ones: reread exercise 5's second bullet",
    "micro-batches of activations": ("under 1F1B stage r keeps min(pp - r, m) micro-batches in "
                                     "flight, and a stage's memory went over the budget: reread "
                                     "exercise 5's second bullet"),
    "returned None": "None came back although some cut fits: reread exercise 5's last bullet",
    "slowest": ("a cut that fits has a faster slowest stage: reread exercise 5's last bullet "
                "and the note on trying every cut"),
}


def _cases(spec: ExerciseSpec, world_size: int):
    return spec.make_cases(torch.Generator().manual_seed(VISIBLE_SEED), world_size)


def _raised(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return "not implemented yet"
    text = one_line(f"{type(exc).__name__}: {exc}")
    if type(exc).__name__ == "NotAllowedError":
        return text
    # Only the frames of your code: the check's own are no help.
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_PACKAGE)]
    lines = "".join(traceback.format_list(frames[-3:])).rstrip().splitlines()
    return f"your function raised {text}" + "".join("\n     | " + line for line in lines)


def _in_process(spec: ExerciseSpec, fn) -> str:
    """"" when every case passes, else the first failure (the function is pure: no ranks)."""
    for case in _cases(spec, 1):
        try:
            out = refusal_for(spec).run(spec.call, fn, case.inputs[0])
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            return _raised(exc)
        if reason := spec.judge(case.inputs, spec.expect(case.inputs), [out], 1):
            return f"{case.name}: {reason}"
    return ""


def run_check(spec: ExerciseSpec, fn, world_sizes=None, timeout: float = 60.0,
              skip: bool = False, success: str = "", hints=None,
              in_process: bool = False) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped).

    `world_sizes` None: the cases run in this process (the function needs no ranks);
    `in_process`: the one-rank cases run here first, then the launches."""
    def attempt() -> str:
        if world_sizes is None or in_process:
            if (reason := _in_process(spec, fn)) or world_sizes is None:
                return reason
        for world_size in world_sizes:
            reason, _ = run_cases(spec, fn, world_size, _cases(spec, world_size), timeout)
            if reason:
                return reason
        return ""

    return run_visible(spec, fn, attempt, success, _HINTS if hints is None else hints, skip)


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_gpipe_actions(fn, skip: bool = False) -> None:
    """Visible check of exercise gpipe_actions (no processes: the lists are checked here)."""
    names = ", ".join(c.name for c in _cases(GPIPE, 1))
    run_check(GPIPE, fn, None, skip=skip,
              success=f"valid, GPipe's order and bubble for {names}")


def check_one_f_one_b_actions(fn, world_sizes=(2, 3), timeout: float = 60.0,
                              skip: bool = False) -> None:
    """Visible check of exercise one_f_one_b_actions (runs the lists on `world_sizes` ranks)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_check(ONE_F_ONE_B, fn, world_sizes, timeout=timeout, skip=skip,
              success=(f"valid, at most pp - rank micro-batches in flight, 1F1B's bubble, and run "
                       f"on {sizes} ranks it gives one process's loss and gradients"))


def check_interleaved_actions(fn, world_sizes=(2,), timeout: float = 60.0,
                              skip: bool = False) -> None:
    """Visible check of exercise interleaved_actions (pipelines of 2 to 5 here, then run
    by the executor on `world_sizes` ranks)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_check(INTERLEAVED_ACTIONS, fn, world_sizes, timeout=timeout, skip=skip,
              hints={**_INTERLEAVED_HINTS, **_HINTS}, in_process=True,
              success=(f"valid, Megatron's activations in flight, the interleaved bubble, and "
                       f"run on {sizes} ranks it gives one process's loss and gradients"))


# The text's worked example: (pp, m) -> idle share with F = I = W, rank 0's peak.
ZB_WORKED = {"pp": 3, "m": 4, "bubble": 2 / 14, "rank0_peak": 3}


def _zb_worked_example(fn) -> tuple[str, str | None]:
    """("", "") when the lists of the text's example (pp = 3, m = 4) give its two numbers,
    else (why, the part of it that picks the hint)."""
    pp, m = ZB_WORKED["pp"], ZB_WORKED["m"]
    try:
        out = refusal_for(ZB_H1_ACTIONS).run(ZB_H1_ACTIONS.call, fn, {"pp": pp, "m": m})
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return _raised(exc), None
    where = f"the text's worked example (pp={pp}, m={m})"
    case = [{"pp": pp, "m": m}]
    if reason := ZB_H1_ACTIONS.judge(case, ZB_H1_ACTIONS.expect(case), [out], 1):
        return f"{where}: {reason}", reason
    schedule = zb_schedule_of(pp, m, out["actions"])
    bubble, peak = schedule.bubble_fraction(*TIMES), schedule.peak_in_flight(0)
    if abs(bubble - ZB_WORKED["bubble"]) > 1e-9 or peak != ZB_WORKED["rank0_peak"]:
        reason = (f"idle share {bubble:.4f} and rank 0 holds {peak} at its peak; the text says "
                  f"{ZB_WORKED['bubble']:.4f} (2/14) and {ZB_WORKED['rank0_peak']}")
        return f"{where}: {reason}", reason
    return "", ""


def check_zb_h1_actions(fn, world_sizes=(2,), timeout: float = 60.0,
                        skip: bool = False) -> None:
    """Visible check of exercise zb_h1_actions: the text's worked example, the lists of
    pipelines of 2 to 4 ranks here, then those of 2 ranks run by the executor."""
    spec = ZB_H1_ACTIONS

    def attempt():
        reason, key = _zb_worked_example(fn)
        if reason:
            return reason, key
        if reason := _in_process(spec, fn):
            return reason
        for world_size in world_sizes:
            reason, key = run_cases(spec, fn, world_size, _cases(spec, world_size), timeout)
            if reason:
                return reason, key
        return ""

    sizes = " and ".join(str(w) for w in world_sizes)
    ran = f", and run on {sizes} ranks it gives one process's loss and gradients" if sizes else ""
    hints = {**_ZB_HINTS, **{k: h for k, h in _HINTS.items() if k not in _ZB_HINTS}}  # ours first
    run_visible(spec, fn, attempt, hints=hints, skip=skip,
                success=(f"the worked example's 2/14, no B, valid, at most pp micro-batches held "
                         f"and ZB-H1's idle share on pipelines of 2 to 4 ranks{ran}"))


def check_balance_stages(fn, skip: bool = False) -> None:
    """Visible check of exercise balance_stages (against the best cut that fits)."""
    run_check(BALANCE_STAGES, fn, None, skip=skip, hints=_BALANCE_HINTS,
              success="every cut fits and its slowest stage is the fastest possible")


def check_interleaved_peak_bytes(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question interleaved_peak_bytes: the text's two worked
    values (12 and 18 bytes), then an int."""
    return check_question(INTERLEAVED_PEAK_BYTES, fn, {"pp": 8, "m": 48, "v": 2, "rank": 0,
                                                "stage_bytes": 3 * 2**30}, "int", skip,
                   worked=(Worked({"pp": 2, "m": 2, "v": 2, "rank": 1, "stage_bytes": 8}, 12),
                           Worked({"pp": 3, "m": 2, "v": 3, "rank": 0, "stage_bytes": 9}, 18)))
