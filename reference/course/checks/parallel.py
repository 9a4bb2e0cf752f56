"""Visible self-checks of homework 06 (the 3D mesh): feedback while you work, never the grade.

    check_mesh_groups(mesh_groups)                   # one PASS or FAIL line, with a hint
    check_parameters_per_rank(parameters_per_rank)
    check_global_grad_norm(global_grad_norm)         # on 2 and 4 ranks
    check_reshard_plan(reshard_plan)
    check_dp_gradient_bytes(dp_gradient_bytes)       # the kind of number, never its value

The pure functions (mesh_groups, parameters_per_rank, reshard_plan) run on one rank,
global_grad_norm on 2 and 4 ranks, each on the same kinds of cases as the hidden checks
drawn from a public seed, compared with the course's mesh, the parameters that
`parallelize` really leaves on each rank, the true norm and the true row ranges.
"""
from __future__ import annotations

from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.checks.questions import check_question
from reference.course.homework.parallel import MESH_GROUPS, PARAMETERS_PER_RANK
from reference.course.homework.parallel_extra import DP_GRADIENT_BYTES, GLOBAL_GRAD_NORM, RESHARD_PLAN

__all__ = ["check_mesh_groups", "check_parameters_per_rank", "check_global_grad_norm",
           "check_reshard_plan", "check_dp_gradient_bytes"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not a dict": "return {'tp': [[...], ...], 'dp': ..., 'pp': ..., 'ep': ..., 'edp': ...}",
    "tp groups": "a tp group is tp consecutive ranks: same pp and dp, tp_rank = rank % tp",
    "dp groups": "a dp group: same pp and tp; its members are tp apart",
    "pp groups": "a pp group: same dp and tp; its members are dp * tp apart",
    "ep groups": ("ep is carved out of dp: dp_rank = edp_rank * ep + ep_rank, so an ep group is "
                  "ep consecutive dp ranks (same pp, tp and edp)"),
    "edp groups": "an edp group: same pp, tp and ep_rank; its dp ranks are ep apart",
    "not a list of ints": "return one int per rank, in rank order",
    "holds": ("blocks are dealt out evenly, the later stages taking one more when pp does not "
              "divide; each block is 12 C^2 + 13 C numbers, of which the two LayerNorms and the "
              "two row-parallel biases (6 C) stay whole on every tp rank; the vocabulary is "
              "padded to a multiple of tp and split; the positions (block_size x C) live on the "
              "first stage; with tied weights the last stage holds its own copy of its shard of "
              "the embedding, and ln_f (2 C) is on the last stage"),
    "not allowed": "only dist.all_reduce is allowed (over tp_group, then pp_group)",
    "ratio 1.": ("too large: a replicated tensor is the same numbers on every tp rank; count it "
                 "on tp rank 0 only"),
    "ratio 0.": ("too small: add the sums of squares of every tp rank (all-reduce over tp_group) "
                 "and of every stage (over pp_group) before the square root"),
    "changed its gradients": "compute the norm from copies or with out-of-place operations",
    "new rank": ("intersect the new rank's rows [lo, hi) with each old rank's [a, b) and give the "
                 "overlap in the old rank's numbering (subtract a)"),
}


def _check(spec, fn, success: str, skip: bool) -> None:
    run_visible(spec, fn, lambda: run_cases(spec, fn, 1, public_cases(spec, 1), timeout=60.0),
                success, _HINTS, skip)


def _check_on(spec, fn, world_sizes, success: str, skip: bool) -> None:
    def attempt():
        for ws in world_sizes:
            reason = run_cases(spec, fn, ws, public_cases(spec, ws), timeout=60.0)
            if reason[0]:
                return reason
        return ""
    run_visible(spec, fn, attempt, success, _HINTS, skip)


def check_mesh_groups(fn, skip: bool = False) -> None:
    """Visible check of exercise mesh_groups (compares with reference.mesh.Mesh)."""
    names = ", ".join(c.name for c in public_cases(MESH_GROUPS, 1))
    _check(MESH_GROUPS, fn, f"every group of {names} equals the course's mesh", skip)


def check_parameters_per_rank(fn, skip: bool = False) -> None:
    """Visible check of exercise parameters_per_rank (compares with what parallelize leaves)."""
    _check(PARAMETERS_PER_RANK, fn, "every rank's count equals what parallelize leaves on it", skip)


def check_global_grad_norm(fn, skip: bool = False) -> None:
    """Visible check of exercise global_grad_norm on 2 and 4 ranks (tp, pp, tp x pp)."""
    _check_on(GLOBAL_GRAD_NORM, fn, (2, 4),
              "every rank returns the model's norm, each number counted once", skip)


def check_reshard_plan(fn, skip: bool = False) -> None:
    """Visible check of exercise reshard_plan (against the true row ranges)."""
    _check(RESHARD_PLAN, fn, "every new rank's pieces rebuild exactly its new shard", skip)


def check_dp_gradient_bytes(fn, skip: bool = False) -> None:
    """Visible check of the written question dp_gradient_bytes: an int comes back."""
    check_question(DP_GRADIENT_BYTES, fn, {"n_params": 124_439_808, "dp": 8, "tp": 2, "pp": 2,
                                           "bytes_per_element": 2}, "int", skip)
