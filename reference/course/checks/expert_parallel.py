"""Visible self-checks of homework 05 (expert parallelism): feedback while you work, never the grade.

    check_top_k_routing(top_k_routing)          # one PASS or FAIL line, with a hint
    check_dispatch_combine(dispatch_combine)    # on 2 and 3 ranks
    check_dispatch_combine_dedup(dispatch_combine_dedup)   # on 2 and 3 ranks, bytes too
    check_global_balance_loss(global_balance_loss)         # on 2 and 3 ranks, gradient too
    check_dedup_all_to_all_bytes(dedup_all_to_all_bytes)   # the text's worked values, then the kind
    check_balanced_step(balanced_step)                     # the text's worked example, then 2 and 3 ranks

Each check builds cases of the same kinds as the hidden checks, from a fixed public
seed (the grader uses its own, private one), runs your function in fresh ranks
started by `reference.runtime.launch` under the same rules (collectives switched
off, except `all_to_all_single` for the dispatch), and compares with the course's
router (`reference.expert_parallel.router.Router`) or with the single-process weighted sum of
the experts' outputs (the deduplicated dispatch also with the elements it may send), or
with the balance loss, and its gradient, of one process holding every rank's tokens, or with
the course's biased `Router` routing every rank's micro-batches in one process (after the
text's worked example, whose numbers are asserted). A wrong answer, an exception or a hang is printed, never
raised, so the rest of the notebook keeps running. While grading, `skip=True` is
passed and the check does nothing.
"""
from __future__ import annotations

import torch

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.expert_balance import GLOBAL_BALANCE_LOSS
from reference.course.homework.expert_bias import BALANCED_STEP
from reference.course.homework.expert_dedup import DEDUP_ALL_TO_ALL_BYTES, DISPATCH_COMBINE_DEDUP
from reference.course.homework.expert_parallel import DISPATCH_COMBINE, TOP_K_ROUTING
from reference.course.homework.scoring import Case, ExerciseSpec

__all__ = ["check_top_k_routing", "check_dispatch_combine", "check_dispatch_combine_dedup",
           "check_global_balance_loss", "check_dedup_all_to_all_bytes", "check_balanced_step",
           "run_case_check", "WORKED_BALANCED_STEP", "WORKED_NEW_BIAS"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than dist.all_to_all_single was called: reread exercise "
                    "2's steps"),
    "timed out": ("some rank waited in an all-to-all whose splits did not match its peers': "
                  "reread exercise 2's steps 2 and 3 (rank r's input split d is rank d's "
                  "output split r)"),
    "most probable first": ("the chosen experts or their order differ: reread exercise 1's "
                            "`expert_idx` bullet"),
    "dropped assignments changed": ("the weights of dropped assignments changed: reread exercise "
                                    "1's `kept` bullet (it alone marks the drops)"),
    "weights": ("the weights differ (Switch for k = 1, GShard for k > 1): reread exercise 1's "
                "`weights` bullet"),
    "capacity is": "an expert kept more than its capacity: reread exercise 1's `kept` bullet",
    "kept=": ("the wrong assignments got the slots: reread exercise 1's order of the slots "
              "(every first choice in position order, then every second choice)"),
    "ran on rank": ("an expert ran on a rank that does not hold it: reread exercise 2's "
                    "`expert_fn` bullet (expert e lives on group rank e // experts_per_rank)"),
    "processed": ("an expert saw more or fewer rows than its kept assignments: reread exercise "
                  "2's `expert_idx` and `expert_fn` bullets"),
    "point-to-point": "send/recv were used: reread exercise 2's steps (all_to_all_single only)",
    "wrong output": ("a token's row differs from the weighted sum of its experts: reread "
                     "exercise 2's steps 5 and 6"),
    "through all_to_all_single": ("more elements went through the all-to-alls than the rows "
                                  "need: reread exercise 2's step 3"),
    "no gradient reached": ("no gradient reached the tokens or the weights: reread exercise 2's "
                            "'Differentiable'"),
    "wrong gradient of the": ("the values are right, the gradients not: reread exercise 2's "
                              "'Differentiable' (where must a received row's gradient go?)"),
    "in backward, more than": ("backward sent more than the forward: reread exercise 2's "
                               "'Differentiable'"),
    "not in the group": ("a message went outside the group: reread exercise 2's `expert_fn` "
                         "bullet (ranks within the group)"),
    "returned": "the return value is not what the contract says: reread the exercise's contract",
}
# Looked up before the dispatch hints (the first key found in a reason picks the hint).
_DEDUP_HINTS = {
    "(token, rank) pair": ("more rows were sent than one per (token, rank) pair: reread exercise "
                           "3's first two bullets and its step 1"),
    "tokens' dtype": ("the result is not in the tokens' dtype: reread exercise 3's third "
                      "bullet"),
}
_BALANCE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than dist.all_reduce was called: reread exercise 4's "
                    "last bullet"),
    "0-dim tensor": "the return value is not a 0-dim tensor: reread exercise 4's return bullet",
    "the dtype of probs": ("the loss is not in probs' dtype: reread exercise 4's return "
                           "bullet"),
    "global batch's": ("the loss differs from the global batch's (a mean of the ranks' own "
                       "losses is another number): reread exercise 4's formula, f and P over "
                       "all ranks' tokens"),
    "no gradient": ("the loss has no gradient with respect to this rank's probs: reread "
                    "exercise 4's gradient bullet (which sum stays in the graph?)"),
    "gradient with respect to probs": ("the gradient differs from one process's: reread "
                                       "exercise 4's gradient bullet (E f_i / N_total)"),
    "timed out": ("some rank waited in an all-reduce the others did not make: reread exercise "
                  "4's last bullet (every rank, with group=group)"),
}

