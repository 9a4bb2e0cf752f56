"""Hidden checks of homework 00's transfer exercises and its written question.

* ``tree_all_reduce(tensor, group=None)``: all-reduce (sum, in place) by a binomial tree
  rooted at rank 0: each rank's parent is its rank with the lowest set bit cleared, its
  children are rank + 2^k for every 2^k below its lowest set bit (every 2^k for rank 0)
  that is a rank; the partial sums go up the tree, the total comes back down the same
  edges.
* ``recursive_doubling_all_reduce(tensor, group=None)``: all-reduce by whole-tensor swaps
  with the partner rank ^ d, d = 1, 2, 4, ... among the first p' ranks (p' the largest
  power of two not above p); the p - p' extra ranks first fold their tensor into rank
  (r - p') and get the sum back from it at the end.

The tree is checked on 4 and 6 ranks (a full tree, and one whose leaves sit at several
depths: on 3 ranks it would be a star), recursive doubling on 3 and 6 ranks (one and two
extra ranks around a core of 2 and 4), each on float32 tensors of shapes (1,), (7,) and
(3, 5), float64 (6,) and int64 (2, 3): two launches each, to keep grading quick. The
sum must agree with the float64 sum within ``collectives.float_tolerance`` (the
algorithm adds in its own order: the course's bound for a sum over p ranks, float32's
for the float64 case too; integers exactly), every rank must hold the same bits (both
algorithms end with the same numbers everywhere: a tree broadcasts its root's sum; a
swap adds the same two numbers on both sides, and float addition is commutative), and
the recorded messages
must be the algorithm's: the exact set of (peer, element count) sent and received by
every rank, each message the whole tensor.

* ``ring_doubling_crossover(world_size, alpha, beta)``: the written question, graded to
  `questions.QUESTION_RTOL` relative (a float64's last bits): the message size in bytes
  at which the ring all-reduce and recursive doubling take the same time in the
  alpha-beta model (world_size a power of two >= 4).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.course.homework.questions import question
from reference.course.homework.scoring import Case

__all__ = ["CROSSOVER", "course_recursive_doubling_all_reduce", "tree_messages",
           "doubling_messages", "algorithm_judge", "crossover_formula", "make_extra_cases"]


# ------------------------------------------------------------------ cases

def make_extra_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    """Three float32 shapes, one float64, one int64: each rank its own values."""
    cases = []
    for dtype, shape in ((torch.float32, (1,)), (torch.float32, (7,)), (torch.float32, (3, 5)),
                         (torch.float64, (6,))):
        cases.append(Case(f"{str(dtype).split('.')[-1]} {shape}",
                          [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
                           for _ in range(world_size)]))
    cases.append(Case("int64 (2, 3)", [torch.randint(-1000, 1000, (2, 3), generator=generator)
                                       for _ in range(world_size)]))
    return cases


# ------------------------------------------------------------------ the algorithms' messages

def tree_messages(rank: int, world_size: int, numel: int) -> tuple[list, list]:
    """(sends, recvs) of `rank` in the binomial tree: [peer, numel] pairs, sorted."""
    lowest = rank & -rank if rank else 1 << max(world_size - 1, 1).bit_length()
    children = [rank + (1 << k) for k in range(lowest.bit_length() - 1)
                if rank + (1 << k) < world_size]
    links = children + ([rank - (rank & -rank)] if rank else [])
    pairs = sorted([peer, numel] for peer in links)
    return pairs, list(pairs)


def doubling_messages(rank: int, world_size: int, numel: int) -> tuple[list, list]:
    """(sends, recvs) of `rank` in recursive doubling with the extra ranks folded in."""
    core = 1 << (world_size.bit_length() - 1)  # the largest power of two <= world_size
    if rank >= core:
        links = [rank - core]
    else:
        links = [rank ^ d for d in (1 << k for k in range(core.bit_length() - 1))]
        links += [rank + core] if rank + core < world_size else []
    pairs = sorted([peer, numel] for peer in links)
    return pairs, list(pairs)


def course_recursive_doubling_all_reduce(tensor, group=None):
    """The course's answer (the student's signature): fold, swap-and-add, unfold."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    core = 1 << (p.bit_length() - 1)
    flat = tensor.view(-1)
    incoming = torch.empty_like(flat)

    def swap(peer):  # whole tensors both ways, then add: both sides hold the same bits
        request = dist.isend(flat, group=group, group_dst=peer)
        dist.recv(incoming, group=group, group_src=peer)
        request.wait()
        flat.add_(incoming)

    if rank >= core:  # an extra rank: hand the tensor in, take the sum back
        dist.send(flat, group=group, group_dst=rank - core)
        dist.recv(flat, group=group, group_src=rank - core)
        return tensor
    if rank + core < p:
        dist.recv(incoming, group=group, group_src=rank + core)
        flat.add_(incoming)
    d = 1
    while d < core:
        swap(rank ^ d)
        d *= 2
    if rank + core < p:
        dist.send(flat, group=group, group_dst=rank + core)
    return tensor


