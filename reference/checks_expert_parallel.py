"""Visible self-checks of homework 05 (expert parallelism): feedback while you work, never the grade.

    check_top_k_routing(top_k_routing)          # one PASS or FAIL line, with a hint
    check_dispatch_combine(dispatch_combine)    # on 2 and 3 ranks

Each check builds cases of the same kinds as the hidden checks, from a fixed public
seed (the grader uses its own, private one), runs your function in fresh ranks
started by `reference.runtime.launch` under the same rules (collectives switched
off, except `all_to_all_single` for the dispatch), and compares with the course's
router (`reference.moe_router.Router`) or with the single-process weighted sum of
the experts' outputs. A wrong answer, an exception or a hang is printed, never
raised, so the rest of the notebook keeps running. While grading, `skip=True` is
passed and the check does nothing.
"""
from __future__ import annotations

import cloudpickle
import torch
import torch.distributed as dist

from .homework.expert_parallel import DISPATCH_COMBINE, TOP_K_ROUTING
from .homework.guard import exercise_rules
from .homework.scoring import ExerciseSpec, one_line
from .runtime import RankError, RankTimeoutError, launch

__all__ = ["check_top_k_routing", "check_dispatch_combine", "run_case_check"]

VISIBLE_SEED = 2024

_HINTS = {
    "not implemented": "replace the `raise NotImplementedError` line with your code",
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
    "returned": "check the return value against the contract in the exercise text",
}


def _hint(reason: str) -> str:
    return next((h for key, h in _HINTS.items() if key in reason), "")


def _rank_check(spec: ExerciseSpec, fn_bytes: bytes, cases: dict) -> dict:
    """In each rank: run the student's function on this rank's input of every case."""
    outputs = {}
    with exercise_rules(spec.id, spec.forbidden) as traffic:
        fn = cloudpickle.loads(fn_bytes)
        for name, inputs in cases.items():
            traffic.clear()
            out = spec.call(fn, inputs[dist.get_rank()])
            out["sends"] = [[-1 if p is None else int(p), int(n)] for p, n in traffic.sends]
            out["recvs"] = [[-1 if p is None else int(p), int(n)] for p, n in traffic.recvs]
            outputs[name] = out
    return outputs


def _failure(spec: ExerciseSpec, fn, world_sizes, timeout) -> tuple[str, int]:
    """("", cases checked) when everything passes, else (the first failure on one line, 0)."""
    fn_bytes = cloudpickle.dumps(fn)
    checked = 0
    for world_size in world_sizes:
        cases = spec.make_cases(torch.Generator().manual_seed(VISIBLE_SEED + world_size), world_size)
        try:
            # Not quiet: what your code prints shows, as "[rank r] ..." lines.
            ranks = launch(_rank_check, world_size, spec, fn_bytes,
                           {c.name: c.inputs for c in cases}, timeout=timeout)
        except RankTimeoutError as err:
            return (f"on {world_size} ranks: timed out after {timeout:g} s; ranks {err.ranks} "
                    f"did not finish"), 0
        except RankError as err:
            summary = err.failures.get(err.rank) or str(err).splitlines()[0]
            if summary.startswith("NotImplementedError"):
                return "not implemented yet", 0
            if summary.startswith("NotAllowedError"):
                return one_line(summary.split(": ", 1)[-1]) + " (not allowed)", 0
            where = "\n".join("     | " + line for line in err.traceback.strip().splitlines()[-6:])
            return (f"on {world_size} rank(s), rank {err.rank} raised {one_line(summary)}"
                    + (f"\n{where}" if where else "")), 0
        for case in cases:
            reason = spec.judge(case.inputs, spec.expect(case.inputs),
                                [r[case.name] for r in ranks], world_size)
            if reason:
                return f"on {world_size} rank(s), case {case.name!r}: {reason}", 0
            checked += 1
    return "", checked


def run_case_check(spec: ExerciseSpec, fn, world_sizes, what: str, timeout: float = 30.0,
                   skip: bool = False) -> bool | None:
    """Check `fn` as the answer to `spec`; print one line; True/False (None when skipped)."""
    if skip:
        print(f"skipped {spec.id}: the grader runs its own hidden checks")
        return None
    try:
        if not callable(fn):
            reason, checked = f"expected a function, got {type(fn).__name__}", 0
        else:
            reason, checked = _failure(spec, fn, tuple(world_sizes), timeout)
    except Exception as exc:  # noqa: BLE001 - a check must never stop the notebook
        reason = f"the check could not run your function: {one_line(f'{type(exc).__name__}: {exc}')}"
    if not reason:
        print(f"PASS {spec.id}: {checked} cases equal {what}")
        return True
    hint = _hint(reason)
    print(f"FAIL {spec.id}: {reason}" + (f"\n     hint: {hint}" if hint else ""))
    return False


# The check_* functions print and return None, so a notebook cell shows only their line.

def check_top_k_routing(fn, timeout: float = 30.0, skip: bool = False) -> None:
    """Visible check of exercise top_k_routing (compares with reference.moe_router.Router)."""
    run_case_check(TOP_K_ROUTING, fn, (1,), "the course's Router (indices, weights, keep mask)",
                   timeout=timeout, skip=skip)


def check_dispatch_combine(fn, world_sizes=(2, 3), timeout: float = 30.0,
                           skip: bool = False) -> None:
    """Visible check of exercise dispatch_combine (compares with the single-process sum)."""
    sizes = " and ".join(str(w) for w in world_sizes)
    run_case_check(DISPATCH_COMBINE, fn, world_sizes,
                   f"the single-process MoE sum on {sizes} ranks, each expert on its own rank",
                   timeout=timeout, skip=skip)