_BIAS_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": ("a collective other than dist.all_reduce was called: reread exercise 6's "
                    "last rule"),
    "items; expected the tuple": "the return value is not (expert_idx, weights, new_bias): reread exercise 6's rules",
    "micro-batches": ("expert_idx and weights hold one tensor per micro-batch, in the order of "
                      "probs: reread exercise 6's rules"),
    "is not a": "the return value is not what the contract says: reread exercise 6's rules",
    "int64 (N_j, k)": ("expert_idx[j] is not int64 (N_j, k) (an empty micro-batch too): reread "
                       "exercise 6's expert_idx rule"),
    "float32 (N_j, k)": "weights[j] is not float32 (N_j, k): reread exercise 6's weights rule",
    ": experts": ("the chosen experts differ: the k largest probs + bias, largest first, every "
                  "micro-batch with the bias the step started with (it moves only after the step)"),
    ": weights": ("the weights differ: the bias only chooses; the weights are the chosen "
                  "experts' own probabilities (renormalised when k > 1)"),
    "new_bias is": "new_bias is not an (E,) float32 tensor: reread exercise 6's new_bias rule",
    "new_bias": ("the new bias differs: the load counts every micro-batch of every rank of the "
                 "group, summed once, and b moves by rate * sign(mean - load): an overloaded "
                 "expert down, an expert at the mean not at all"),
    "in place": "the bias argument was changed: return a new tensor (bias + ...), not bias += ...",
    "timed out": ("some rank waited in an all-reduce the others did not make: reread exercise "
                  "6's last rule (one all-reduce, every rank, with group=group)"),
}
# The text's worked example (2 ranks, E = 4, k = 2): the check asserts its numbers first.
WORKED_BALANCED_STEP = Case("the text's worked example", [
    {"probs": [torch.tensor([[0.4, 0.3, 0.2, 0.1]]), torch.tensor([[0.1, 0.5, 0.3, 0.1]])],
     "bias": torch.tensor([0.0, 0.0, 0.0, 0.25]), "k": 2, "rate": 0.1},
    {"probs": [torch.zeros(0, 4), torch.tensor([[0.2, 0.2, 0.5, 0.1], [0.3, 0.1, 0.2, 0.4]])],
     "bias": torch.tensor([0.0, 0.0, 0.0, 0.25]), "k": 2, "rate": 0.1},
])
WORKED_NEW_BIAS = [0.0, 0.1, 0.1, 0.15]  # loads [2, 1, 1, 4], mean 2: the text's (a test holds the Router to it)


