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
    "not a dict": "return {'compute': ..., 'communication': ..., 'hidden': ..., 'idle': ...} in seconds",
    "no number under": "every one of the four keys holds a number of seconds",
    "compute:": ("merge the compute intervals before adding their lengths (an operator inside "
                 "another counts once), and cut them to the step"),
    "communication:": ("merge every kind's intervals together, cut them to the step, and count "
                       "only the parts where nothing computes"),
    "hidden:": "hidden is the length of the communication intervals that lie under compute",
    "idle:": "idle is the step's length minus compute minus (exposed) communication",
    "not (problem, fix)": "return a pair: ('straggler', 3), ('healthy', None), ...",
    "planted problem is 'straggler'": ("one rank computing far longer makes every other rank wait "
                                       "inside its collectives: compare the ranks' compute first"),
    "planted problem is 'bubble'": ("with pp > 1, compute the 1F1B bubble (p - 1) / (m + p - 1) "
                                    "before the communication share: the stages wait in recv"),
    "planted problem is 'latency'": ("communication share over 30 % with small all-reduces: compare "
                                     "the bytes per call with the size where a ring's latency and bandwidth terms are equal"),
    "planted problem is 'bandwidth'": ("communication share over 30 % with large all-reduces: the "
                                       "bytes per call are above the size where a ring's two terms are equal"),
    "planted problem is 'healthy'": "the share is the mean over ranks of communication / step",
    "straggler: fix": "the fix of a straggler is its rank: the one that computes longest",
    "bubble: fix": "the smallest m with (p - 1) / (m + p - 1) <= target_bubble",
    "latency: fix": ("a ring all-reduce of S bytes costs 2(N-1) alpha + 2(N-1)/N S beta, beta in "
                     "seconds per byte as in notebook 00 (not a bandwidth): find S where the two "
                     "terms are equal"),
    "not allowed": "only dist.all_reduce is allowed: P first, then Q",
    "all-reduced": "all-reduce P (n x r) and Q (m x r), never the whole gradient",
    "wrong approx": "approx = P^ new_q^T, with P^ from the all-reduced P and new_q the mean Q",
    "wrong new_q": "new_q = (sum over ranks of M^T P^) / N, where M = grad + error",
    "wrong new_error": "new_error = M - approx with this rank's own M = grad + error",
    "must be tensors": "return three tensors: (approx, new_q, new_error)",
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
