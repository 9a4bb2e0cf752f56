"""Visible self-checks of homework 01 (data parallelism): feedback while you work, never the grade.

    check_average_gradients(average_gradients)        # one PASS or FAIL line, with a hint
    check_bucketed_all_reduce(bucketed_all_reduce)
    check_accumulate_gradients(accumulate_gradients)  # on 3 ranks
    check_int8_all_reduce(int8_all_reduce)            # on 3 ranks
    check_ddp_bytes_per_step(ddp_bytes_per_step)      # the text's worked values, then the kind

Each check runs your function on 2 ranks (3 for accumulation and int8: uneven) with
`reference.runtime.launch`, on a small MLP and a different batch per rank, and compares
every rank's gradients with the full-batch gradient computed here in one process; the
bucketed one also counts your all-reduces (one per bucket, launched inside backward),
the accumulation one when they happen, the int8 one their dtype and size. The cases are those of the
hidden checks, with a fixed seed instead of the grader's private one. A wrong
answer, an exception or a hang is printed, never raised. While grading, `skip=True`
is passed and the check does nothing.

`run_model_check` is the runner; `reference.course.checks.zero` uses it too.
"""
from __future__ import annotations

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.data_parallel import (
    ACCUMULATE, AVERAGE_GRADIENTS, BUCKETED, DDP_BYTES, INT8,
)
from reference.course.homework.scoring import ExerciseSpec

__all__ = ["check_average_gradients", "check_bucketed_all_reduce", "check_accumulate_gradients",
           "check_int8_all_reduce", "check_ddp_bytes_per_step", "run_model_check"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than dist.all_reduce was called: reread 'How it is "
                    "graded' (the others are switched off)"),
    "timed out": ("some rank waited in an all-reduce no other rank made: reread exercise 2's "
                  "'Launch buckets in bucket order only'"),
    "sum over ranks": ("the gradients are the world size times too large: reread exercise 1 "
                       "(all_reduce gives the sum, the text asks for the mean)"),
    "not the full-batch gradient": ("after finish() a p.grad is not the mean over the ranks: "
                                    "reread exercise 2's 'finish()' bullet"),
    "got a gradient": ("a frozen parameter ended with a gradient: reread exercise 1 and "
                       "exercise 2's 'Buckets' (frozen parameters are left alone)"),
    "is None after": "a trainable p.grad is None afterwards: reread exercise 1's contract",
    "all-reduce sizes": ("the all-reduces do not match the buckets: reread exercise 2's "
                         "'Buckets' (reverse order, the cap in bytes, one all-reduce each)"),
    "not inside the step's last backward": ("the all-reduces came after backward, in finish(): "
                                            "reread exercise 2's 'Hooks' and the lecture's "
                                            "hooks"),
    "did not yet hold every micro-batch": ("a bucket went out in one of the first K - 1 backward "
                                           "passes: reread exercise 2's 'Hooks' (a hook fires in "
                                           "every backward)"),
    "only once every gradient": ("the first all-reduce waited for the whole backward: reread "
                                 "exercise 2's last paragraph (overlap)"),
    "returned": "the return value is not what the contract says: reread the exercise's contract",
}

_ACCUMULATE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than dist.all_reduce was called: reread exercise 3's "
                    "third bullet"),
    "timed out": ("some rank waited in an all-reduce another rank never made: reread exercise "
                  "3's third bullet (communicate only after the last backward, on every rank)"),
    "backward passes for": ("the number of backward passes is not one per micro-batch: reread "
                            "exercise 3's third bullet"),
    "before the last micro-batch": ("an all-reduce came before the last backward: reread "
                                    "exercise 3's third bullet"),
    "the gradients and two numbers": ("more was all-reduced than the gradients and two numbers: "
                                      "reread exercise 3's third bullet and its hint"),
    "returned loss": ("the loss differs from the mean over every sample of every rank: reread "
                      "exercise 3's second bullet"),
    "not the full-batch gradient": ("the gradient is not the large-batch one (ranks weighed "
                                    "alike?): reread exercise 3's opening paragraph and its hint"),
    "got a gradient": "a frozen parameter ended with a gradient: reread exercise 3's last bullet",
    "is None after": ("a trainable p.grad is None on some rank (one without micro-batches?): "
                      "reread exercise 3's last bullet"),
    "returned": "the return value is not what the contract says: reread exercise 3's last bullet",
}

_INT8_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than dist.all_reduce was called: reread exercise 4's "
                    "steps 2 and 3"),
    "quantized values as int8": ("the all-reduces did not carry the values as a torch.int8 "
                                 "tensor and one more number: reread exercise 4's steps 2 and 3"),
    "changed grad or residual": ("grad or residual changed in place: reread exercise 4's step 4 "
                                 "(new tensors)"),
    "wrong mean": ("the mean is off: reread exercise 4's steps 2-4 (one scale for every rank, "
                   "L = 127 // p)"),
    "wrong residual": ("the residual is off: reread exercise 4's step 4 (what this rank wanted "
                       "to send minus what it sent)"),
    "not (mean, residual)": "the return value is not a pair of tensors: reread exercise 4's step 4",
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
                    "inside the step's last backward, with 1 to 3 micro-batches", _HINTS,
                    world_sizes, timeout, skip)


def check_accumulate_gradients(fn, world_sizes=(3,), timeout: float = 60.0,
                               skip: bool = False) -> None:
    """Visible check of exercise accumulate_gradients (ranks with different sample counts)."""
    run_model_check(ACCUMULATE, fn, "the large-batch gradient and loss, one backward per "
                    "micro-batch, communication after the last", _ACCUMULATE_HINTS, world_sizes,
                    timeout, skip)


def check_int8_all_reduce(fn, world_sizes=(3,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise int8_all_reduce (three steps, the residual carried)."""
    run_model_check(INT8, fn, "the mean and the residual of 3 steps, sent as int8", _INT8_HINTS,
                    world_sizes, timeout, skip)


def check_ddp_bytes_per_step(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question ddp_bytes_per_step: the text's worked values
    (1,000 2-byte parameters on 3 ranks, 4 micro-batches: 2,672 and 10,688 bytes), then an int."""
    small = {"n_params": 1_000, "world_size": 3, "bytes_per_element": 2, "accumulation_steps": 4}
    return check_question(DDP_BYTES, fn, {"n_params": 124_439_808, "world_size": 8, "bytes_per_element": 4,
                                   "accumulation_steps": 4, "no_sync": True}, "int", skip,
                   worked=(Worked({**small, "no_sync": True}, 2_672),
                           Worked({**small, "no_sync": False}, 10_688)))
