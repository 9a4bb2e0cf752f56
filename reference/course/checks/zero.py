"""Visible self-checks of homework 02 (ZeRO): feedback while you work, never the grade.

    check_zero1_optimizer(zero1_optimizer)            # one PASS or FAIL line, with a hint
    check_clip_sharded_grad_norm_(clip_sharded_grad_norm_)
    check_fsdp_schedule(fsdp_schedule)
    check_zero_max_params(zero_max_params)            # the text's worked values, then the kind
    check_wrap_tiny_lm(wrap_tiny_lm)

zero1_optimizer runs on 2 ranks with `reference.runtime.launch`: a small MLP trained
for 3 steps (AdamW, AdamW with weight decay, SGD with momentum, and a model of one
number), each rank on its own batch, compared with one process training on the whole
batch, and checks that the inner optimizer holds only this rank's shard.
clip_sharded_grad_norm_ runs on 2 and 3 ranks, on shards whose padding holds garbage,
against the norm of the real numbers; fsdp_schedule runs on one rank and replays your
actions in the simulator the grader uses; wrap_tiny_lm trains your wrapped model on 2 ranks
for 3 steps in fp32, bf16 and fp16 against one process on the whole batch. The cases are those of the hidden checks with
a fixed seed. While grading, `skip=True` is passed and the check does nothing.
"""
from __future__ import annotations

from reference.course.checks.data_parallel import run_model_check
from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.zero import ZERO1
from reference.course.homework.zero_fully_shard import WRAP_TINY_LM
from reference.course.homework.zero_transfer import CLIP, FSDP_SCHEDULE, ZERO_MAX_PARAMS

__all__ = ["check_zero1_optimizer", "check_clip_sharded_grad_norm_", "check_fsdp_schedule",
           "check_zero_max_params", "check_wrap_tiny_lm"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than reduce-scatter, all-reduce or all-gather was called: "
                    "reread exercise 1's step()"),
    "timed out": ("some rank waited in a collective the others did not make, or made with "
                  "another size: reread exercise 1's 'Layout' (every shard S numbers)"),
    "returned": "the return value is not (step, inner): reread exercise 1's contract",
    "inner optimizer is": ("the inner optimizer is not of the class passed in: reread exercise "
                           "1's 'inner' bullet"),
    "holds tensors": ("the inner optimizer holds other tensors than one shard of S numbers: "
                      "reread exercise 1's 'Layout' and 'inner' bullets"),
    "state tensors": ("the optimizer state covers more than the shard: reread exercise 1's "
                      "'inner' bullet"),
    "summed instead of averaged": ("the shard's gradient is N times the mean: reread exercise "
                                   "1's step() (op=dist.ReduceOp.AVG)"),
    "slice of the mean gradient": ("the shard's gradient is not this rank's slice of the mean: "
                                   "reread exercise 1's 'Layout' and step()"),
    "differs from one process": ("the parameters after the steps differ from one process's: "
                                 "reread exercise 1's step(), its three stages in order"),
}

_CLIP_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "a collective other than dist.all_reduce was called: reread exercise 2's last bullet",
    "timed out": ("some rank did not join the all-reduce (one whose shard is all padding?): "
                  "reread exercise 2's hints"),
    "padding was counted": ("the norm counts the padding: reread exercise 2's first bullet "
                            "(flat position rS + i is real only below numel)"),
    "one shard only": ("the norm is one shard's: reread exercise 2's opening paragraph and its "
                       "hints (the ranks' parts add up)"),
    "not scaled": ("the real numbers are not scaled as clip_grad_norm_ scales them: reread "
                   "exercise 2's fourth bullet"),
    "shape or dtype": ("grad_shard changed its shape or dtype: reread exercise 2's fourth "
                       "bullet (in place)"),
    "numbers;": ("the all-reduces carried more than one number: reread exercise 2's last "
                 "bullet"),
    "norm": ("the norm differs from the whole gradient's: reread exercise 2's norm_type bullet "
             "and the accumulation rule"),
}

_WRAP_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not the wrapped model": "return the model itself: reread exercise 5's last bullet",
    "not each block": ("fully_shard each block first, then the root: reread exercise 5's "
                       "'Wrap' bullet"),
    "policies": "pass mp_policy to every fully_shard call: reread exercise 5's 'Wrap' bullet",
    "exercise's names": ("the parameters' names differ from the weights' keys: reread exercise "
                         "5's table of names and shapes"),
    "stays whole": ("a norm's gain was sharded: put every norm's weight in replicate_params, in "
                    "every call"),
    "is sharded": "a Linear or Embedding weight is whole: it belongs to a unit (not replicated)",
    "gradient of": ("the gradients differ from one process's: reread the model's formulas "
                    "(norm in fp32, causal attention, GELU, residuals)"),
    "differ from one process": ("the weights after the steps differ from one process's: did you "
                                "load the weights, and follow the formulas exactly?"),
}

_SCHEDULE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not a list": "the return value is not a list of (op, unit) pairs: reread exercise 3's table",
    "not an action": "an action is not one of the table's: reread exercise 3's table",
    "next computation": "the computations run out of order: reread exercise 3's rule 1",
    "prefetch": "a unit needed soon was not whole yet: reread exercise 3's rule 4",
    "units whole at once": "too many units were whole at once: reread exercise 3's rule 3",
    "not whole": ("a unit computed or was freed while not whole: reread exercise 3's rule 2"),
    "already whole": "a whole unit was gathered again: reread exercise 3's rule 2",
    "reduce-scatter": "a gradient was reduce-scattered late, early or twice: reread exercise 3's rule 5",
    "gathers where": ("more gathers than needed: reread exercise 3's rule 6 and the plans "
                      "drawn after the exercise"),
    "still whole": "units are still whole at the end: reread exercise 3's rule 6",
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


def check_wrap_tiny_lm(fn, skip: bool = False) -> None:
    """Visible check of exercise wrap_tiny_lm on 2 ranks (the hidden checks' kinds of case)."""
    _check(WRAP_TINY_LM, fn, (2,), "a unit per block and the root, the norms replicated, the "
           "shards' gradients and 3 AdamW steps equal one process in fp32, bf16 and fp16",
           _WRAP_HINTS, skip)
