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

`run_model_check` is the runner; `reference.checks_zero` uses it too.
"""
from __future__ import annotations

import cloudpickle
import torch
import torch.distributed as dist

from .checks import describe_launch_failure
from .homework.data_parallel import AVERAGE_GRADIENTS, BUCKETED
from .homework.guard import exercise_rules
from .homework.scoring import ExerciseSpec, one_line
from .runtime import RankError, launch

__all__ = ["check_average_gradients", "check_bucketed_all_reduce", "run_model_check"]

VISIBLE_SEED = 2024

_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` line with your code",
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


def _hint(reason: str, hints: dict) -> str:
    first = reason.splitlines()[0]  # the traceback below it could match any key
    return next((h for key, h in hints.items() if key in first), "")


def _rank_check(spec: ExerciseSpec, fn_bytes: bytes, cases: list) -> dict:
    """In each rank: its own inputs of every case, through the exercise's rules."""
    rank = dist.get_rank()
    outputs = {}
    with exercise_rules(spec.id, spec.forbidden):
        fn = cloudpickle.loads(fn_bytes)
        for case in cases:
            outputs[case.name] = spec.call(fn, case.inputs[rank])
    return outputs


def _failure(spec: ExerciseSpec, fn, world_sizes, timeout) -> str:
    """"" when every world size and case passes, else the first failure, on one line."""
    fn_bytes = cloudpickle.dumps(fn)
    for world_size in world_sizes:
        generator = torch.Generator().manual_seed(VISIBLE_SEED + world_size)
        cases = spec.make_cases(generator, world_size)
        try:
            # Not quiet: what your code prints shows, as "[rank r] ..." lines.
            ranks = launch(_rank_check, world_size, spec, fn_bytes, cases, timeout=timeout)
        except RankError as err:
            return describe_launch_failure(err, world_size, timeout,
                                           "ranks waiting in different collectives?")
        for case in cases:
            reason = spec.judge(case.inputs, spec.expect(case.inputs),
                                [r[case.name] for r in ranks], world_size)
            if reason:
                return f"on {world_size} ranks, {case.name}: {reason}"
    return ""


def run_model_check(spec: ExerciseSpec, fn, what: str, hints: dict, world_sizes=(2,),
                    timeout: float = 60.0, skip: bool = False) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped)."""
    if skip:
        print(f"skipped {spec.id}: the grader runs its own hidden checks")
        return None
    try:
        if not callable(fn):
            reason = f"expected a function, got {type(fn).__name__}"
        else:
            reason = _failure(spec, fn, tuple(world_sizes), timeout)
    except Exception as exc:  # noqa: BLE001 - a check must never stop the notebook
        reason = f"the check could not run your function: {one_line(f'{type(exc).__name__}: {exc}')}"
    if not reason:
        sizes = " and ".join(str(w) for w in world_sizes)
        print(f"PASS {spec.id}: {what} on {sizes} ranks")
        return True
    hint = _hint(reason, hints)
    print(f"FAIL {spec.id}: {reason}" + (f"\n     hint: {hint}" if hint else ""))
    return False


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_average_gradients(fn, world_sizes=(2,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise average_gradients."""
    run_model_check(AVERAGE_GRADIENTS, fn, "every p.grad equals the full-batch gradient "
                    "(MLP, frozen layer)", _HINTS, world_sizes, timeout, skip)


def check_bucketed_all_reduce(fn, world_sizes=(2,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise bucketed_all_reduce."""
    run_model_check(BUCKETED, fn, "full-batch gradients, one all-reduce per bucket, launched "
                    "inside backward", _HINTS, world_sizes, timeout, skip)