def run_case_check(spec: ExerciseSpec, fn, world_sizes, what: str, timeout: float = 30.0,
                   skip: bool = False, hints=None, extra=None) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped).

    extra: {world size: cases run before the public ones} (a text's worked example)."""
    extra = extra or {}
    checked = 0

    def attempt() -> str:
        nonlocal checked
        for world_size in world_sizes:
            cases = public_cases(spec, world_size)
            cases = [*extra.get(world_size, ()), *cases]
            reason, _ = run_cases(spec, fn, world_size, cases, timeout, record_traffic=True)
            if reason:
                return reason
            checked += len(cases)
        return ""

    return run_visible(spec, fn, attempt, lambda: f"{checked} cases equal {what}",
                       _HINTS if hints is None else hints, skip, timeout)


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_top_k_routing(fn, timeout: float = 30.0, skip: bool = False) -> None:
    """Visible check of exercise top_k_routing (compares with reference.expert_parallel.router.Router)."""
    run_case_check(TOP_K_ROUTING, fn, (1,), "the course's Router (indices, weights, keep mask)",
                   timeout=timeout, skip=skip)


def check_dispatch_combine(fn, world_sizes=(2, 3), timeout: float = 30.0,
                           skip: bool = False) -> None:
    """Visible check of exercise dispatch_combine (compares with the single-process sum)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_case_check(DISPATCH_COMBINE, fn, world_sizes,
                   f"the single-process MoE sum and its gradients on {sizes} ranks, each "
                   f"expert on its own rank",
                   timeout=timeout, skip=skip)


def check_dispatch_combine_dedup(fn, world_sizes=(2, 3), timeout: float = 30.0,
                                 skip: bool = False) -> None:
    """Visible check of exercise dispatch_combine_dedup (the MoE sum, and one row per
    (token, rank) pair on the wire)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_case_check(DISPATCH_COMBINE_DEDUP, fn, world_sizes,
                   f"the single-process MoE sum on {sizes} ranks, each token sent once per rank",
                   timeout=timeout, skip=skip, hints={**_DEDUP_HINTS, **_HINTS})


def check_global_balance_loss(fn, world_sizes=(2, 3), timeout: float = 30.0,
                              skip: bool = False) -> None:
    """Visible check of exercise global_balance_loss (value and gradient of one process)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_case_check(GLOBAL_BALANCE_LOSS, fn, world_sizes,
                   f"the global batch's loss and its gradient on {sizes} ranks",
                   timeout=timeout, skip=skip, hints=_BALANCE_HINTS)


def check_dedup_all_to_all_bytes(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question dedup_all_to_all_bytes: the text's worked value
    (64 tokens of width 16, k = 4, ep = 4, 2 ranks a token, 2 bytes: 6,144 bytes), then an int."""
    return check_question(DEDUP_ALL_TO_ALL_BYTES, fn, {"tokens": 8192, "d_model": 7168, "k": 8, "ep": 32,
                                                "ranks_per_token": 4, "bytes_per_element": 2},
                   "int", skip,
                   worked=(Worked({"tokens": 64, "d_model": 16, "k": 4, "ep": 4,
                                   "ranks_per_token": 2, "bytes_per_element": 2}, 6_144),))


def check_balanced_step(fn, world_sizes=(2, 3), timeout: float = 30.0,
                        skip: bool = False) -> None:
    """Visible check of exercise balanced_step: the text's worked example on 2 ranks (new bias
    [0, 0.1, 0.1, 0.15]), then the course's biased Router over every rank's micro-batches."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_case_check(BALANCED_STEP, fn, world_sizes,
                   f"the course's biased Router over every micro-batch and rank on {sizes} "
                   f"ranks (the text's worked example among them)",
                   timeout=timeout, skip=skip, hints=_BIAS_HINTS,
                   extra={2: (WORKED_BALANCED_STEP,)} if 2 in world_sizes else {})
