"""Visible self-check of homework 02 (ZeRO): feedback while you work, never the grade.

    check_zero1_optimizer(zero1_optimizer)   # one PASS or FAIL line, with a hint

Runs your function on 2 ranks with `reference.runtime.launch`: a small MLP trained
for 3 steps (AdamW, AdamW with weight decay, SGD with momentum, and a model of one
number), each rank on its own batch, compared with one process training on the whole
batch, and checks that the inner optimizer holds only this rank's shard. The cases
are those of the hidden checks with a fixed seed. While grading, `skip=True` is
passed and the check does nothing.
"""
from __future__ import annotations

from reference.course.checks.data_parallel import run_model_check
from reference.course.homework.zero import ZERO1

__all__ = ["check_zero1_optimizer"]

_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` line with your code",
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


def check_zero1_optimizer(fn, world_sizes=(2,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise zero1_optimizer."""
    run_model_check(ZERO1, fn, "parameters after 3 steps equal one process on the whole batch, "
                    "state for the shard only", _HINTS, world_sizes, timeout, skip)