# ------------------------------------------------------------------ judges

def _judge_messages(outputs: list, world_size: int, numel: int, messages, name: str) -> str:
    if world_size > 1 and not any(o["sends"] for o in outputs):
        return "no message went through torch.distributed send/isend"
    for rank, out in enumerate(outputs):
        want_sends, want_recvs = messages(rank, world_size, numel)
        for kind, got, want in (("sent", out["sends"], want_sends),
                                ("received", out["recvs"], want_recvs)):
            got = sorted([int(peer), int(n)] for peer, n in got)
            if got == want:
                continue
            if any(n != numel for _, n in got):
                return (f"rank {rank} {kind} a message of {next(n for _, n in got if n != numel)} "
                        f"elements; every message of {name} is the whole tensor ({numel})")
            peers = ["any rank" if p == -1 else p for p, _ in got]
            return (f"not {name}: rank {rank} {kind} {len(got)} message(s), peers {peers}; "
                    f"expected peers {[p for p, _ in want]}")
    return ""


def algorithm_judge(messages, name: str, judge_sum):
    """The judge of an all-reduce by `name`: `judge_sum`'s value checks (homework 00's),
    the same bits on every rank, then exactly the `messages` of the algorithm."""
    def judge(inputs: list, expected: list, outputs: list, world_size: int) -> str:
        if error := judge_sum(inputs, expected, outputs, world_size):
            return error
        first = outputs[0]["tensor"]
        for rank, out in enumerate(outputs[1:], start=1):
            if not torch.equal(out["tensor"], first):
                return (f"ranks 0 and {rank} hold different bits of the sum (in {name} every "
                        f"rank ends with the same numbers)")
        return _judge_messages(outputs, world_size, inputs[0].numel(), messages, name)
    return judge


# ------------------------------------------------------------------ the written question

def crossover_formula(world_size: int, alpha: float, beta: float) -> float:
    """n where 2(p-1) a + 2 (p-1)/p n b (ring) = log2(p) (a + n b) (recursive doubling)."""
    p, steps = world_size, math.log2(world_size)
    return alpha * (2 * (p - 1) - steps) / (beta * (steps - 2 * (p - 1) / p))


CROSSOVER = question(
    "ring_doubling_crossover", "The message size where the ring starts to beat recursive doubling",
    crossover_formula,
    {"world_size": (4, 8, 16, 64, 512, 4096), "alpha": (1e-6, 5e-6, 2e-5, 1e-4),
     "beta": (1 / 12.5e9, 1 / 50e9, 1 / 200e9, 1 / 450e9)},
    kind="real", fixed=({"world_size": 4, "alpha": 1e-5, "beta": 1e-9},),
    banned=("reference.course.homework.collectives_transfer.crossover_formula", "reference.comms.cost",
            "reference.comms.algorithms"), difficulty="★★☆ medium")
