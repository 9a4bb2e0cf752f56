"""Visible self-checks of homework 05 (expert parallelism): feedback while you work, never the grade.

    check_top_k_routing(top_k_routing)          # one PASS or FAIL line, with a hint
    check_dispatch_combine(dispatch_combine)    # on 2 and 3 ranks
    check_dispatch_combine_dedup(dispatch_combine_dedup)   # on 2 and 3 ranks, bytes too
    check_global_balance_loss(global_balance_loss)         # on 2 and 3 ranks, gradient too
    check_dedup_all_to_all_bytes(dedup_all_to_all_bytes)   # the text's worked values, then the kind

Each check builds cases of the same kinds as the hidden checks, from a fixed public
seed (the grader uses its own, private one), runs your function in fresh ranks
started by `reference.runtime.launch` under the same rules (collectives switched
off, except `all_to_all_single` for the dispatch), and compares with the course's
router (`reference.expert_parallel.router.Router`) or with the single-process weighted sum of
the experts' outputs (the deduplicated dispatch also with the elements it may send), or
with the balance loss, and its gradient, of one process holding every rank's tokens. A wrong answer, an exception or a hang is printed, never
raised, so the rest of the notebook keeps running. While grading, `skip=True` is
passed and the check does nothing.
"""
from __future__ import annotations

from reference.course.checks.questions import Worked, check_question
from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.expert_balance import GLOBAL_BALANCE_LOSS
from reference.course.homework.expert_dedup import DEDUP_ALL_TO_ALL_BYTES, DISPATCH_COMBINE_DEDUP
from reference.course.homework.expert_parallel import DISPATCH_COMBINE, TOP_K_ROUTING
from reference.course.homework.scoring import ExerciseSpec

__all__ = ["check_top_k_routing", "check_dispatch_combine", "check_dispatch_combine_dedup",
           "check_global_balance_loss", "check_dedup_all_to_all_bytes", "run_case_check"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "the only collective allowed here is dist.all_to_all_single",
    "timed out": ("every rank must call all_to_all_single the same number of times, with "
                  "splits that match: rank r's input_split_sizes[d] is rank d's "
                  "output_split_sizes[r]"),
    "most probable first": "probs.topk(k, dim=-1) gives the k largest, largest first",
    "dropped assignments changed": "leave the weights alone; `kept` marks the drops",
    "weights": "softmax over all E logits first, then pick the top k (and renormalise when k > 1)",
    "capacity is": "an expert takes at most `capacity` assignments; the rest are dropped",
    "kept=": ("order the assignments choice-major, (T, k) -> (k * T,), and count each "
              "expert's assignments so far with a cumulative sum over a one-hot matrix"),
    "ran on rank": "expert e lives on rank e // experts_per_rank: only that rank may call expert_fn(e, ...)",
    "processed": "send each kept assignment's row once, to its expert's rank; skip the -1 entries",
    "point-to-point": "dispatch and combine with dist.all_to_all_single (uneven splits)",
    "wrong output": ("the combine all-to-all returns rows in the order you sent them; scatter them "
                     "back to their tokens (index_add_) times their weights"),
    "through all_to_all_single": "send each row only to the rank that holds its expert",
    "no gradient reached": ("all_to_all_single has no backward of its own: wrap it in an "
                            "autograd Function (reread the exercise's 'Differentiable')"),
    "wrong gradient of the": ("the values are right, the gradients not: where must the gradient "
                              "of a received row go, and in which order?"),
    "in backward, more than": "backward retraces the rows' way back, nothing more",
    "returned": "check the return value against the contract in the exercise text",
}
# Looked up before the dispatch hints (the first key found in a reason picks the hint).
_DEDUP_HINTS = {
    "(token, rank) pair": ("send a token once to each rank holding one or more of its kept "
                           "experts, with those experts' ids and weights; sum their outputs "
                           "there and send one row back"),
    "tokens' dtype": "return the tokens' dtype: cast the weights to the rows' dtype",
}
_BALANCE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "the only collective allowed here is dist.all_reduce",
    "0-dim tensor": "return E * (f * P).sum(), a 0-dim tensor",
    "the dtype of probs": "compute in probs.dtype (bincount gives int64: convert it)",
    "global batch's": ("all-reduce the assignments per expert, the probability sums per expert "
                       "and the number of tokens, then divide: a mean of the ranks' own losses "
                       "is another number"),
    "no gradient": ("all-reduce a detached copy of the sums, and put this rank's own sum back "
                    "into the graph: total - mine.detach() + mine"),
    "gradient with respect to probs": ("this rank's rows get E * f_i / N_total: f carries no "
                                       "gradient, and nothing is multiplied by the world size"),
    "timed out": "every rank must call all_reduce the same number of times, with the same shape",
}


def run_case_check(spec: ExerciseSpec, fn, world_sizes, what: str, timeout: float = 30.0,
                   skip: bool = False, hints=None) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped)."""
    checked = 0

    def attempt() -> str:
        nonlocal checked
        for world_size in world_sizes:
            cases = public_cases(spec, world_size)
            reason, _ = run_cases(spec, fn, world_size, cases, timeout, record_traffic=True)
            if reason:
                return reason
            checked += len(cases)
        return ""

    return run_visible(spec, fn, attempt, lambda: f"{checked} cases equal {what}",
                       _HINTS if hints is None else hints, skip)


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
