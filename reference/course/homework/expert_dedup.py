"""Hidden checks of homework 05's deduplicated dispatch, and of its written question.

* ``dispatch_combine_dedup(tokens, expert_idx, weights, experts_per_rank, expert_fn,
  group=None)``: the contract of `dispatch_combine` (expert e on group rank
  ``e // experts_per_rank``, -1 = dropped, only ``all_to_all_single`` allowed), but a
  token whose kept experts share a rank crosses to that rank **once**: the rank runs each
  of those experts on the one row and sends back one row, their weighted sum. Judged as
  `dispatch_combine` (the single-process sum within the course's fp32 forward bound,
  `reference.tolerance.forward()`, plus `expert_traffic.rounding_bounds`, float32's
  rounding of sin's argument; computed in
  float64 and returned in the tokens' dtype; each expert on its own rank, on exactly the
  rows that chose it; no point-to-point message), and by the traffic: the elements a rank
  sends through all_to_all_single may not exceed one row of C per (token, rank) pair out
  and per pair in, plus 2k per pair out for the expert ids and weights and 2 (E + P) for
  the counts. Sending one row per assignment, as `dispatch_combine` does, is over that
  wherever tokens meet a rank twice (C is large enough next to 2k). Cases on 2 and 3
  ranks: k = 1 (nothing to save), k = 2 to 4 with 2 to 4 experts per rank, every token's
  experts on rank 0 (empty splits), dropped assignments with a token that lost all of
  them and a rank with no tokens, float64 tokens with float32 weights.
* ``dedup_all_to_all_bytes(tokens, d_model, k, ep, ranks_per_token, bytes_per_element)``:
  the written question, graded exactly: the bytes one rank sends through the dispatch
  and combine all-to-alls of one MoE layer's forward, rows only, when each token's k
  experts lie on ``ranks_per_token`` ranks and routing is balanced.

`course_dispatch_combine` and `course_dispatch_combine_dedup` are the course's answers to
the two dispatch exercises, with the student's signature (refused to the student's code).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.course.homework.expert_traffic import (
    TOLERANCE, all_to_all_single_allowed, assignments, close, expert_fn_value, plain,
    rounding_bounds,
    call_dispatch_combine as call_dedup,
)
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.questions import question
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup

__all__ = ["DISPATCH_COMBINE_DEDUP", "DEDUP_ALL_TO_ALL_BYTES", "course_dispatch_combine",
           "course_dispatch_combine_dedup", "dedup_all_to_all_bytes_formula", "pairs_of"]


def course_dispatch_combine(tokens, expert_idx, weights, experts_per_rank, expert_fn, group=None):
    """The lecture's dispatch and combine, on the course's all-to-all (`expert_parallel.comms`)."""
    from reference.comms.functional import all_to_all
    from reference.expert_parallel.comms import exchange_counts

    P, rank, k = dist.get_world_size(group), dist.get_rank(group), expert_idx.shape[1]
    flat = expert_idx.reshape(-1)
    order = (flat >= 0).nonzero().squeeze(1)
    order = order[torch.argsort(flat[order], stable=True)]  # kept assignments by expert
    counts = torch.bincount(flat[order], minlength=experts_per_rank * P)  # (E,)
    recv = exchange_counts(counts, group)  # (P, E / P): from rank s for my expert l
    send_splits, recv_splits = counts.view(P, -1).sum(1).tolist(), recv.sum(1).tolist()
    received = all_to_all(tokens[order // k], recv_splits, send_splits, group)
    blocks = list(received.split(recv.reshape(-1).tolist()))  # (source, local expert)
    for l in range(experts_per_rank):
        mine = list(range(l, len(blocks), experts_per_rank))
        out = expert_fn(rank * experts_per_rank + l, torch.cat([blocks[i] for i in mine]))
        for i, piece in zip(mine, out.split([len(blocks[i]) for i in mine])):
            blocks[i] = piece
    back = all_to_all(torch.cat(blocks), send_splits, recv_splits, group)
    w = weights.reshape(-1)[order].to(back.dtype).unsqueeze(1)
    return torch.zeros_like(tokens).index_add_(0, order // k, back * w)


def pairs_of(expert_idx: torch.Tensor, experts_per_rank: int, P: int):
    """(destination rank, token) of every (token, rank) pair with a kept assignment, by rank."""
    N = expert_idx.shape[0]
    hit = torch.zeros(P, N, dtype=torch.bool)
    kept = expert_idx >= 0
    tokens = torch.arange(N).unsqueeze(1).expand_as(expert_idx)
    hit[expert_idx[kept] // experts_per_rank, tokens[kept]] = True
    return hit.nonzero(as_tuple=True)


def course_dispatch_combine_dedup(tokens, expert_idx, weights, experts_per_rank, expert_fn,
                                  group=None):
    """One row per (token, rank), the rank's experts summed there, one row back."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    dest, token = pairs_of(expert_idx, experts_per_rank, P)
    here = expert_idx[token] // experts_per_rank == dest.unsqueeze(1)  # (n, k), -1 never here
    local = torch.where(here & (expert_idx[token] >= 0), expert_idx[token] % experts_per_rank, -1)
    meta = torch.cat([local.to(weights.dtype), weights[token]], dim=1)  # (n, 2k)
    send = torch.bincount(dest, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send, recv = send.tolist(), recv.tolist()
    rows = tokens.new_empty(sum(recv), tokens.shape[1])
    dist.all_to_all_single(rows, tokens[token].contiguous(), recv, send, group=group)
    their_meta = meta.new_empty(sum(recv), meta.shape[1])
    dist.all_to_all_single(their_meta, meta, recv, send, group=group)
    k = expert_idx.shape[1]
    ids, w = their_meta[:, :k].long(), their_meta[:, k:].to(tokens.dtype)
    out = torch.zeros_like(rows)
    for l in range(experts_per_rank):
        use = ids == l  # (n_in, k)
        chosen = use.any(dim=1)
        result = expert_fn(rank * experts_per_rank + l, rows[chosen])
        out[chosen] += (w * use)[chosen].sum(dim=1, keepdim=True) * result
    back = torch.empty_like(tokens[token])
    dist.all_to_all_single(back, out, send, recv, group=group)
    return torch.zeros_like(tokens).index_add_(0, token, back)


# ------------------------------------------------------------------ in a rank, and judged here

def expect_dedup(inputs: list) -> list:
    """The single-process answer: every token's weighted sum over its kept experts (float64)."""
    results = []
    for case in inputs:
        x, idx, w = case["tokens"].double(), case["expert_idx"], case["weights"].double()
        out = torch.zeros_like(x)  # (N, C)
        for j in range(idx.shape[1]):
            for e in idx[:, j].unique().tolist():
                if e >= 0:
                    rows = idx[:, j] == e
                    out[rows] += w[rows, j, None] * expert_fn_value(e, x[rows])
        results.append(out.to(case["tokens"].dtype))
    return results


def judge_dedup(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    P, epr = world_size, inputs[0]["experts_per_rank"]
    E, C, k = epr * P, inputs[0]["tokens"].shape[1], inputs[0]["expert_idx"].shape[1]
    chosen = torch.bincount(torch.cat([c["expert_idx"].reshape(-1) for c in inputs]) + 1,
                            minlength=E + 1)[1:]  # (E,) kept assignments per expert, all ranks
    dests = [pairs_of(c["expert_idx"], epr, P)[0] for c in inputs]
    pairs_in = torch.bincount(torch.cat(dests), minlength=P)  # (P,) pairs each rank receives
    ran = torch.zeros(E, dtype=torch.long)
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        got = out["returned"]
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            what = out["returned_type"] if got is None else f"{got.dtype} {tuple(got.shape)}"
            return (f"rank {rank} returned {what}; expected {want.dtype} {tuple(want.shape)} (one "
                    f"row per token of this rank, in the tokens' dtype)")
        if out.get("sends") or out.get("recvs"):
            return f"rank {rank} used point-to-point messages: send the rows with all_to_all_single"
        for e, n in out["ran"]:
            if not rank * epr <= e < (rank + 1) * epr:
                return f"expert {e} ran on rank {rank}, but it lives on rank {e // epr}"
            ran[e] += n
    if not torch.equal(ran, chosen):
        e = int((ran != chosen).nonzero()[0])
        return (f"expert {e} processed {int(ran[e])} rows; {int(chosen[e])} kept assignments "
                f"chose it (each assignment's row once, dropped ones never)")
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        bound = rounding_bounds(inputs[rank])["out"]
        bad = ~close(out["returned"], want, bound).all(dim=1)
        if bad.any():
            t = int(bad.nonzero()[0])
            return (f"rank {rank}, token {t}: wrong output (max abs error "
                    f"{(out['returned'][t] - want[t]).abs().max().item():.3g}); each token must "
                    f"get the weighted sum of its kept experts' outputs")
        n_out, n_in = len(dests[rank]), int(pairs_in[rank])
        limit = (n_out + n_in) * C + 2 * k * n_out + 2 * (E + P)
        sent = sum(s for s, _ in out["all_to_all"])
        if sent > limit:
            return (f"rank {rank} sent {sent} elements through all_to_all_single; one row per "
                    f"(token, rank) pair needs {(n_out + n_in) * C} for the rows out and back, "
                    f"plus at most {2 * k * n_out + 2 * (E + P)} for ids, weights and counts")
    return ""


def make_dedup_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    P = world_size

    def sizes(low, high):
        return [int(torch.randint(low, high + 1, (), generator=generator)) for _ in range(P)]

    def rank_input(n, C, epr, k, dtype=torch.float32, to_rank_0=False, drop=0.0, drop_first=False):
        tokens = torch.randn(n, C, generator=generator, dtype=torch.float64).to(dtype)
        idx = assignments(generator, n, epr if to_rank_0 else epr * P, k)  # rank 0: experts < epr
        if drop:
            idx[torch.rand(n, k, generator=generator) < drop] = -1
        if drop_first and n:
            idx[0] = -1  # this token lost all its assignments: its output is 0
        weights = torch.rand(n, k, generator=generator) * 0.9 + 0.1
        if k > 1:
            weights = weights / weights.sum(dim=1, keepdim=True)
        return {"tokens": tokens, "expert_idx": idx, "weights": weights, "experts_per_rank": epr}

    return [
        Case("k=1, nothing to deduplicate", [rank_input(n, 16, 2, 1) for n in sizes(2, 6)]),
        Case("k=2, 2 experts per rank, uneven tokens per rank",
             [rank_input(n, 24, 2, 2) for n in sizes(3, 8)]),
        Case("k=4, 4 experts per rank", [rank_input(n, 24, 4, 4) for n in sizes(3, 7)]),
        Case("k=2, every token's experts on rank 0 (empty splits)",
             [rank_input(n, 24, 2, 2, to_rank_0=True) for n in sizes(2, 6)]),
        Case("k=3, dropped assignments, a token dropped entirely, the last rank without tokens",
             [rank_input(0 if r == P - 1 else n, 24, 3, 3, drop=0.3, drop_first=(r == 0))
              for r, n in enumerate(sizes(3, 7))]),
        Case("k=3, float64 tokens, float32 weights",
             [rank_input(n, 24, 3, 3, dtype=torch.float64) for n in sizes(2, 6)]),
    ]


def reference_dedup(case: dict) -> torch.Tensor:
    return expect_dedup([case])[0]


# ------------------------------------------------------------------ the written question

def dedup_all_to_all_bytes_formula(tokens, d_model, k, ep, ranks_per_token, bytes_per_element) -> int:
    """tokens * M rows, of which (ep - 1) / ep leave the rank; as many come back (balanced)."""
    return 2 * (tokens * ranks_per_token * (ep - 1) // ep) * d_model * bytes_per_element


DISPATCH_COMBINE_DEDUP = on_subgroup(ExerciseSpec(
    id="dispatch_combine_dedup", title="dispatch and combine, each token sent once per rank",
    difficulty="★★★ hard", world_sizes=(2, 3), make_cases=make_dedup_cases, call=call_dedup,
    expect=expect_dedup, judge=judge_dedup, reference=reference_dedup,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_to_all_single"),
    banned=("reference.course.homework.expert_dedup.course_dispatch_combine_dedup",
            "reference.course.homework.expert_dedup.course_dispatch_combine",
            "reference.expert_parallel.comms", "reference.comms.functional.all_to_all",
            "reference.expert_parallel.moe",
            "reference.expert_parallel.router.sort_by_expert",
            "reference.expert_parallel.router.combine")), (3,), (1, 4))
DEDUP_ALL_TO_ALL_BYTES = question(
    "dedup_all_to_all_bytes", "The bytes of a deduplicated all-to-all",
    dedup_all_to_all_bytes_formula,
    # every tokens divides by every ep; ranks_per_token <= min(k, ep) for every draw
    {"tokens": (1040, 4096, 4800, 65536), "d_model": (512, 4096, 7168), "k": (2, 4, 8),
     "ep": (2, 4, 8, 16), "ranks_per_token": (1, 2), "bytes_per_element": (2, 4)},
    fixed=({"tokens": 1040, "d_model": 512, "k": 2, "ep": 1, "ranks_per_token": 1,
            "bytes_per_element": 4},
           {"tokens": 4800, "d_model": 7168, "k": 8, "ep": 3, "ranks_per_token": 3,
            "bytes_per_element": 2},
           {"tokens": 4096, "d_model": 7168, "k": 8, "ep": 16, "ranks_per_token": 4,
            "bytes_per_element": 2}),
    banned=("reference.course.homework.expert_dedup.dedup_all_to_all_bytes_formula",
            "reference.expert_parallel.comms.all_to_all_bytes_per_step"), difficulty="★★☆ medium")
