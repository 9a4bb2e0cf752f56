"""Visible self-checks for homework 03: feedback while you work, never the grade.

    check_tensor_parallel_mlp(tensor_parallel_mlp)                    # one PASS or FAIL line
    check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy)

A check runs your function on 2 and 4 ranks with `reference.runtime.launch`, on
the same kinds of inputs as the hidden checks (uneven shards, padded vocabularies,
large logits) drawn from a public seed, and compares every rank's output and
gradients with the dense single-process computation done here, in float64. Only
`dist.all_reduce` is allowed while your function runs, and every call to it is
counted. A wrong answer, an exception or a hang is printed, never raised, so the
rest of the notebook keeps running; while grading, `skip=True` is passed and the
check does nothing.
"""
from __future__ import annotations

from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.scoring import ExerciseSpec
from reference.course.homework.tensor_parallel import CROSS_ENTROPY, MLP

__all__ = ["check_tensor_parallel_mlp", "check_vocab_parallel_cross_entropy", "run_dense_check"]

PUBLIC_SEED = 3  # the grader draws its inputs from a seed of its own

# The first key found in the reason gives the hint, so the specific ones come first.
_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("use dist.all_reduce only (any op), inside your own autograd Functions; "
                    "the course's f, g and loss are switched off while your code is checked"),
    "timed out": "every rank must call all_reduce the same number of times, in the same order",
    "times too large": ("g's backward is the identity: every rank computes the same loss from "
                        "the same Z, so each rank's dZ already is the whole gradient"),
    "x.grad": ("f is the identity forward and all-reduces the gradient backward: each rank's "
               "columns give only a part of dX"),
    "wrong output Z": ("Z = g(GeLU(f(x) @ a_shard) @ b_shard): GeLU acts on this rank's own "
                       "columns, before g adds the ranks' partial products"),
    "require grad": ("put each all_reduce inside the forward or backward of a "
                     "torch.autograd.Function, so that autograd can see through it"),
    "times in": "the pair needs one all-reduce forward (g) and one backward (f), no more",
    "padding": ("columns whose global index is >= vocab_size are padding: keep them out of "
                "the max and the sum of exponentials, and give them zero gradient"),
    "nan": "subtract the max over the whole vocabulary (all-reduce MAX) before exp",
    "inf": "subtract the max over the whole vocabulary (all-reduce MAX) before exp",
    "wrong loss": ("loss_i = log(sum_v exp(z_iv - m_i)) - (z_i,target - m_i): all-reduce the max "
                   "(MAX), the target logit and the sum of exponentials (SUM); then the mean"),
    "gradient of logits_shard": ("d loss / d z_iv = (softmax_iv - [v = target_i]) / N on this "
                                 "rank's columns: backward needs no communication"),
    "numbers for N": "all-reduce per-token numbers only (a few times N), never the logits",
    "returned": "check the return value against the contract in the exercise text",
}


def run_dense_check(spec: ExerciseSpec, fn, world_sizes=(2, 4), timeout: float = 60.0,
                    skip: bool = False) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped)."""
    def attempt() -> tuple[str, str]:
        for world_size in world_sizes:
            failure = run_cases(spec, fn, world_size, public_cases(spec, world_size, PUBLIC_SEED),
                                timeout, "an all_reduce that another rank never calls?")
            if failure[0]:
                return failure
        return "", ""

    sizes = " and ".join(str(w) for w in world_sizes)
    return run_visible(spec, fn, attempt,
                       f"equals the dense computation on {sizes} ranks (outputs and gradients), "
                       f"using only all_reduce", _HINTS, skip)


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_tensor_parallel_mlp(fn, world_sizes=(2, 4), timeout: float = 60.0,
                              skip: bool = False) -> None:
    """Visible check of exercise tensor_parallel_mlp (Z, x.grad, dA and dB shards)."""
    run_dense_check(MLP, fn, world_sizes, timeout=timeout, skip=skip)


def check_vocab_parallel_cross_entropy(fn, world_sizes=(2, 4), timeout: float = 60.0,
                                       skip: bool = False) -> None:
    """Visible check of exercise vocab_parallel_cross_entropy (loss and logits' gradient)."""
    run_dense_check(CROSS_ENTROPY, fn, world_sizes, timeout=timeout, skip=skip)
