"""Visible self-checks of homework 01 (data parallelism): feedback while you work, never the grade.

    check_average_gradients(average_gradients)        # one PASS or FAIL line, with a hint
    check_bucketed_all_reduce(bucketed_all_reduce)

Each check runs your function on 2 ranks with `reference.runtime.launch`, on a small
MLP and a different batch per rank, and compares every rank's gradients with the
full-batch gradient computed here in one process; the bucketed one also counts your
all-reduces (one per bucket, launched inside backward). The cases are those of the
hidden checks, with a fixed seed instead of the grader's private one. A wrong
answer, an exception or a hang is printed, never raised. While grading, `skip=True`
is passed and the check does nothing.

`run_model_check` is the runner; `reference.course.checks.zero` uses it too.
"""
from __future__ import annotations

from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.data_parallel import AVERAGE_GRADIENTS, BUCKETED
from reference.course.homework.scoring import ExerciseSpec

__all__ = ["check_average_gradients", "check_bucketed_all_reduce", "run_model_check"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "use dist.all_reduce only (the other collectives are switched off)",
    "timed out": ("every rank must issue the same all-reduces in the same order: launch "
                  "buckets strictly in bucket order"),
    "sum over ranks": "all_reduce sums; the full-batch gradient is the mean: divide by the world size",
    "not the full-batch gradient": ("after finish() every p.grad must hold the mean over ranks: "
                                    "copy the reduced flat bucket back into each p.grad"),
    "got a gradient": "frozen parameters (requires_grad False) get no bucket and keep grad None",
    "is None after": "write the averaged gradient into p.grad (p.grad.copy_(...))",
    "all-reduce sizes": ("walk the trainable parameters in reverse order; start a new bucket when "
                         "the next gradient would make the bucket exceed bucket_bytes; one "
                         "all-reduce of one flat tensor per bucket"),
    "not inside backward": "register_post_accumulate_grad_hook on each parameter, and launch there",
    "only once every gradient": "launch a bucket from the hook of its last gradient, not at the end",
    "returned": "check the return value against the contract in the exercise text",
}


def run_model_check(spec: ExerciseSpec, fn, what: str, hints: dict, world_sizes=(2,),
                    timeout: float = 60.0, skip: bool = False) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped)."""
    def attempt() -> str:
        for world_size in world_sizes:
            reason, _ = run_cases(spec, fn, world_size, public_cases(spec, world_size), timeout,
                               "ranks waiting in different collectives?")
            if reason:
                return reason
        return ""

    sizes = " and ".join(str(w) for w in world_sizes)
    return run_visible(spec, fn, attempt, f"{what} on {sizes} ranks", hints, skip)


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_average_gradients(fn, world_sizes=(2,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise average_gradients."""
    run_model_check(AVERAGE_GRADIENTS, fn, "every p.grad equals the full-batch gradient "
                    "(MLP, frozen layer)", _HINTS, world_sizes, timeout, skip)


def check_bucketed_all_reduce(fn, world_sizes=(2,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise bucketed_all_reduce."""
    run_model_check(BUCKETED, fn, "full-batch gradients, one all-reduce per bucket, launched "
                    "inside backward", _HINTS, world_sizes, timeout, skip)
