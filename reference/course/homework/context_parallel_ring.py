"""Hidden checks of homework 08's ring: causal ring attention on the zig-zag layout.

``causal_ring_attention(q, k, v, group)`` on 2, 3 and 4 ranks, every collective
switched off: q, k, v (B, H, T/cp, D) are this rank's zig-zag part of the sequence
(chunks r and 2 cp - 1 - r of 2 cp), and the result, (B, H, T/cp, D) in q's dtype, must
be this rank's rows of the causal attention over the whole sequence (compared with the
float64 attention computed here, within `reference.tolerance.forward(dtype)`: the
blocks' scores and weights are the same sums as one softmax over every key, added in
another order, of values of order 1; reference/tolerance.py gives the reasoning). Three
rules besides the values:

* the messages form a ring: a rank sends only to the next rank of the group, receives
  only from the previous one (peers are global ranks: on a subgroup, `(i + 1) % cp` is
  the wrong rank), and sends at most 2 (cp - 1) B H (T/cp) D elements in all, the keys
  and values of cp - 1 blocks (`ring_pattern_of`);
* no tensor the function creates (views aside) holds more than one (T/cp, T/cp) score
  block per batch row and head, or four (B, H, T/cp, D) key/value blocks, whichever is
  larger: the (T/cp, T) scores of every key, or every rank's keys and values gathered,
  are what ring attention exists to avoid (`LargestCreated`, a dispatch mode that sees
  every tensor an operation returns);
* q, k and v are left as they were.

Cases per world size: float32 with T/cp = 8 and D = 2 (scores of all keys would be
caught), float64, and chunks of a single token with D = 6; on 3 and 4 ranks also a ring
on the subgroup of ranks 1 .. world - 1 (rank 0 stays out), where group ranks and global
ranks differ.

This module also holds what homework 08's other checks share: `close` and the zig-zag
positions.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from reference.context_parallel.ring import ring_attention
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import Tolerance, forward

__all__ = ["CAUSAL_RING_ATTENTION", "LargestCreated", "course_causal_ring_attention",
           "zigzag_positions", "plain", "close", "make_ring_cases", "score_limit",
           "ring_pattern_of"]


def plain(value):
    """A tensor a rank may send back (a plain copy), or None for anything else."""
    return value.detach().clone() if type(value) is torch.Tensor else None


def close(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> str:
    """"" when `got` equals `want` within `tol` (a NaN never does; where `want` is infinite,
    a merged row no block met, `got` must be the same infinity), else the largest error."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if torch.equal(got[~finite], want[~finite]) and tol.close(got[finite], want[finite]):
        return ""
    if torch.isnan(got).any():
        return "NaN in the result"
    return f"max abs error {(got.double() - want.double()).abs().nan_to_num(math.inf).max().item():.3g}"


def zigzag_positions(T: int, cp: int, rank: int) -> torch.Tensor:
    """(T/cp,) positions rank `rank` holds: chunks rank and 2 cp - 1 - rank of 2 cp, in order."""
    if T % (2 * cp):
        raise ValueError(f"the zig-zag layout cuts T={T} into 2*cp={2 * cp} chunks: "
                         f"T % {2 * cp} = {T % (2 * cp)}")
    c = T // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


class LargestCreated(TorchDispatchMode):
    """While open: the largest non-view tensor any operation returns (`elements`, `shape`)."""

    def __init__(self):
        super().__init__()
        self.elements, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs if kwargs else {}))
        made = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and not t._is_view()]
        for t in made:
            self.elements, self.shape = max((self.elements, self.shape), (t.numel(), tuple(t.shape)))
        return result


def ring_pattern_of(outputs: list, members: list, limit: int) -> str:
    """"" when every member of the ring `members` (global ranks, in group order) sent only to
    the next member, received only from the previous one and sent at most `limit` elements."""
    if len(members) > 1 and not any(outputs[g]["sends"] for g in members):
        return "no message went through torch.distributed send/isend"
    for i, g in enumerate(members):
        nxt, prev = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
        for peer, _ in outputs[g]["sends"]:
            if peer != nxt:
                return (f"not a ring: global rank {g} (group rank {i} of {members}) sent to global "
                        f"rank {peer}; the next rank of the group is global rank {nxt} "
                        f"(peers are global ranks: dist.get_global_rank(group, (i + 1) % cp))")
        for peer, _ in outputs[g]["recvs"]:
            if peer != prev:
                source = "any rank" if peer == -1 else f"global rank {peer}"
                return (f"not a ring: global rank {g} (group rank {i} of {members}) received from "
                        f"{source}; the previous rank of the group is global rank {prev}")
        sent = sum(n for _, n in outputs[g]["sends"])
        if sent > limit:
            return f"rank {g} sent {sent} elements; the ring needs at most {limit}"
    return ""


def score_limit(B: int, H: int, n: int, D: int) -> int:
    """The most elements one tensor of ring attention may hold: a score block or 4 KV blocks."""
    return B * H * max(n * n, 4 * n * D)


