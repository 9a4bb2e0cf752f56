"""Hidden checks of homework 08: long sequences split over a cp group.

* ``merge_attention_blocks(outs, lses)`` (one process): the online-softmax merge of k
  blocks' normalised outputs (B, H, T, D) and log-sum-exps (B, H, T), k from 1 to 5, into
  the attention over every block's keys: the lecture merged two, here any number, in a
  numerically safe order. Cases: float32 and float64; log-sum-exps near +1000 and -1000
  (e^lse over- or underflows: only a shifted form survives); rows where some blocks met
  no key (lse -inf, output 0), and rows no block met (output 0, lse -inf: folding the
  lecture's two-block formula pair by pair gives NaN there, e^(-inf - -inf)); one block
  far heavier than the others; a single block; a single token. The inputs must not change.
* ``zigzag_mask(T, cp, i, j)`` (one process): the (T/cp, T/cp) boolean mask of the
  causal pairs between rank i's queries and rank j's keys under the zig-zag layout
  (rank r holds chunks r and 2 cp - 1 - r of 2 cp), every (i, j) of a case checked;
  a T that 2 cp does not divide raises ValueError. Cases: cp 1 to 4, chunks of one
  token, and three T to refuse (one that cp divides but 2 cp does not).
* ``causal_ring_attention(q, k, v, group)`` (2, 3 and 4 ranks, no collective): the
  forward of causal ring attention on the zig-zag layout, checked in
  `reference.course.homework.context_parallel_ring`.
* ``ring_forward_bytes(B, T, n_heads, n_kv_heads, head_dim, cp, bytes_per_element)``: the
  written question, graded exactly: bytes one rank sends in ring attention's forward when
  the keys and values have fewer heads than the queries (grouped-query attention).

Tolerances (`merge_tolerance`): the course's bound for a forward in the inputs' dtype
(`reference.tolerance.forward`, reasoned in reference/tolerance.py), for values of order
the largest |lse| of the case rather than 1 (`at_scale`): the inputs' log-sum-exps reach
|lse| = 1000, where one rounding is u |lse| (6e-5 in float32), so the merged lse and the
weights e^(lse_i - lse) carry an error of that size in any computation, and the output,
a mix of values of order 1 with those weights, too; a merge that forms e^lse itself
returns inf or NaN there, far outside. The ring's outputs take `forward(dtype)`.
"""
from __future__ import annotations

import math

import torch

from reference.course.homework.context_parallel_ring import (
    CAUSAL_RING_ATTENTION, close, plain, zigzag_positions,
)
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import Tolerance, forward

__all__ = ["MERGE_ATTENTION_BLOCKS", "ZIGZAG_MASK", "CAUSAL_RING_ATTENTION", "RING_FORWARD_BYTES",
           "EXERCISES", "HOMEWORK_ID", "course_merge_attention_blocks", "course_zigzag_mask",
           "ring_forward_bytes_formula", "merge_tolerance"]


def merge_tolerance(lses) -> Tolerance:
    """forward(dtype) for values of order the largest finite |lse| (at least 1): one
    rounding of the merged lse is u |lse|, and the weights e^(lse_i - lse) carry it."""
    lse = torch.stack(list(lses)).double()
    finite = lse[torch.isfinite(lse)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    return forward(lses[0].dtype).at_scale(scale)


# ------------------------------------------------------------------ merge_attention_blocks

def course_merge_attention_blocks(outs, lses):
    """The course's answer: every block's lse shifted by the largest, weights e^(lse_i - max)
    <= 1, a row that no block met (all -inf) left at output 0 and lse -inf."""
    lse_all = torch.stack(list(lses))                                  # (k, B, H, T)
    top = lse_all.amax(dim=0)                                          # (B, H, T)
    shift = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse_all - shift)                               # (k, B, H, T), in [0, 1]
    total = weights.sum(dim=0)                                         # >= 1 unless no key at all
    lse = shift + torch.log(total)                                     # -inf where total is 0
    share = weights / torch.where(total > 0, total, torch.ones_like(total))
    out = (torch.stack(list(outs)) * share.unsqueeze(-1)).sum(dim=0)   # (B, H, T, D)
    return out, lse


