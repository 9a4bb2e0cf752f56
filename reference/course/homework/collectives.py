"""Hidden checks of homework 00: ring all-reduce and ring all-gather from send/recv.

(The tree and recursive-doubling all-reduces and the written question, the homework's
transfer exercises, are checked as `collectives_transfer` says; their specs are built here.)

The cases every world size gets (2, 3 and 4 ranks): random float32 tensors of
shapes (1,), (5,), (7,) and (3, 5), and integer (int64) tensors of shapes (4,) and
(2, 3). Most element counts do not divide by the world size, and (1,) leaves
some ranks an empty chunk. Integer sums must be exact. Float sums are compared with
the float64 sum within `float_tolerance(world_size)`: the course's bound for a
sum over p ranks added in another order (`reference.tolerance.gradient(p)`, its
reasoning in reference/tolerance.py), for values of order sqrt(p) rather than 1
(`at_scale(sqrt(p))`): the ranks' values are randn, so the partial sums the ring adds,
and each rounding of them, are of that order. The float64 cases (`collectives_transfer`)
are held to the same float32 bound: they check that the algorithm keeps the tensor's
dtype, not float64's last bits.

Beyond the values, each case checks the ring itself from the recorded messages:
every rank sends only to (rank + 1) % p, receives only from (rank - 1) % p, and
sends no more elements than the algorithm needs.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.course.homework.scoring import WARM_UP, Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.tolerance import Tolerance, gradient

__all__ = ["ALL_REDUCE", "ALL_GATHER", "TREE", "DOUBLING", "CROSSOVER", "EXERCISES", "make_cases",
           "judge_sum", "course_ring_all_gather", "float_tolerance"]
FLOAT_SHAPES = ((1,), (5,), (7,), (3, 5))
INT_SHAPES = ((4,), (2, 3))


def float_tolerance(world_size: int) -> Tolerance:
    """How close a float sum over `world_size` ranks must be to the float64 sum: the terms
    are randn, so partial sums (and their roundings) are of order sqrt(world_size)."""
    return gradient(world_size).at_scale(math.sqrt(world_size))


def make_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    cases = []
    for shape in FLOAT_SHAPES:
        cases.append(Case(f"float32 {shape}", [torch.randn(shape, generator=generator)
                                               for _ in range(world_size)]))
    for shape in INT_SHAPES:
        cases.append(Case(f"int64 {shape}", [torch.randint(-1000, 1000, shape, generator=generator)
                                             for _ in range(world_size)]))
    return cases


def _plain(value):
    """A tensor the rank may send back (a plain copy), or None for anything else."""
    return value.detach().clone() if type(value) is torch.Tensor else None


# ------------------------------------------------------------------ calls (inside a rank)

def call_all_reduce(fn, tensor: torch.Tensor) -> dict:
    out = fn(tensor)
    return {"tensor": tensor.detach().clone(), "returned": _plain(out),
            "returned_type": type(out).__name__, "same": out is tensor}


def call_all_gather(fn, tensor: torch.Tensor) -> dict:
    before = tensor.clone()
    out = fn(tensor)
    return {"returned": _plain(out), "returned_type": type(out).__name__,
            "input_changed": not torch.equal(before, tensor)}


# ------------------------------------------------------------------ judges (in the grader)

def ring_pattern(outputs: list, world_size: int, limit: int) -> str:
    """"" when every rank sent only to its next rank, received only from its previous
    one and sent at most `limit` elements; otherwise why not."""
    if world_size > 1 and not any(o["sends"] for o in outputs):
        return "no message went through torch.distributed send/isend"
    for rank, out in enumerate(outputs):
        nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
        for peer, _ in out["sends"]:
            if peer != nxt:
                return (f"not a ring: rank {rank} sent to rank {peer} (a ring sends only to "
                        f"the next rank, {nxt})")
        for peer, _ in out["recvs"]:
            if peer != prev:
                source = "any rank" if peer == -1 else f"rank {peer}"
                return (f"not a ring: rank {rank} received from {source} (a ring receives only "
                        f"from the previous rank, {prev})")
        sent = sum(n for _, n in out["sends"])
        if sent > limit:
            return f"rank {rank} sent {sent} elements; the ring needs at most {limit}"
    return ""


def _mismatch(got: torch.Tensor, want: torch.Tensor, world_size: int) -> str:
    if got.dtype.is_floating_point:
        if float_tolerance(world_size).close(got, want):
            return ""
        return f"max abs error {(got.double() - want.double()).abs().max().item():.3g}"
    return "" if torch.equal(got, want) else (
        f"{int((got != want).sum())} of {want.numel()} elements differ")


def expect_all_reduce(inputs: list) -> list:
    # Exact for integers; float64 accumulation for floats (the truth, not another rounding).
    total = torch.stack([t.double() for t in inputs]).sum(0).to(inputs[0].dtype)
    return [total] * len(inputs)


def torch_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """torch.distributed's own answer (inside a rank, before the rules are set)."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def judge_sum(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    """The value checks of every all-reduce exercise: in place, returned, the right sum."""
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        got = out["tensor"]
        if out["returned"] is None:
            return (f"rank {rank} returned {out['returned_type']}, not the tensor "
                    f"(the all-reduce works in place and returns its argument)")
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"rank {rank}: the tensor became {got.dtype} {tuple(got.shape)}"
        if torch.equal(got, inputs[rank]) and world_size > 1:
            return f"rank {rank}: the input tensor was not changed (the sum must be written in place)"
        if error := _mismatch(got, want, world_size):
            return f"rank {rank}: wrong sum ({error})"
        if not out["same"]:
            return (f"rank {rank} returned a tensor other than its argument (the all-reduce "
                    f"returns `tensor` itself, the sum written into it)")
    return ""


