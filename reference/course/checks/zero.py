"""Visible self-checks of homework 02 (ZeRO): feedback while you work, never the grade.

    check_zero1_optimizer(zero1_optimizer)            # one PASS or FAIL line, with a hint
    check_clip_sharded_grad_norm_(clip_sharded_grad_norm_)
    check_fsdp_schedule(fsdp_schedule)
    check_zero_max_params(zero_max_params)            # the text's worked values, then the kind

zero1_optimizer runs on 2 ranks with `reference.runtime.launch`: a small MLP trained
for 3 steps (AdamW, AdamW with weight decay, SGD with momentum, and a model of one
number), each rank on its own batch, compared with one process training on the whole
batch, and checks that the inner optimizer holds only this rank's shard.
clip_sharded_grad_norm_ runs on 2 and 3 ranks, on shards whose padding holds garbage,
against the norm of the real numbers; fsdp_schedule runs on one rank and replays your
actions in the simulator the grader uses. The cases are those of the hidden checks with
a fixed seed. While grading, `skip=True` is passed and the check does nothing.
"""
from __future__ import annotations

from reference.course.checks.data_parallel import run_model_check
from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.zero import ZERO1
from reference.course.homework.zero_extra import CLIP, FSDP_SCHEDULE, ZERO_MAX_PARAMS

__all__ = ["check_zero1_optimizer", "check_clip_sharded_grad_norm_", "check_fsdp_schedule",
           "check_zero_max_params"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "use reduce-scatter (or all-reduce) and all-gather only",
    "timed out": "every rank must call the same collectives, with tensors of the same size",
    "returned": "return (step, inner): a function of no argument and the inner optimizer",
    "inner optimizer is": "build the inner optimizer with optimizer_class(..., **optimizer_kwargs)",
    "holds tensors": ("give the inner optimizer one 1-D leaf tensor of S numbers, this rank's "
                      "slice [rank*S, (rank+1)*S) of the padded flat parameters"),
    "state tensors": "the inner optimizer must see only the shard, never the full parameters",
    "differs from one process": ("average the gradients (divide the sum by N), give the shard's "
                                 "slice to shard.grad, step, then all-gather into every parameter"),
}

_CLIP_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "only dist.all_reduce is allowed: one call, of one number",
    "timed out": "every rank must call all_reduce, even a rank whose shard is all padding",
    "padding was counted": ("flat position rank * S + i is real only when it is < numel: count "
                            "the first max(0, min(S, numel - rank * S)) numbers of your shard"),
    "one shard only": ("add the ranks' parts with one all-reduce: the sum of squares for the "
                       "2-norm (then the square root), the max (ReduceOp.MAX) for the inf-norm"),
    "not scaled": "multiply the real numbers in place by min(1, max_norm / (norm + 1e-6))",
    "shape or dtype": "scale grad_shard in place (grad_shard[:k].mul_(coef)), do not replace it",
    "numbers;": "one all-reduce of a single number (a 0-dim tensor), whatever the norm type",
    "norm": ("2-norm: sqrt of the all-reduced sum of squares; inf-norm: the all-reduced MAX of "
             "|g|; sum in float32 or float64, never in bfloat16"),
}

_SCHEDULE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not a list": "return a list of (op, unit) pairs, op in gather/forward/backward/free/reduce_scatter",
    "not an action": "op is one of gather, forward, backward, free, reduce_scatter; unit in 0..n-1",
    "next computation": "forwards 0, 1, ..., n-1, then backwards n-1, ..., 0, each once",
    "prefetch": ("before each computation, the units of the next max_whole - 1 distinct "
                 "computations must already be whole: gather them ahead"),
    "units whole at once": "free a unit as soon as it is not among the next max_whole needed",
    "not whole": "gather a unit before it computes, and free only a unit that is whole",
    "already whole": "a unit that is whole is not gathered again: keep it until it is not needed",
    "reduce-scatter": "reduce-scatter a unit's gradient once, right after its backward",
    "gathers where": ("a unit needed again within the next max_whole computations stays whole: "
                      "the last forward units are still whole when backward starts"),
    "still whole": "free every unit at the end",
}


def check_zero1_optimizer(fn, world_sizes=(2,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise zero1_optimizer."""
    run_model_check(ZERO1, fn, "parameters after 3 steps equal one process on the whole batch, "
                    "state for the shard only", _HINTS, world_sizes, timeout, skip)


def _check(spec, fn, world_sizes, success: str, hints: dict, skip: bool) -> None:
    def attempt():
        for ws in world_sizes:
            reason = run_cases(spec, fn, ws, public_cases(spec, ws), timeout=60.0)
            if reason[0]:
                return reason
        return ""
    run_visible(spec, fn, attempt, success, hints, skip)


def check_clip_sharded_grad_norm_(fn, skip: bool = False) -> None:
    """Visible check of exercise clip_sharded_grad_norm_ on 2 and 3 ranks."""
    _check(CLIP, fn, (2, 3), "the norm of the real numbers on every rank, each shard clipped "
           "by the same factor, one all-reduce of one number", _CLIP_HINTS, skip)


def check_fsdp_schedule(fn, skip: bool = False) -> None:
    """Visible check of exercise fsdp_schedule (the grader's simulator, public cases)."""
    _check(FSDP_SCHEDULE, fn, (1,), "every schedule is valid, prefetches, stays under max_whole "
           "and gathers no more than needed", _SCHEDULE_HINTS, skip)


def check_zero_max_params(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question zero_max_params: the text's worked values (16 GB,
    4 ranks, Adam: ZeRO-1 2,285,714,284 and ZeRO-3 4,000,000,000 parameters), then an int."""
    return check_question(ZERO_MAX_PARAMS, fn, {"memory_bytes": 80_000_000_000, "n": 8, "stage": 2,
                                         "k": 12}, "int", skip,
                   worked=(Worked({"memory_bytes": 16_000_000_000, "n": 4, "stage": 1, "k": 12},
                                  2_285_714_284),
                           Worked({"memory_bytes": 16_000_000_000, "n": 4, "stage": 3, "k": 12},
                                  4_000_000_000)))
