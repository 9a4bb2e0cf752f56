"""Visible self-checks of homework 06 (the 3D mesh): feedback while you work, never the grade.

    check_mesh_groups(mesh_groups)                   # one PASS or FAIL line, with a hint
    check_parameters_per_rank(parameters_per_rank)

Both exercises are pure functions: each check runs yours on one rank, on the same kinds
of cases as the hidden checks drawn from a public seed, and compares with the course's
mesh and with the parameters that `parallelize` really leaves on each rank.
"""
from __future__ import annotations

from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.parallel import MESH_GROUPS, PARAMETERS_PER_RANK

__all__ = ["check_mesh_groups", "check_parameters_per_rank"]

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
}


def _check(spec, fn, success: str, skip: bool) -> None:
    run_visible(spec, fn, lambda: run_cases(spec, fn, 1, public_cases(spec, 1), timeout=60.0),
                success, _HINTS, skip)


def check_mesh_groups(fn, skip: bool = False) -> None:
    """Visible check of exercise mesh_groups (compares with reference.mesh.Mesh)."""
    names = ", ".join(c.name for c in public_cases(MESH_GROUPS, 1))
    _check(MESH_GROUPS, fn, f"every group of {names} equals the course's mesh", skip)


def check_parameters_per_rank(fn, skip: bool = False) -> None:
    """Visible check of exercise parameters_per_rank (compares with what parallelize leaves)."""
    _check(PARAMETERS_PER_RANK, fn, "every rank's count equals what parallelize leaves on it", skip)
