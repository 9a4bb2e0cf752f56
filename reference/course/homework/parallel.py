"""Hidden checks of homework 06: the 3D mesh's groups, and what each rank of a 3D run holds.

* ``mesh_groups(dp, tp, pp, ep)``: every process group of a dp x tp x pp mesh with ep carved
  out of dp (``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``, ``dp_rank = edp_rank * ep +
  ep_rank``), as {"tp", "dp", "pp", "ep", "edp"} -> list of rank lists. Compared with
  `reference.mesh.Mesh.group_ranks`, the order of the groups and of the ranks in a group
  ignored. Cases: degrees of 1, odd degrees (3), ep of 1, 2 and 4, up to 48 ranks.
* ``parameters_per_rank(model, dp, tp, pp)``: the numbers each rank holds after
  `parallelize` (blocks dealt out with the extra ones on the later stages, the vocabulary
  padded to a multiple of tp and split, LayerNorms and row-parallel biases whole on every
  tp rank, the positions on the first stage, the tied embedding's copy on the last). The
  expected values come from `reference.parallel.estimate.stage_params`, which the course's
  tests check against the parameters of real `parallelize` runs. Cases: tied and untied,
  a vocabulary tp does not divide, layers pp does not divide, pp = 1 and tp = 1.
Both are pure functions: one rank runs each case; nothing is communicated.
The transfer exercises (global_grad_norm, reshard_plan) and the written question
(step_bytes_3d) are checked in `parallel_extra`; the composed exercise (finish_step: one
step's gradients, loss and norm of a dp x tp x pp run, against one process) in
`parallel_step`; activation checkpointing by hand (recompute: the input and the random
state kept, the same dropout masks drawn again in backward, against fn called directly) in
`parallel_recompute`.
"""
from __future__ import annotations

import torch

from reference.course.homework.scoring import Case, ExerciseSpec
from reference.mesh import Mesh
from reference.model import GPTConfig
from reference.parallel.config import ParallelConfig
from reference.parallel.estimate import stage_params

__all__ = ["MESH_GROUPS", "PARAMETERS_PER_RANK", "EXERCISES", "DIMS"]

DIMS = ("tp", "dp", "pp", "ep", "edp")


def _normal(groups) -> list:
    return sorted(sorted(int(r) for r in g) for g in groups)


# ------------------------------------------------------------------ mesh_groups

def call_mesh_groups(fn, case: dict) -> dict:
    out = fn(case["dp"], case["tp"], case["pp"], case["ep"])
    if not isinstance(out, dict):
        return {"error": f"returned a {type(out).__name__}, not a dict of dimension -> groups"}
    plain = {}
    for dim in DIMS:
        groups = out.get(dim)
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
            return {"error": f"returned no list of rank lists for {dim!r}"}
        plain[dim] = [[int(r) for r in g] for g in groups]
    return {"groups": plain, "error": ""}


def expect_mesh_groups(inputs: list) -> list:
    case = inputs[0]
    mesh = Mesh(dp=case["dp"], tp=case["tp"], pp=case["pp"], ep=case["ep"])
    return [{dim: _normal(mesh.group_ranks(dim)) for dim in DIMS}]


def judge_mesh_groups(inputs, expected, outputs, world_size) -> str:
    out, want, case = outputs[0], expected[0], inputs[0]
    if out.get("error"):
        return out["error"]
    for dim in DIMS:
        got = _normal(out["groups"][dim])
        if got != want[dim]:
            mine = next((g for g in want[dim] if g not in got), None)
            return (f"{dim} groups for dp={case['dp']} tp={case['tp']} pp={case['pp']} "
                    f"ep={case['ep']}: {got[:4]}{' ...' if len(got) > 4 else ''}; the group "
                    f"{mine} is missing")
    return ""


def make_mesh_cases(generator, world_size) -> list:
    def pick(options):
        return options[int(torch.randint(0, len(options), (), generator=generator))]

    sizes = [(1, 1, 1, 1), (2, 2, 2, 1), (pick([3, 6]), 2, 1, 1), (4, 1, 2, 2),
             (pick([4, 8]), 2, pick([2, 3]), 4), (6, pick([1, 3]), 2, 3)]
    return [Case(f"dp={dp} tp={tp} pp={pp} ep={ep}", [dict(dp=dp, tp=tp, pp=pp, ep=ep)] * world_size)
            for dp, tp, pp, ep in sizes]


def course_mesh_groups(dp, tp, pp, ep=1) -> dict:
    mesh = Mesh(dp=dp, tp=tp, pp=pp, ep=ep)
    return {dim: mesh.group_ranks(dim) for dim in DIMS}


# ------------------------------------------------------------------ parameters_per_rank

