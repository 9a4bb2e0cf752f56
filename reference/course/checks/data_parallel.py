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
    "not inside the step's last backward": ("the all-reduces came after backward, in finish(): "
                                            "reread the lecture's hooks"),
    "did not yet hold every micro-batch": ("a bucket went out in one of the first K - 1 backward "
                                           "passes: its hooks fire in every backward; when is a "
                                           "gradient complete?"),
    "only once every gradient": "launch a bucket from the hook of its last gradient, not at the end",
    "returned": "check the return value against the contract in the exercise text",
}

_ACCUMULATE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "use dist.all_reduce only (the other collectives are switched off)",
    "timed out": ("every rank must make the same all-reduces, whatever its number of "
                  "micro-batches: communicate only after the loop"),
    "backward passes for": "run one forward and one backward per micro-batch; p.grad adds them up",
    "before the last micro-batch": "accumulate locally; all-reduce once, after the last backward",
    "the gradients and two numbers": ("pack the gradients, the loss sum and the sample count into "
                                      "one flat tensor: one all-reduce"),
    "returned loss": "the step's loss: the per-sample losses of every rank summed, over their count",
    "not the full-batch gradient": ("weigh each rank by its samples: all-reduce sums (of per-sample "
                                    "losses' gradients, and of samples), then divide"),
    "got a gradient": "frozen parameters (requires_grad False) keep grad None",
    "is None after": "a rank with no micro-batch still joins the all-reduce, with zeros",
    "returned": "check the return value against the contract in the exercise text",
}

_INT8_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "use dist.all_reduce only (op=dist.ReduceOp.MAX for the largest |v|)",
    "quantized values as int8": ("all-reduce q as a torch.int8 tensor, and besides it only the "
                                 "one-number max"),
    "changed grad or residual": "v = grad + residual makes a new tensor: leave the arguments as they are",
    "wrong mean": ("one scale on every rank (the max over ranks of |v|, over 127 // p); the mean is "
                   "sum(q) * scale / p"),
    "wrong residual": "the residual is what this rank wanted to send minus what it sent: v - q * scale",
    "not (mean, residual)": "return a tuple (mean, new_residual) of two tensors",
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
