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
  a vocabulary tp does not divide, layers pp does not divide, pp = 1 untied and tied (one
  stage: the tied head is the embedding itself, not a second copy), and tp = 1.
* ``global_grad_norm(shard, sizes, tp_split, groups)``: the gradient norm of the whole model
  on a dp x tp x pp mesh under ZeRO-1, from each rank's shard of its flat gradient buffer
  (the rank's tensors end to end, zero-padded to a multiple of dp, dp rank d holding numbers
  [d S, (d + 1) S) after the reduce-scatter); ``sizes`` the tensors' lengths in buffer order,
  ``tp_split`` whether each is this tp rank's slice or replicated over tp. Each number
  counted once: every dp rank's shard, a slice on every tp rank, a replicated tensor's
  numbers on tp rank 0 only, summed over dp, tp and pp. Only ``all_reduce`` is allowed.
  Cases on 4 and 8 ranks: dp 2 or 4, with tp, pp or both, and two dp 2 x tp 2 models side
  by side in one world of 8 (each model's sums stay in its own groups); float32 and float64
  shards; tensors of drawn lengths, split and replicated alternating, so that shards start
  and end inside tensors and straddle a split and a replicated one; buffers with and
  without padding. Every rank must return its model's float64 truth (built from the whole
  buffers, the dp shards put back together) within `reference.tolerance.gradient(n)`, a sum
  over the n ranks. Wrong in principle and caught: counting dp rank 0's shard alone (the
  rule of the unsharded clip, where every dp rank holds the same numbers), counting
  replicated numbers on every tp rank, deciding a whole shard's count by the tensor it
  starts in, placing the shard at the buffer's start, or one all-reduce over the world
  instead of the model's groups; each fails a case and keeps at most half the points.
mesh_groups and parameters_per_rank are pure functions: one rank runs each case; nothing
is communicated. The transfer exercise reshard_plan and the written question
(step_bytes_3d) are checked in `parallel_transfer`; the composed exercise (finish_step: one
step's gradients, loss and norm of a dp x tp x pp run, against one process) in
`parallel_step`; activation checkpointing by hand (recompute: the input and the random
state kept, the same dropout masks drawn again in backward, against fn called directly) in
`parallel_recompute`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.mesh import Mesh
from reference.tolerance import gradient
from reference.model import GPTConfig
from reference.parallel.config import ParallelConfig
from reference.parallel.estimate import stage_params

__all__ = ["MESH_GROUPS", "PARAMETERS_PER_RANK", "GLOBAL_GRAD_NORM", "EXERCISES", "DIMS",
           "course_global_grad_norm"]

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
             ("one stage, tp 1", model(False, 40, 2), 4, 1, 1),
             # tied on one stage: the head is the embedding itself, counted once
             ("tied, one stage, tp 2", model(True, 48, 2), 1, 2, 1)]
    return [Case(name, [dict(model=m, dp=dp, tp=tp, pp=pp)] * world_size) for name, m, dp, tp, pp in specs]


def course_parameters(model: dict, dp: int, tp: int, pp: int) -> list:
    return expect_parameters([dict(model=model, dp=dp, tp=tp, pp=pp)])[0]


# ------------------------------------------------------------------ global_grad_norm (ZeRO-1)

def course_global_grad_norm(shard, sizes, tp_split, groups) -> float:
    """The course's answer: the squares of this shard's numbers that this rank counts (a slice
    on every tp rank, a replicated tensor on tp rank 0), summed over dp, tp and pp."""
    n, start = shard.numel(), dist.get_rank(groups["dp"]) * shard.numel()
    first_tp = dist.get_rank(groups["tp"]) == 0
    total, offset = torch.zeros((), dtype=torch.float64), 0
    for size, split in zip(sizes, tp_split):
        lo, hi = max(offset, start), min(offset + size, start + n)   # the tensor's part in the shard
        if lo < hi and (split or first_tp):
            total += shard[lo - start:hi - start].double().pow(2).sum()
        offset += size
    for dim in ("dp", "tp", "pp"):
        dist.all_reduce(total, group=groups[dim])
    return math.sqrt(total.item())


def _mesh_groups(dp: int, tp: int, pp: int, copies: int = 1) -> dict:
    """This rank's dp, tp and pp groups in its copy of the mesh (`copies` meshes side by side,
    copy c on global ranks c n .. c n + n - 1); every rank creates every group, in one order."""
    mesh, mine = Mesh(dp=dp, tp=tp, pp=pp), {}
    for copy in range(copies):
        for dim in ("dp", "tp", "pp"):
            for ranks in mesh.group_ranks(dim):
                ranks = [copy * mesh.world_size + r for r in ranks]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine[dim] = group
    return mine


def call_global_grad_norm(fn, case: dict) -> dict:
    groups = _mesh_groups(case["dp"], case["tp"], case["pp"], case["copies"])
    shard = case["shard"].clone()
    out = fn(shard, list(case["sizes"]), list(case["tp_split"]), groups)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    value = float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None
    return {"norm": value, "type": type(out).__name__, "changed": not torch.equal(shard, case["shard"])}


def _model_norm(inputs: list) -> float:
    """The truth from one model's whole buffers: each (stage, tp rank)'s dp shards joined."""
    c = inputs[0]
    mesh, total = Mesh(dp=c["dp"], tp=c["tp"], pp=c["pp"]), 0.0
    for ranks in mesh.group_ranks("dp"):                       # one buffer per (stage, tp rank)
        buffer = torch.cat([inputs[r]["shard"].double() for r in ranks])   # dp order: the buffer
        tp_rank, bounds = mesh.coords(ranks[0]).tp, torch.tensor(inputs[ranks[0]]["sizes"]).cumsum(0)
        for tensor, split in zip(torch.tensor_split(buffer, bounds.tolist())[:-1], inputs[ranks[0]]["tp_split"]):
            if split or tp_rank == 0:
                total += float(tensor.pow(2).sum())
    return math.sqrt(total)