def _config(model: dict) -> GPTConfig:
    return GPTConfig(**model)


def call_parameters(fn, case: dict) -> dict:
    out = fn(dict(case["model"]), case["dp"], case["tp"], case["pp"])
    if not isinstance(out, (list, tuple)) or not all(isinstance(v, int) for v in out):
        return {"error": f"returned {type(out).__name__}, not a list of ints (one per rank)"}
    return {"counts": [int(v) for v in out], "error": ""}


def expect_parameters(inputs: list) -> list:
    case = inputs[0]
    cfg = _config(case["model"])
    config = ParallelConfig(dp=case["dp"], tp=case["tp"], pp=case["pp"])
    mesh = config.mesh()
    return [[stage_params(cfg, config, mesh.coords(r).pp) for r in range(config.world_size)]]


def judge_parameters(inputs, expected, outputs, world_size) -> str:
    out, want, case = outputs[0], expected[0], inputs[0]
    if out.get("error"):
        return out["error"]
    got = out["counts"]
    if len(got) != len(want):
        return f"{len(got)} counts for a world of {len(want)} ranks"
    for rank, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return (f"rank {rank} holds {w:,} numbers, you said {g:,} (dp={case['dp']} "
                    f"tp={case['tp']} pp={case['pp']}, {case['model']})")
    return ""


def make_parameter_cases(generator, world_size) -> list:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    def model(tie, vocab, n_layer, n_embd=16, n_head=4):
        return dict(vocab_size=vocab, block_size=draw(8, 24), n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, tie_weights=tie)

    specs = [("tied, tp 2, pp 2", model(True, 64, 4), 1, 2, 2),
             ("untied, vocab tp does not divide", model(False, 4 * draw(20, 40) + 1, 2), 2, 4, 1),
             ("layers pp does not divide", model(True, 50, 2 * draw(2, 3) + 1), 1, 2, 2),
             ("pp 3, tied, dp 2", model(True, 96, draw(3, 7), n_embd=24, n_head=6), 2, 3, 3),
             ("one stage, tp 1", model(False, 40, 2), 4, 1, 1)]
    return [Case(name, [dict(model=m, dp=dp, tp=tp, pp=pp)] * world_size) for name, m, dp, tp, pp in specs]


def course_parameters(model: dict, dp: int, tp: int, pp: int) -> list:
    return expect_parameters([dict(model=model, dp=dp, tp=tp, pp=pp)])[0]


MESH_GROUPS = ExerciseSpec(
    id="mesh_groups", title="The process groups of a 3D (4D) mesh", difficulty="★★☆ medium",
    world_sizes=(1,), make_cases=make_mesh_cases, call=call_mesh_groups,
    expect=expect_mesh_groups, judge=judge_mesh_groups, reference=course_mesh_groups,
    banned=("reference.course.homework.parallel.course_mesh_groups", "reference.mesh"))
PARAMETERS_PER_RANK = ExerciseSpec(
    id="parameters_per_rank", title="The numbers each rank of a 3D run holds",
    difficulty="★★★ hard", world_sizes=(1,), make_cases=make_parameter_cases,
    call=call_parameters, expect=expect_parameters, judge=judge_parameters,
    reference=course_parameters,
    banned=("reference.course.homework.parallel.course_parameters", "reference.parallel.estimate",
            "reference.parallel.estimate_memory", "reference.parallel.explorer"))
HOMEWORK_ID = "06_3d_parallel"
# The warm-up, a transfer of the lecture's counting, two transfers to what it did not
# show (clipping, resharding; parallel_extra) and the written question.
from reference.course.homework.parallel_extra import (  # noqa: E402 - after the specs it extends
    GLOBAL_GRAD_NORM, RESHARD_PLAN, STEP_BYTES_3D,
)
# The composed exercise: one step's gradients, loss and norm, against one process.
from reference.course.homework.parallel_step import FINISH_STEP  # noqa: E402
# The clinic's sixth mistake: a recomputation that draws other dropout masks.
from reference.course.homework.parallel_recompute import RECOMPUTE  # noqa: E402
# FSDP inside tensor parallelism: the rows a rank holds.
from reference.course.homework.parallel_fsdp import FSDP_TP_PIECES  # noqa: E402

# An answer wrong in principle fails only the cases that can show it (a norm summed over
# the dp replicas: those with dp > 1; a clip not capped at 1: those where it does not act):
# failing any case keeps at most half of the exercise.
WRONG_KEEPS = 0.5
EXERCISES = (MESH_GROUPS, PARAMETERS_PER_RANK, GLOBAL_GRAD_NORM, RESHARD_PLAN, FINISH_STEP,
             RECOMPUTE, FSDP_TP_PIECES, STEP_BYTES_3D)