def course_causal_ring_attention(q, k, v, group):
    """The course's answer, with the exercise's signature."""
    return ring_attention(q, k, v, group, causal=True, zigzag=True)


# (name, B, H, c tokens a chunk, D, dtype): T = 2 c cp, T/cp = 2 c
RING_SHAPES = (
    ("float32 B=1 H=2 T/cp=8 D=2", 1, 2, 4, 2, torch.float32),
    ("float64 B=2 H=3 T/cp=4 D=4", 2, 3, 2, 4, torch.float64),
    ("float32 B=1 H=1 T/cp=2 D=6 (chunks of one token)", 1, 1, 1, 6, torch.float32),
)


# On 3 and 4 ranks: the ring of ranks 1 .. world - 1 (group rank i is global rank i + 1)
SUBGROUP_SHAPE = ("float32 B=1 H=2 T/cp=4 D=3", 1, 2, 2, 3, torch.float32)


def make_ring_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    rings = [(shape, list(range(world_size))) for shape in RING_SHAPES]
    if world_size >= 3:
        rings.append((SUBGROUP_SHAPE, list(range(1, world_size))))
    cases = []
    for (name, B, H, c, D, dtype), members in rings:
        cp = len(members)
        T = 2 * c * cp
        full = [torch.randn(B, H, T, D, generator=generator, dtype=torch.float64).to(dtype)
                for _ in range(3)]
        parts = [{"members": members} for _ in range(world_size)]
        for i, g in enumerate(members):
            pos = zigzag_positions(T, cp, i)
            parts[g].update({n: t.index_select(2, pos) for n, t in zip("qkv", full)})
        if cp < world_size:
            name += f" on the subgroup of global ranks {members} (cp = {cp})"
        cases.append(Case(name, parts))
    return cases


def call_ring(fn, case: dict) -> dict:
    members = case["members"]
    # every rank creates the group, members or not, in the same order
    group = dist.group.WORLD if len(members) == dist.get_world_size() else dist.new_group(members)
    if "q" not in case:
        return {"member": False}
    q, k, v = (case[n].clone() for n in "qkv")
    largest = LargestCreated()
    with largest:
        out = fn(q, k, v, group)
    changed = any(not torch.equal(t, case[n]) for t, n in zip((q, k, v), "qkv"))
    return {"out": plain(out), "type": type(out).__name__, "changed": changed,
            "largest": int(largest.elements), "largest_shape": list(largest.shape)}


def expect_ring(inputs: list) -> list:
    members = inputs[0]["members"]
    ring = expect_members([inputs[g] for g in members])
    expected = [None] * len(inputs)
    for g, want in zip(members, ring):
        expected[g] = want
    return expected


def expect_members(inputs: list) -> list:
    """Each member's rows of causal attention over the whole sequence its parts make."""
    cp = len(inputs)
    T = cp * inputs[0]["q"].shape[2]
    order = torch.argsort(torch.cat([zigzag_positions(T, cp, r) for r in range(cp)]))
    # every rank's part, back in position order: (B, H, T, D) each
    q, k, v = (torch.cat([p[n] for p in inputs], dim=2).double().index_select(2, order) for n in "qkv")
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1) @ v  # (B, H, T, D)
    dtype = inputs[0]["q"].dtype
    return [y.index_select(2, zigzag_positions(T, cp, r)).to(dtype) for r in range(cp)]


def judge_ring(inputs, expected, outputs, world_size) -> str:
    members = inputs[0]["members"]
    B, H, n, D = inputs[members[0]]["q"].shape
    for rank in members:
        out, want = outputs[rank], expected[rank]
        got = out["out"]
        if got is None:
            return f"rank {rank} returned {out['type']}, not a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return (f"rank {rank} returned {got.dtype} {tuple(got.shape)}; expected {want.dtype} "
                    f"{tuple(want.shape)} (q's dtype and shape)")
        if out["changed"]:
            return f"rank {rank} changed q, k or v (work on copies)"
        if error := close(got, want, forward(want.dtype)):
            return (f"rank {rank}: wrong output ({error}) against causal attention over the "
                    f"whole sequence")
    limit = score_limit(B, H, n, D)
    for rank in members:
        out = outputs[rank]
        if out["largest"] > limit:
            return (f"rank {rank} created a tensor of shape {tuple(out['largest_shape'])} "
                    f"({out['largest']} elements): ring attention holds at most one "
                    f"(T/cp, T/cp) score block per batch row and head, or a few key/value "
                    f"blocks ({limit} elements here)")
    return ring_pattern_of(outputs, members, 2 * (len(members) - 1) * B * H * n * D)


CAUSAL_RING_ATTENTION = ExerciseSpec(
    id="causal_ring_attention", title="Causal ring attention on the zig-zag layout",
    difficulty="★★★ hard", world_sizes=(2, 3, 4), make_cases=make_ring_cases, call=call_ring,
    expect=expect_ring, judge=judge_ring, reference=course_causal_ring_attention,
    forbidden=COLLECTIVES,
    banned=("reference.course.homework.context_parallel_ring.course_causal_ring_attention",
            "reference.context_parallel", "reference.comms"))