def judge_all_reduce(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    if error := judge_sum(inputs, expected, outputs, world_size):
        return error
    n = inputs[0].numel()
    # Reduce-scatter then all-gather: each rank sends p - 1 chunks twice.
    return ring_pattern(outputs, world_size, 2 * (world_size - 1) * math.ceil(n / world_size))


def expect_all_gather(inputs: list) -> list:
    return [torch.cat(inputs, dim=0)] * len(inputs)


def torch_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """torch.distributed's own answer (inside a rank, before the rules are set)."""
    out = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_into_tensor(out, tensor)
    return out


def course_ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The course's answer, with the exercise's signature: reference.comms's ring all-gather."""
    from reference.comms.ring import ring_all_gather
    flat = ring_all_gather(tensor.reshape(-1), group=group)
    return flat.view(dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:])


def judge_all_gather(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        got = out["returned"]
        if got is None:
            return f"rank {rank} returned {out['returned_type']}, not a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return (f"rank {rank} returned {got.dtype} {tuple(got.shape)}; expected {want.dtype} "
                    f"{tuple(want.shape)} (the ranks' tensors concatenated along dim 0)")
        if not torch.equal(got, want):
            blocks = [r for r, (g, w) in enumerate(zip(got.chunk(world_size),
                                                       want.chunk(world_size)))
                      if not torch.equal(g, w)]
            return (f"rank {rank}: wrong values in the block(s) of rank(s) {blocks} "
                    f"(block r must be rank r's tensor)")
        if out["input_changed"]:
            return f"rank {rank} changed its input tensor (all-gather must leave it as it was)"
    # Each rank forwards p - 1 tensors around the ring.
    return ring_pattern(outputs, world_size, (world_size - 1) * inputs[0].numel())


# On 4 ranks, two cases more on the subgroup of ranks 1, 2, 3: float32 (7,) and int64 (2, 3).
SUBGROUP_PICK = (2, 5)
ALL_REDUCE = on_subgroup(ExerciseSpec(
    id="ring_all_reduce", title="ring all-reduce from send/recv", difficulty="★☆☆ warm-up",
    weight=WARM_UP,
    world_sizes=(2, 3, 4), make_cases=make_cases, call=call_all_reduce,
    expect=expect_all_reduce, judge=judge_all_reduce, reference=torch_all_reduce,
    banned=("reference.comms.ring.ring_all_reduce", "reference.comms")), (4,), SUBGROUP_PICK)
ALL_GATHER = on_subgroup(ExerciseSpec(
    id="ring_all_gather", title="ring all-gather from send/recv", difficulty="★☆☆ easy",
    world_sizes=(2, 3, 4), make_cases=make_cases, call=call_all_gather,
    expect=expect_all_gather, judge=judge_all_gather, reference=torch_all_gather,
    banned=("reference.course.homework.collectives.course_ring_all_gather", "reference.comms")),
    (4,), SUBGROUP_PICK)

# The transfers (collectives_transfer): the same contract as ring_all_reduce, other algorithms.
from reference.course.homework.collectives_transfer import (  # noqa: E402 - after what it extends
    CROSSOVER, algorithm_judge, doubling_messages, make_extra_cases, tree_messages,
)

# On 6 ranks, two cases more on the subgroup of ranks 1 .. 5 (a tree of 5; doubling on a core
# of 4 and one extra rank): float32 (7,) and int64 (2, 3).
TREE = on_subgroup(ExerciseSpec(
    id="tree_all_reduce", title="binomial-tree all-reduce from send/recv", difficulty="★★☆ medium",
    world_sizes=(4, 6), make_cases=make_extra_cases, call=call_all_reduce,
    expect=expect_all_reduce, judge=algorithm_judge(tree_messages, "the binomial tree", judge_sum),
    reference=torch_all_reduce,
    banned=("reference.comms.algorithms.tree_all_reduce", "reference.comms")), (6,), (1, 4))
DOUBLING = on_subgroup(ExerciseSpec(
    id="recursive_doubling_all_reduce", title="recursive-doubling all-reduce on any number of ranks",
    difficulty="★★★ hard", world_sizes=(3, 6), make_cases=make_extra_cases,
    call=call_all_reduce, expect=expect_all_reduce,
    judge=algorithm_judge(doubling_messages, "recursive doubling", judge_sum),
    reference=torch_all_reduce,
    banned=("reference.course.homework.collectives_transfer.course_recursive_doubling_all_reduce",
            "reference.comms")), (6,), (1, 4))
HOMEWORK_ID = "00_collectives"
# The warm-up (all-gather), the ring the lecture built, two algorithms it did not (a tree;
# recursive doubling with the extra ranks folded in) and the written question.
# An answer failing any case keeps at most half: a rule broken alone shows only in the
# cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (ALL_REDUCE, ALL_GATHER, TREE, DOUBLING, CROSSOVER)