def expect_global_grad_norm(inputs: list) -> list:
    """Each rank: the norm of its own model (a world may hold copies of the mesh side by side)."""
    n = len(inputs) // inputs[0]["copies"]
    return [_model_norm(inputs[c * n:(c + 1) * n]) for c in range(inputs[0]["copies"]) for _ in range(n)]


def judge_global_grad_norm(inputs, expected, outputs, world_size) -> str:
    c = inputs[0]
    where = f"dp={c['dp']} tp={c['tp']} pp={c['pp']}" + (f", {c['copies']} models" if c["copies"] > 1 else "")
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out["norm"] is None:
            return f"rank {rank} returned a {out['type']}, not a number ({where})"
        if out["changed"]:
            return f"rank {rank} changed its shard (the norm only reads it)"
        if not gradient(world_size).allows(out["norm"] - want, want):
            return (f"rank {rank}: norm {out['norm']:.6g}, the model's is {want:.6g} ({where}; "
                    f"ratio {out['norm'] / want:.4g})")
    return ""


def _model_inputs(generator: torch.Generator, dp: int, tp: int, pp: int, dtype, copies: int) -> list:
    """One model's inputs in rank order: each (stage, tp rank)'s flat buffer cut into dp shards."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    per_rank = [None] * mesh.world_size
    for stage in range(pp):
        # split and replicated alternate, lengths drawn so shards cut through tensors
        split = [bool((k + stage) % 2) for k in range(draw(4, 6))]
        sizes = [draw(3, 17) for _ in split]
        replicated = {k: torch.randn(n, generator=generator, dtype=torch.float64)
                      for k, (n, s) in enumerate(zip(sizes, split)) if not s}
        for t in range(tp):
            parts = [torch.randn(n, generator=generator, dtype=torch.float64) if s else replicated[k]
                     for k, (n, s) in enumerate(zip(sizes, split))]
            shards = torch.cat(parts).to(dtype)
            S = -(-shards.numel() // dp)
            shards = torch.cat([shards, shards.new_zeros(dp * S - shards.numel())]).view(dp, S)
            for d in range(dp):
                per_rank[mesh.rank_of(pp=stage, dp=d, tp=t)] = {
                    "dp": dp, "tp": tp, "pp": pp, "copies": copies, "shard": shards[d].clone(),
                    "sizes": sizes, "tp_split": split}
    return per_rank


def make_zero_norm_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    # (dp, tp, pp, copies): on 8 ranks, two dp 2 x tp 2 models side by side in one world, whose
    # sums must stay inside each model's groups
    meshes = {4: [(2, 2, 1, 1), (2, 1, 2, 1), (4, 1, 1, 1)],
              8: [(2, 2, 2, 1), (4, 2, 1, 1), (2, 2, 1, 2)]}[world_size]
    cases = []
    for i, (dp, tp, pp, copies) in enumerate(meshes):
        dtype = (torch.float32, torch.float64)[i % 2]
        per_rank = [x for _ in range(copies) for x in _model_inputs(generator, dp, tp, pp, dtype, copies)]
        name = f"dp={dp} tp={tp} pp={pp}" + (f" x {copies} models" if copies > 1 else "")
        cases.append(Case(f"{name} {str(dtype).split('.')[-1]}", per_rank))
    return cases


def torch_global_grad_norm(case: dict) -> float:
    return course_global_grad_norm(case["shard"], case["sizes"], case["tp_split"],
                                   _mesh_groups(case["dp"], case["tp"], case["pp"], case["copies"]))


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
GLOBAL_GRAD_NORM = ExerciseSpec(
    id="global_grad_norm", title="The gradient norm over ZeRO-1's shards of a dp x tp x pp model",
    difficulty="★★☆ medium", world_sizes=(4, 8), make_cases=make_zero_norm_cases,
    call=call_global_grad_norm, expect=expect_global_grad_norm, judge=judge_global_grad_norm,
    reference=torch_global_grad_norm,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_reduce"),
    banned=("reference.course.homework.parallel.course_global_grad_norm", "reference.parallel.clip",
            "reference.zero.shard"))
HOMEWORK_ID = "06_3d_parallel"
# The lecture's mesh and counting by hand (mesh_groups, parameters_per_rank), step 6's norm
# over ZeRO-1's shards from the buffer's arithmetic (global_grad_norm, above), a transfer to
# resharding and the written question (parallel_transfer).
from reference.course.homework.parallel_transfer import (  # noqa: E402 - after the specs it extends
    RESHARD_PLAN, STEP_BYTES_3D,
)
# The composed exercise: one step's gradients, loss and norm, against one process.
from reference.course.homework.parallel_step import FINISH_STEP  # noqa: E402
# The clinic's seventh mistake: a recomputation that draws other dropout masks.
from reference.course.homework.parallel_recompute import RECOMPUTE  # noqa: E402
# FSDP inside tensor parallelism: the rows a rank holds.
from reference.course.homework.parallel_fsdp import FSDP_TP_PIECES  # noqa: E402

# An answer wrong in principle fails only the cases that can show it (a norm summed over
# the dp replicas: those with dp > 1; a clip not capped at 1: those where it does not act):
# failing any case keeps at most half of the exercise.
WRONG_KEEPS = 0.5
EXERCISES = (MESH_GROUPS, PARAMETERS_PER_RANK, GLOBAL_GRAD_NORM, RESHARD_PLAN, FINISH_STEP,
             RECOMPUTE, FSDP_TP_PIECES, STEP_BYTES_3D)