# (name, k, B, H, T, D, dtype, centre of the lse, spread, which rows a block met no key of)
MERGE_SHAPES = (
    ("float32 2 blocks (2, 3, 5, 4)", 2, 2, 3, 5, 4, torch.float32, 0.0, 3.0, None),
    ("float64 3 blocks (1, 2, 7, 3)", 3, 1, 2, 7, 3, torch.float64, 0.0, 3.0, None),
    ("float32 a single block", 1, 1, 2, 4, 4, torch.float32, 0.0, 3.0, None),
    ("float32 4 blocks, lse near +1000", 4, 1, 2, 6, 4, torch.float32, 1000.0, 2.0, None),
    ("float64 5 blocks, lse near +1000", 5, 2, 1, 4, 5, torch.float64, 1000.0, 2.0, None),
    ("float32 3 blocks, lse near -1000", 3, 1, 2, 6, 4, torch.float32, -1000.0, 2.0, None),
    ("float32 4 blocks, rows some blocks met no key of", 4, 2, 2, 6, 3, torch.float32, 0.0, 3.0,
     "some"),
    ("float64 3 blocks, rows no block met", 3, 1, 3, 5, 2, torch.float64, 0.0, 3.0, "all"),
    ("float32 3 blocks, one 60 nats heavier", 3, 1, 2, 4, 4, torch.float32, 0.0, 60.0, None),
    ("float64 5 blocks of one token (1, 1, 1, 8)", 5, 1, 1, 1, 8, torch.float64, 0.5, 1.0, None),
)


def make_merge_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    cases = []
    for name, k, B, H, T, D, dtype, centre, spread, masked in MERGE_SHAPES:
        def draw(*shape):
            return torch.randn(shape, generator=generator, dtype=torch.float64)
        outs = [draw(B, H, T, D) for _ in range(k)]
        lses = [centre + spread * draw(B, H, T) for _ in range(k)]
        if "heavier" in name:  # block 1 e^60 times heavier than the others on every row
            lses = [centre + (0.0 if i == 1 else -spread) + draw(B, H, T) for i in range(k)]
        rows = torch.arange(T)
        for i in range(k):
            if masked == "some":    # block i met no key on rows r = i mod 3; the others did
                none = rows % 3 == i % 3
            elif masked == "all":   # rows 0 and 3: no block met a key (a fully masked query)
                none = (rows == 0) | (rows == 3) | ((rows + i) % 2 == 0)
            else:
                continue
            lses[i][..., none] = -math.inf
            outs[i][..., none, :] = 0.0
        case = {"outs": [o.to(dtype) for o in outs], "lses": [l.to(dtype) for l in lses]}
        cases.append(Case(name, [case]))
    return cases


def call_merge(fn, case: dict) -> dict:
    outs, lses = [o.clone() for o in case["outs"]], [l.clone() for l in case["lses"]]
    result = fn(outs, lses)
    changed = any(not torch.equal(a, b) for a, b in zip(outs + lses, case["outs"] + case["lses"]))
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    return {"pair": pair, "type": type(result).__name__, "changed": changed,
            "out": plain(result[0]) if pair else None, "lse": plain(result[1]) if pair else None}


def expect_merge(inputs: list) -> list:
    c = inputs[0]
    out, lse = course_merge_attention_blocks([o.double() for o in c["outs"]],
                                             [l.double() for l in c["lses"]])
    return [{"out": out, "lse": lse}]


def judge_merge(inputs, expected, outputs, world_size) -> str:
    c, want, got = inputs[0], expected[0], outputs[0]
    dtype = c["outs"][0].dtype
    tol = merge_tolerance(c["lses"])
    if not got["pair"]:
        return f"returned {got['type']}, not the pair (out, lse)"
    if got["changed"]:
        return "changed its inputs (the merge is a pure function: return new tensors)"
    for name in ("out", "lse"):
        t, w = got[name], want[name]
        if t is None:
            return f"{name} is not a tensor"
        if t.shape != w.shape or t.dtype != dtype:
            return (f"{name} is {t.dtype} {tuple(t.shape)}; expected {dtype} {tuple(w.shape)} "
                    f"(the inputs' dtype and shape)")
        if error := close(t, w, tol):
            return f"wrong {name} ({error})"
    return ""


# ------------------------------------------------------------------ zigzag_mask

def course_zigzag_mask(T: int, cp: int, i: int, j: int) -> torch.Tensor:
    """The course's answer: query position >= key position, as a (T/cp, T/cp) bool tensor."""
    return zigzag_positions(T, cp, i)[:, None] >= zigzag_positions(T, cp, j)[None, :]


def make_mask_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    # Seven layouts (cp = 1 .. 4, chunks of one token at T = 2 cp), then three T to refuse:
    # 6 % 4, 9 % 6 (cp = 3 divides 9, 2 cp does not) and (8 m + 4) % 8.
    specs = [(2 * draw(1, 4), 1), (4, 2), (4 * draw(3, 5), 2), (6, 3), (6 * draw(2, 4), 3),
             (8, 4), (8 * draw(2, 3), 4), (6, 2), (9, 3), (8 * draw(1, 3) + 4, 4)]
    return [Case(f"T={T} cp={cp}", [{"T": T, "cp": cp}]) for T, cp in specs]


