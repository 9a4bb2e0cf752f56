"""Visible self-checks of homework 04 (pipeline schedules): feedback while you work, never the grade.

    check_gpipe_actions(gpipe_actions)                # prints one PASS or FAIL line, with a hint
    check_one_f_one_b_actions(one_f_one_b_actions)
    check_interleaved_actions(interleaved_actions)    # pipelines of 2 to 5, then run on 2 ranks
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
bubble, and runs your lists on 2 ranks. The balance check compares the slowest stage
of your cut with the best cut that fits in memory.

The grade comes from the hidden checks (`reference.course.homework.pipeline_parallel`
and its `pipeline_interleaved`, `pipeline_balance`) on other inputs, not from these: while grading, `skip=True` is passed and the
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
from reference.course.homework.refuse import refusal_for
from reference.course.homework.scoring import ExerciseSpec, one_line

__all__ = ["check_gpipe_actions", "check_one_f_one_b_actions", "check_interleaved_actions",
           "check_balance_stages", "check_interleaved_peak_bytes", "run_check"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))

_MESSAGES = ("every F needs RECV_F before it (not on rank 0) and SEND_F after it (not on the "
             "last rank); every B needs RECV_B before it (not on the last rank) and SEND_B "
             "after it (not on rank 0)")
_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` lines with your code",
    "not allowed": "build the list from Action(...) yourself; build_schedule is for comparing",
    "not an Action": "return a list of Action(op, mb, peer=...) or tuples (op, mb, chunk, peer)",
    "not a list of actions": "return a list of Action(op, mb, peer=...) or tuples (op, mb, chunk, peer)",
    "never runs": _MESSAGES,
    "which it needs": _MESSAGES,
    "repeats": "each action appears exactly once in a rank's list",
    "lives on rank": "activations go to rank + 1 (SEND_F, RECV_B), gradients to rank - 1",
    "talk to": "rank 0 receives no activation and the last rank sends none (nor a gradient back)",
    "takes no peer": "F and B are computed locally: Action('F', mb) has no peer",
    "arrive in the order": "two neighbours must list the messages between them in the same "
                           "micro-batch order",
    "matching": _MESSAGES,
    "deadlock": ("receive just before the F or B that needs the message, send just after the "
                 "one that produced it, so no rank waits for a message its neighbour has not "
                 "posted yet"),
    "GPipe runs": "first the m forwards F0, F1, ..., then the m backwards",
    "holds the activations": ("warm up with min(pp - rank - 1, m) forwards, then alternate one "
                              "forward and one backward, then run the remaining backwards"),
    "bubble": ("post each receive right before the F or B that needs it and each send right "
               "after the one that produced it; 1F1B warms up with min(pp - rank - 1, m) "
               "forwards, no fewer"),
    "timed out": "the ranks ran lists that do not match: is your function the same on every rank?",
}


# Looked up before the 1F1B hints (the first key found in a reason picks the hint).
_INTERLEAVED_HINTS = {
    "(micro-batch, chunk) pairs": ("warm up with min((v - 1) g + 2 (pp - 1 - rank), v m) "
                                   "forwards (g = min(pp, m)), then pair each forward with a "
                                   "backward"),
    "interleaved 1F1B's": ("warm up with exactly (v - 1) g + 2 (pp - 1 - rank) forwards (at most "
                           "v m), and post every message in the step right after the group "
                           "that produced it"),
    "which it needs": ("each action needs what comes before it: RECV_F before F, F before "
                       "SEND_F and B, RECV_B before B, B before SEND_B; and a backward needs its "
                       "forward: warm up with (v - 1) g + 2 (pp - 1 - rank) forwards"),
    "deadlock": ("in the steady state run a forward and a backward back to back, then one step "
                 "with both sends and the next pair's receives: neighbours exchange activations "
                 "and gradients of different chunks in both directions at once"),
    "lives on rank": ("chunk c of rank r is stage c * pp + r: the next stage lives on rank "
                      "(r + 1) % pp, the previous one on (r - 1) % pp"),
    "talk to": ("only stage 0 (rank 0, chunk 0) receives no activation and only the last stage "
                "(rank pp - 1, chunk v - 1) sends none"),
}
_BALANCE_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` lines with your code",
    "not a list of stage sizes": "return a list of pp ints (units per stage), or None",
    "non-empty stages": "pp positive ints that add up to len(times), in pipeline order",
    "micro-batches of activations": ("under 1F1B stage r keeps min(pp - r, m) micro-batches in "
                                     "flight: its weights plus that many times its activations "
                                     "must fit"),
    "returned None": "some cut fits: try every cut (or every stage size) before giving up",
    "slowest": ("among the cuts that fit, keep the one whose slowest stage is fastest: try "
                "them all, or build it stage by stage (best time for the first i units in j "
                "stages)"),
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
