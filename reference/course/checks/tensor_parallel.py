"""Visible self-checks for homework 03: feedback while you work, never the grade.

    check_tensor_parallel_mlp(tensor_parallel_mlp)                    # one PASS or FAIL line
    check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy)
    check_sequence_parallel_mlp(sequence_parallel_mlp)                # on 3 ranks
    check_make_tp_dropout(make_tp_dropout)                            # on 3 ranks
    check_tp_layer_bytes(tp_layer_bytes)       # the text's worked values, then the kind

The first two checks run your function on 2 and 4 ranks with
`reference.runtime.launch`, on the same kinds of inputs as the hidden checks (uneven
shards, padded vocabularies, large logits) drawn from a public seed, and compare every
rank's output and gradients with the dense single-process computation done here, in
float64. Only `dist.all_reduce` is allowed while your function runs, and every call to
it is counted. A wrong answer, an exception or a hang is printed, never raised, so the
rest of the notebook keeps running; while grading, `skip=True` is passed and the
check does nothing.
"""
from __future__ import annotations

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.scoring import ExerciseSpec
from reference.course.homework.tensor_parallel import CROSS_ENTROPY, MLP
from reference.course.homework.tensor_parallel_dropout import TP_DROPOUT
from reference.course.homework.tensor_parallel_transfer import SEQUENCE_PARALLEL, TP_LAYER_BYTES

__all__ = ["check_tensor_parallel_mlp", "check_vocab_parallel_cross_entropy", "run_dense_check",
           "check_sequence_parallel_mlp", "check_make_tp_dropout", "check_tp_layer_bytes"]

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


_SP_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "use all-gather, reduce-scatter and all-reduce only",
    "timed out": ("every rank must call the same collectives with tensors of the same size: pad "
                  "each rank's tokens to the longest shard before the all-gather"),
    "wrong output z": ("LayerNorm your own tokens, all-gather them along the sequence (dim 1), "
                       "GeLU(h A_r) B_r, reduce-scatter along the sequence, add the residual x"),
    "require grad": "write the collectives inside torch.autograd.Functions, with their backward",
    "forward all-reduces": "forward is one all-gather and one reduce-scatter, never an all-reduce",
    "made": "one all-gather and one reduce-scatter in each direction",
    "all-reduced": "only the LayerNorm's 2 C gradient numbers are all-reduced",
    "x_shard.grad": ("the all-gather's backward is a reduce-scatter (each rank's rows were used by "
                     "every rank) and the reduce-scatter's backward an all-gather"),
    "part only": ("each rank's LayerNorm saw only its tokens: all-reduce (sum) the gradients of "
                  "ln_weight and ln_bias over the group, e.g. with an identity-forward, "
                  "all-reduce-backward function applied to them (Megatron's f)"),
    "grad": "compare with the dense x + GeLU(LN(x) A) B, differentiated by autograd",
    "returned": "check the return value against the contract in the exercise text",
}

_DROPOUT_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "dropout needs no communication: every rank draws its own masks",
    "neither 0 nor": "keep each element with probability 1 - p and scale the kept ones by 1 / (1 - p)",
    "not a tensor": "return a tensor of x's shape and dtype",
    "keeps": "drop each element with probability p (keep with 1 - p)",
    "different elements": ("copies draw from the default generator, which every rank seeded "
                           "alike: never reseed it, nor draw from it differently on one rank"),
    "default generator": ("draw the shards' masks from a torch.Generator of your own (or swap "
                          "states and put the default one back): the default stream must not move"),
    "ranks 0 and 1 agree": "seed the shards' generator with the tp rank: seed + 2718 + tp_rank",
    "agrees with sharded": ("create the shards' generator once, in make_tp_dropout, so that each "
                            "call continues its stream instead of restarting it"),
    "agrees with replicated": "offset the shards' seed from the default one (Megatron adds 2718)",
    "second time": "the masks must depend on the seed and the calls only (no time, no os.urandom)",
}


def check_sequence_parallel_mlp(fn, world_sizes=(3,), timeout: float = 60.0,
                                skip: bool = False) -> None:
    """Visible check of exercise sequence_parallel_mlp (outputs, gradients, collectives)."""
    def attempt():
        for ws in world_sizes:
            failure = run_cases(SEQUENCE_PARALLEL, fn, ws, public_cases(SEQUENCE_PARALLEL, ws, PUBLIC_SEED),
                                timeout, "a collective that another rank calls with another size?")
            if failure[0]:
                return failure
        return "", ""
    run_visible(SEQUENCE_PARALLEL, fn, attempt, "equals the dense sub-block (output and gradients, "
                "LayerNorm's whole), one all-gather and one reduce-scatter each way", _SP_HINTS, skip)


def check_make_tp_dropout(fn, world_sizes=(3,), timeout: float = 60.0, skip: bool = False) -> None:
    """Visible check of exercise make_tp_dropout (the masks' properties, on 3 ranks)."""
    def attempt():
        for ws in world_sizes:
            failure = run_cases(TP_DROPOUT, fn, ws, public_cases(TP_DROPOUT, ws, PUBLIC_SEED), timeout)
            if failure[0]:
                return failure
        return "", ""
    run_visible(TP_DROPOUT, fn, attempt, "copies drop alike, shards independently, the default "
                "stream untouched, the same seed the same masks", _DROPOUT_HINTS, skip)


def check_tp_layer_bytes(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question tp_layer_bytes: the text's worked values (b = 2,
    s = 8, h = 16, tp = 4, 2 bytes: 3,072, 3,360 and 4,128 bytes), then an int."""
    small = {"b": 2, "s": 8, "h": 16, "tp": 4, "bytes_per_element": 2}
    return check_question(TP_LAYER_BYTES, fn, {"b": 1, "s": 2048, "h": 12288, "tp": 8,
                                        "bytes_per_element": 2, "mode": "sp"}, "int", skip,
                   worked=tuple(Worked({**small, "mode": mode}, value) for mode, value in
                                (("tp", 3_072), ("sp", 3_360), ("sp_regather", 4_128))))