def call_mask(fn, case: dict) -> dict:
    T, cp = case["T"], case["cp"]
    if T % (2 * cp):
        try:
            fn(T, cp, 0, 0)
        except ValueError:
            return {"refused": True}
        return {"refused": False}
    masks = []
    for i in range(cp):
        row = []
        for j in range(cp):
            m = fn(T, cp, i, j)
            row.append(plain(m) if type(m) is torch.Tensor else type(m).__name__)
        masks.append(row)
    return {"masks": masks}


def expect_mask(inputs: list) -> list:
    T, cp = inputs[0]["T"], inputs[0]["cp"]
    if T % (2 * cp):
        return [None]
    return [[[course_zigzag_mask(T, cp, i, j) for j in range(cp)] for i in range(cp)]]


def judge_mask(inputs, expected, outputs, world_size) -> str:
    T, cp = inputs[0]["T"], inputs[0]["cp"]
    got, want = outputs[0], expected[0]
    if want is None:
        return "" if got.get("refused") else (f"T={T}, cp={cp}: T % (2*cp) = {T % (2 * cp)}, yet no "
                                              f"ValueError was raised")
    for i in range(cp):
        for j in range(cp):
            m, w = got["masks"][i][j], want[i][j]
            if not isinstance(m, torch.Tensor):
                return f"zigzag_mask(T={T}, cp={cp}, {i}, {j}) returned {m}, not a tensor"
            if m.dtype != torch.bool or m.shape != w.shape:
                return (f"zigzag_mask(T={T}, cp={cp}, {i}, {j}) is {m.dtype} {tuple(m.shape)}; "
                        f"expected torch.bool {tuple(w.shape)}")
            if not torch.equal(m, w):
                bad = int((m != w).sum())
                return (f"zigzag_mask(T={T}, cp={cp}, i={i}, j={j}): {bad} of {w.numel()} entries "
                        f"wrong (rank i's queries at positions {zigzag_positions(T, cp, i).tolist()}, "
                        f"rank j's keys at {zigzag_positions(T, cp, j).tolist()})")
    return ""


# ------------------------------------------------------------------ the written question

def ring_forward_bytes_formula(B, T, n_heads, n_kv_heads, head_dim, cp, bytes_per_element) -> int:
    """Ring attention's forward with grouped-query attention: only K and V travel, each of
    n_kv_heads heads; cp - 1 steps send one key block and one value block of T/cp tokens."""
    return 2 * (cp - 1) * B * n_kv_heads * (T // cp) * head_dim * bytes_per_element


MERGE_ATTENTION_BLOCKS = ExerciseSpec(
    id="merge_attention_blocks", title="The online-softmax merge of k attention blocks",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_merge_cases, call=call_merge,
    expect=expect_merge, judge=judge_merge, reference=course_merge_attention_blocks,
    banned=("reference.course.homework.context_parallel.course_merge_attention_blocks",
            "reference.context_parallel.blocks", "reference.context_parallel.ring"))
ZIGZAG_MASK = ExerciseSpec(
    id="zigzag_mask", title="Which queries meet which keys under the zig-zag layout",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_mask_cases, call=call_mask,
    expect=expect_mask, judge=judge_mask, reference=course_zigzag_mask,
    banned=("reference.course.homework.context_parallel.course_zigzag_mask",
            "reference.context_parallel.layout", "reference.context_parallel.blocks",
            "reference.context_parallel.cost"))
# T divides by 2 cp for every cp drawn (2 * lcm(1, 2, 3, 4, 8, 16) = 96); n_kv_heads <= n_heads.
RING_FORWARD_BYTES = question(
    "ring_forward_bytes", "Bytes a rank sends in ring attention's forward, with grouped-query attention",
    ring_forward_bytes_formula,
    {"B": (1, 2, 8), "T": (1_536, 12_288, 98_304, 3_145_728), "n_heads": (32, 64, 128),
     "n_kv_heads": (1, 4, 8, 32), "head_dim": (64, 128), "cp": (1, 2, 3, 4, 8, 16),
     "bytes_per_element": (2, 4)},
    fixed=({"B": 2, "T": 96, "n_heads": 12, "n_kv_heads": 4, "head_dim": 16, "cp": 3,
            "bytes_per_element": 4},
           {"B": 1, "T": 1_536, "n_heads": 8, "n_kv_heads": 8, "head_dim": 64, "cp": 1,
            "bytes_per_element": 2}),
    banned=("reference.course.homework.context_parallel.ring_forward_bytes_formula",
            "reference.context_parallel.cost"))
HOMEWORK_ID = "08_context_parallel"
# An answer failing any case keeps at most half: a rule broken alone (peers taken as group
# ranks, q sent along, the scores of every key) shows only in the cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (MERGE_ATTENTION_BLOCKS, ZIGZAG_MASK, CAUSAL_RING_ATTENTION, RING_FORWARD_BYTES)
