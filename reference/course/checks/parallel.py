"""Visible self-checks of homework 06 (the 3D mesh): feedback while you work, never the grade.

    check_mesh_groups(mesh_groups)                   # one PASS or FAIL line, with a hint
    check_parameters_per_rank(parameters_per_rank)
    check_global_grad_norm(global_grad_norm)         # over ZeRO-1 shards, on 4 ranks
    check_reshard_plan(reshard_plan)
    check_finish_step(finish_step)                   # on 4 ranks, against one process
    check_recompute(recompute)                       # one process, against fn called directly
    check_step_bytes_3d(step_bytes_3d)               # the text's worked values

The pure functions (mesh_groups, parameters_per_rank, reshard_plan) run on one rank,
global_grad_norm on 4 ranks (dp 2 with tp, dp 2 with pp, dp 4), each on the same kinds of
cases as the hidden checks
drawn from a public seed, compared with the course's mesh, the parameters that
`parallelize` really leaves on each rank, the true norm and the true row ranges; recompute
runs in one process against the same functions called directly from the same seed.
"""
from __future__ import annotations

from reference.course.checks.runner import NOT_IMPLEMENTED, public_cases, run_cases, run_visible
from reference.course.homework.refuse import refusal_for
from reference.course.homework.parallel import GLOBAL_GRAD_NORM, MESH_GROUPS, PARAMETERS_PER_RANK
from reference.course.homework.parallel_transfer import RESHARD_PLAN, STEP_BYTES_3D
from reference.course.homework.parallel_recompute import RECOMPUTE
from reference.course.homework.parallel_step import FINISH_STEP
from reference.course.homework.parallel_fsdp import FSDP_TP_PIECES

__all__ = ["check_mesh_groups", "check_parameters_per_rank", "check_global_grad_norm",
           "check_reshard_plan", "check_finish_step", "check_fsdp_tp_pieces", "check_recompute", "check_step_bytes_3d"]

# Hints name the symptom and the part of a lecture to reread; they never give the answer.
_LAYOUT = "notebook 06, 'Step 1 · The mesh and its groups'"
_MEMORY = "notebook 06, 'Memory per rank, measured against the calculator'"
_CLINIC = "notebook 06, 'The composition clinic: seven mistakes, seven symptoms'"
_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "the text's worked example": ("your bytes differ from the worked example's: count each dimension "
                                  "alone (tp per layer and micro-batch, pp per micro-batch and neighbour, "
                                  "dp once, in ceil(m / dp) chunks) and reread notebook 00's ring formulas"),
    "whole number": "the answer is a count of bytes: keep it an int (// and ceil, not /)",
    "not a dict": "return a dict from each dimension's name ('tp', 'dp', ...) to its groups",
    "tp groups": f"the tp groups differ from the mesh's: which coordinate varies fastest? Reread {_LAYOUT}",
    "dp groups": f"the dp groups differ from the mesh's: how far apart are two dp neighbours? Reread {_LAYOUT}",
    "pp groups": f"the pp groups differ from the mesh's: how far apart are two stages? Reread {_LAYOUT}",
    "ep groups": ("the ep groups differ from the mesh's: ep is carved out of an existing "
                  "dimension; which one, and how are its ranks numbered? Reread the exercise's "
                  "text on ep and " + _LAYOUT),
    "edp groups": ("the edp groups differ from the mesh's: which ranks hold the same experts? "
                   "Reread the exercise's text on ep"),
    "not a list of ints": "return one int per rank, in rank order",
    "holds": ("a rank's count differs from what parallelize leaves on it: compare, for a small "
              f"model, with the counts of {_MEMORY}; ask of each tensor whether tp splits it, "
              "and which stage holds it"),
    "not allowed": "a collective other than dist.all_reduce was called: a norm needs only sums",
    "pieces of tp rank": ("that rank's rows differ: cut the whole weight as tensor parallelism does "
                          "first (each block of the out dimension split over tp), then the "
                          "rank's TP-local rows as FSDP does (padded to dp equal parts); write "
                          "both cuts for the case the message names. Reread notebook 06, "
                          "appendix 'A.1 FSDP inside tensor parallelism'"),
    "new rank": ("rows are missing or repeated for that new rank: write each old and new rank's "
                 "rows as a range and compare them, for the case the message names"),
}


