"""Visible self-checks of homework 07 (performance): feedback while you work, never the grade.

    check_step_breakdown(step_breakdown)           # one PASS or FAIL line, with a hint
    check_diagnose(diagnose)
    check_powersgd_all_reduce(powersgd_all_reduce) # on 2 ranks
    check_mfu(mfu)                                 # the text's worked values, then the kind

The pure functions (step_breakdown, diagnose) run on one rank, powersgd_all_reduce on 2
ranks, each on the same kinds of cases as the hidden checks drawn from a public seed:
hand-made traces, profiles with one planted problem each, random matrices compared with
the float64 truth and the numbers counted on the wire.
"""
from __future__ import annotations

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.performance import DIAGNOSE, MFU, STEP_BREAKDOWN
from reference.course.homework.performance_powersgd import POWERSGD

__all__ = ["check_step_breakdown", "check_diagnose", "check_powersgd_all_reduce", "check_mfu"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not a dict": "the return value is not the dict of four numbers: reread exercise 1's contract",
    "no number under": "a key holds no number of seconds: reread exercise 1's contract",
    "compute:": ("compute is off (operators inside others counted twice, or past the step's "
                 "ends?): merge the compute intervals as exercise 1's worked example does"),
    "communication:": ("exposed communication is off: reread exercise 1's definitions (every "
                       "kind together, cut to the step, outside compute)"),
    "hidden:": "hidden is off: reread exercise 1's definition (communication under compute)",
    "idle:": "idle is off: reread exercise 1's definition (what the step's other parts leave)",
    "not (problem, fix)": "the return value is not a (problem, fix) pair: reread exercise 2's table",
    "planted problem is 'straggler'": ("a straggler was taken for something else: its waiting "
                                       "looks like communication; compare the ranks' compute "
                                       "first (reread exercise 2's table)"),
    "planted problem is 'bubble'": ("a bubble was taken for something else: its stages wait in recv, "
                                    "which looks like communication; reread exercise 2's table"),
    "planted problem is 'latency'": ("a latency problem was taken for something else: reread "
                                     "exercise 2's latency row and notebook 00's alpha-beta model"),
    "planted problem is 'bandwidth'": ("a bandwidth problem was taken for something else: reread "
                                       "exercise 2's bandwidth row"),
    "planted problem is 'healthy'": ("a healthy step was taken for a problem: reread exercise "
                                     "2's table (the communication share is a mean over ranks)"),
    "straggler: fix": "the straggler's rank is wrong: reread exercise 2's straggler row",
    "bubble: fix": "the micro-batch count is wrong: reread exercise 2's bubble row",
    "latency: fix": ("the crossover size is wrong: reread exercise 2's latency row (beta in "
                     "seconds per byte, as in notebook 00)"),
    "not allowed": "a collective other than dist.all_reduce was called: reread exercise 3's steps",
    "all-reduced": ("more was all-reduced than P and Q, never the whole gradient: reread "
                    "exercise 3's steps"),
    "wrong approx": "approx differs: reread exercise 3's steps (which P, which Q)",
    "wrong new_q": "new_q differs: reread exercise 3's steps (the mean over ranks)",
    "wrong new_error": "new_error differs: reread exercise 3's steps (what the approximation missed)",
    "must be tensors": "the return value is not three tensors: reread exercise 3's contract",
}


def _check(spec, fn, world_sizes, success: str, skip: bool) -> None:
    def attempt():
        for ws in world_sizes:
            reason = run_cases(spec, fn, ws, public_cases(spec, ws), timeout=60.0)
            if reason[0]:
                return reason
        return ""
    run_visible(spec, fn, attempt, success, _HINTS, skip)


def check_step_breakdown(fn, skip: bool = False) -> None:
    """Visible check of exercise step_breakdown (against the trace's own intervals)."""
    _check(STEP_BREAKDOWN, fn, (1,), "every trace splits into the right compute, communication, "
                                     "hidden and idle time", skip)


def check_diagnose(fn, skip: bool = False) -> None:
    """Visible check of exercise diagnose (one planted problem per profile)."""
    _check(DIAGNOSE, fn, (1,), "every planted problem found, with its fix", skip)


def check_powersgd_all_reduce(fn, skip: bool = False) -> None:
    """Visible check of exercise powersgd_all_reduce on 2 ranks."""
    _check(POWERSGD, fn, (2,), "the rank-r mean, Q and the error feedback are right, and only P and "
                               "Q went on the wire", skip)


def check_mfu(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question mfu: the text's worked value (0.4674 to four
    digits), then a finite number."""
    return check_question(MFU, fn, {"n_params": 1_315_723_264, "n_layer": 24, "seq_len": 2048, "n_embd": 2048,
                             "tokens_per_step": 1_048_576, "step_seconds": 1.5, "n_gpus": 64,
                             "peak_flops": 312e12}, "real", skip,
                   worked=(Worked({"n_params": 100_000_000, "n_layer": 12, "seq_len": 1_024,
                                   "n_embd": 768, "tokens_per_step": 524_288, "step_seconds": 1.0,
                                   "n_gpus": 8, "peak_flops": 100e12}, 0.4674, places=4),))