# global_grad_norm's own: the norm over ZeRO-1's shards, off by the ratio its message gives.
_ZERO1 = "notebook 06, 'Step 6 · ZeRO-1 over dp, with clipping, and fp16 with loss scaling'"
_NORM_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "not allowed": "a collective other than dist.all_reduce was called: a norm needs only sums",
    "changed its shard": "the norm only reads the shard: an in-place operation changed it",
    "not a number": "return the norm as a float or a 0-d tensor",
    "ratio 1.": ("too large by that ratio: some numbers are counted more than once. Which tensors "
                 "are the same numbers on several ranks, and which of your shard's numbers belong "
                 f"to them? Write the buffer of a small case on paper. Reread {_ZERO1}"),
    "ratio 0.": ("too small by that ratio: some numbers never reach the sum. After the "
                 "reduce-scatter, do two dp ranks hold the same numbers? And which ranks hold "
                 f"the other stages? Reread {_ZERO1}"),
}

# finish_step's own: its messages say "loss", "norm" and "differs", with the ratio.
_STEP_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "the text's worked example": ("your bytes differ from the worked example's: count each dimension "
                                  "alone (tp per layer and micro-batch, pp per micro-batch and neighbour, "
                                  "dp once, in ceil(m / dp) chunks) and reread notebook 00's ring formulas"),
    "whole number": "the answer is a count of bytes: keep it an int (// and ceil, not /)",
    "not allowed": "a collective other than dist.all_reduce and dist.broadcast was called",
    "(partial) differs": ("a gradient marked partial differs from one process's by the ratio shown: "
                          "one process's gradient covers every token of the sequence; what does "
                          f"this rank's cover? Reread {_CLINIC}"),
    "tied) differs": ("a copy of the tied embedding differs from one process's: in one process "
                      "the embedding and the head are one tensor; what does its gradient hold "
                      "there? Reread notebook 06, Step 3"),
    "differs from one process": ("a gradient differs from one process's by the ratio shown: "
                                 "compare the ratio with 1 / dp and dp: how many replicas' "
                                 "gradients are in it, and how many times were they averaged?"),
    "loss": ("the loss differs from one process's by the ratio shown: which ranks hold a loss, "
             f"and what do the others add to a sum or a mean? Reread {_CLINIC}"),
    "returned a norm": "with dp_reduce False the norm is not yours to compute: return None",
    "norm is right, but": ("the norm is right but the clipped gradients are not: the clip "
                           "multiplies by torch's min(1, max_norm / (norm + 1e-6)), once"),
    "was replaced": "the optimizer holds these tensors: change each one in place",
    "norm ": (f"the norm differs by the ratio shown: above 1, some numbers are counted more "
              f"than once; below 1, some never reach the sum. Which tensors hold the same "
              f"numbers on several ranks? Reread {_CLINIC}"),
}

# recompute's own: symptoms of a recomputation that is not the forward, or not one at all.
_CHECKPOINTING = "notebook 04, 'Activation checkpointing'"
_RECOMPUTE_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "the text's worked example": ("your bytes differ from the worked example's: count each dimension "
                                  "alone (tp per layer and micro-batch, pp per micro-batch and neighbour, "
                                  "dp once, in ceil(m / dp) chunks) and reread notebook 00's ring formulas"),
    "whole number": "the answer is a count of bytes: keep it an int (// and ceil, not /)",
    "not allowed": "one process, no collective: nothing here needs torch.distributed",
    "not a tensor": "return what fn returns: one tensor",
    "shape": "return what fn returns: a tensor of fn's output shape",
    "does not require grad": ("the output is cut off from autograd: backward can never reach x "
                              f"or fn's weights through it. Reread {_CHECKPOINTING}"),
    "run directly with the same seed": (
        "the output differs from a direct run from the same seed: what did your forward draw, "
        "or change in the generator, before or after fn drew its masks? In a row, each block "
        "draws where the one before left the generator"),
    "bytes of tensors for backward": ("your forward keeps fn's intermediate activations (autograd "
                                      "saved them while fn ran): what is the least backward needs "
                                      f"to compute them again? Reread {_CHECKPOINTING}"),
    "during backward": "backward runs fn a number of times other than once: the recomputation is one run",
    "no gradient": ("after backward, x or a weight of fn has no gradient: from which tensor does "
                    "the recomputation's graph start, and where do its gradients go?"),
    "(no dropout)": ("the gradients differ even without dropout: compare what your backward "
                     "backpropagates with the gradient it receives, and what it returns for x"),
    "caller's random draws after the forward": (
        "after your forward the generator does not stand where one direct call of fn leaves it: "
        "the caller's next masks (the next block's dropout) are drawn from there"),
    "caller's random draws after the backward": (
        "your backward moved the caller's generator: after it the caller's next draws must be "
        "those of a run without checkpointing, whatever the recomputation drew"),
    "differs from a run without checkpointing": (
        "the gradients are right without dropout (that case passed) but differ with it: which "
        "elements does the recomputation drop, compared with the forward? Reread "
        "notebook 06, 'The seventh mistake needs dropout'"),
}


def _check(spec, fn, success: str, skip: bool) -> None:
    run_visible(spec, fn, lambda: run_cases(spec, fn, 1, public_cases(spec, 1), timeout=60.0),
                success, _HINTS, skip)


def _check_on(spec, fn, world_sizes, success: str, skip: bool, hints=_HINTS) -> None:
    def attempt():
        for ws in world_sizes:
            reason = run_cases(spec, fn, ws, public_cases(spec, ws), timeout=60.0)
            if reason[0]:
                return reason
        return ""
    run_visible(spec, fn, attempt, success, hints, skip)


def check_mesh_groups(fn, skip: bool = False) -> None:
    """Visible check of exercise mesh_groups (compares with reference.mesh.Mesh)."""
    names = ", ".join(c.name for c in public_cases(MESH_GROUPS, 1))
    _check(MESH_GROUPS, fn, f"every group of {names} equals the course's mesh", skip)


def check_parameters_per_rank(fn, skip: bool = False) -> None:
    """Visible check of exercise parameters_per_rank (compares with what parallelize leaves)."""
    _check(PARAMETERS_PER_RANK, fn, "every rank's count equals what parallelize leaves on it", skip)


def check_global_grad_norm(fn, skip: bool = False) -> None:
    """Visible check of exercise global_grad_norm on 4 ranks (dp 2 x tp 2, dp 2 x pp 2, dp 4),
    against the model's norm from the whole buffers."""
    _check_on(GLOBAL_GRAD_NORM, fn, (4,),
              "every rank returns the model's norm from its shard, each number counted once", skip,
              _NORM_HINTS)


def check_reshard_plan(fn, skip: bool = False) -> None:
    """Visible check of exercise reshard_plan (against the true row ranges)."""
    _check(RESHARD_PLAN, fn, "every new rank's pieces rebuild exactly its new shard", skip)


def check_finish_step(fn, skip: bool = False) -> None:
    """Visible check of exercise finish_step on 4 ranks (dp x tp with SP, tp x pp and dp x pp
    tied, the optimizer averaging dp, a clip that does not act), against one process."""
    _check_on(FINISH_STEP, fn, (4,),
              "every rank's gradients, loss and norm equal one process's", skip, _STEP_HINTS)


def check_recompute(fn, skip: bool = False) -> None:
    """Visible check of exercise recompute in one process (a GPT block without dropout, a block
    and an MLP with dropout, two blocks in a row, the caller's draws), against fn called
    directly from the same seed."""
    _check_on(RECOMPUTE, fn, (1,), "the output, the gradients and the caller's random draws equal "
              "a run without checkpointing, and the forward keeps only the input", skip,
              _RECOMPUTE_HINTS)


def check_fsdp_tp_pieces(fn, skip: bool = False) -> None:
    """Visible check of exercise fsdp_tp_pieces (against the cuts parallelize makes)."""
    _check(FSDP_TP_PIECES, fn, "every rank's rows equal those its shard holds", skip)


# The text's worked values (the method check it publishes): the last and the middle stage
_WORKED_3D = dict(n_params=1200, n_layer=6, b=1, s=4, h=6, microbatches=5, dp=7, tp=2, pp=3,
                  bytes_per_element=4)
WORKED_STEP_BYTES_3D = ((dict(_WORKED_3D, pp_rank=2), 5712), (dict(_WORKED_3D, pp_rank=1), 6192))


def check_step_bytes_3d(fn, skip: bool = False) -> bool | None:
    """Visible check of the written question step_bytes_3d: the worked values its text gives
    (5,712 bytes on the last stage, 6,192 on the middle one); other values are the grader's."""
    def attempt() -> str:
        for example, want in WORKED_STEP_BYTES_3D:
            out = refusal_for(STEP_BYTES_3D).run(STEP_BYTES_3D.call, fn, dict(example))
            if out["type"] != "int":
                return f"returned {out['value']!r} for the text's worked example; the answer is a whole number (an int)"
            if out["value"] != want:
                return (f"the text's worked example, stage {example['pp_rank']} of pp {example['pp']}: "
                        f"{out['value']:,} bytes, the text gives {want:,}")
        return ""

    return run_visible(STEP_BYTES_3D, fn, attempt, "gives the text's worked values, 5,712 and 6,192 bytes "
                "(the hidden checks grade other values)", _HINTS, skip)
