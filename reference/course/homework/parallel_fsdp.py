"""Hidden checks of homework 06's exercise on FSDP inside tensor parallelism.

``fsdp_tp_pieces(n_rows, chunks, tp, dp, tp_rank, dp_rank)``: the rows of a whole
column-parallel weight of ``n_rows`` rows that rank (tp_rank, dp_rank) holds when ZeRO-3 is
composed with tensor parallelism, as `parallelize` lays them out:

* tensor parallelism first (`reference.tensor_parallel.column_shard`): the out dimension is
  ``chunks`` blocks side by side (3 for c_attn's [q | k | v], 1 otherwise); each block is cut
  into tp equal parts and tp rank r keeps part r of every block, concatenated: its TP-local
  tensor has n_rows / tp rows;
* then FSDP (`reference.zero.fsdp_param.shard_rows`): the TP-local rows are padded with zero
  rows to dp * c, c = ceil(local / dp), and dp rank d keeps rows [d c, (d + 1) c) of them.

The answer is the list of (start, stop) ranges of the WHOLE weight's rows, in the order the
rank's shard holds them, each range as long as possible (adjacent rows merged), padding rows
left out (a rank that holds only padding returns []). This is what a sharded checkpoint
writes for the rank (notebook 06, appendix "A.1 FSDP inside tensor parallelism"). Graded exactly. Cases:
chunks 1 and 3, tp 1, 2 and 4, dp 1, 2, 3 and 4, local rows dp does not divide (the last dp
ranks hold padding, one holds nothing), every (tp_rank, dp_rank) of each mesh. One process;
no collective.
"""
from __future__ import annotations

import math

import torch

from reference.course.homework.scoring import Case, ExerciseSpec

__all__ = ["FSDP_TP_PIECES", "course_fsdp_tp_pieces", "make_pieces_cases"]


def course_fsdp_tp_pieces(n_rows, chunks, tp, dp, tp_rank, dp_rank) -> list:
    """The course's answer, from the cuts themselves: label each row, cut, read the labels."""
    from reference.tensor_parallel import column_shard
    from reference.zero.fsdp_param import shard_rows

    rows = torch.arange(1, n_rows + 1)  # row i labelled i + 1; padding rows are 0
    held = shard_rows(column_shard(rows, tp_rank, tp, chunks), dp_rank, dp).tolist()
    pieces: list = []
    for label in held:
        if label == 0:
            continue
        if pieces and pieces[-1][1] == label - 1:
            pieces[-1][1] = label
        else:
            pieces.append([label - 1, label])
    return [tuple(p) for p in pieces]


def call_pieces(fn, case: dict) -> dict:
    out = [fn(case["n_rows"], case["chunks"], case["tp"], case["dp"], t, d)
           for t in range(case["tp"]) for d in range(case["dp"])]
    try:
        answers = [[[int(a), int(b)] for a, b in pieces] for pieces in out]
    except (TypeError, ValueError):
        return {"error": "returned something other than a list of (start, stop) pairs"}
    return {"answers": answers, "error": ""}


def expect_pieces(inputs: list) -> list:
    c = inputs[0]
    return [[[list(p) for p in course_fsdp_tp_pieces(c["n_rows"], c["chunks"], c["tp"], c["dp"], t, d)]
             for t in range(c["tp"]) for d in range(c["dp"])]]


def judge_pieces(inputs, expected, outputs, world_size) -> str:
    out, want, c = outputs[0], expected[0], inputs[0]
    if out.get("error"):
        return out["error"]
    ranks = [(t, d) for t in range(c["tp"]) for d in range(c["dp"])]
    for (t, d), got, w in zip(ranks, out["answers"], want):
        if got != w:
            rows_got = sum(b - a for a, b in got)
            rows_want = sum(b - a for a, b in w)
            what = ("as many rows, other ones or in another order" if rows_got == rows_want
                    else f"{rows_got} rows where the rank holds {rows_want}")
            return (f"pieces of tp rank {t}, dp rank {d} (n_rows={c['n_rows']}, chunks="
                    f"{c['chunks']}, tp={c['tp']}, dp={c['dp']}): {got[:4]}; {what}")
    return ""


def make_pieces_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    specs = [  # (chunks, tp, dp, local rows per tp rank)
        (1, 2, 2, 2 * draw(2, 5)),          # everything divides
        (1, 2, 3, 3 * draw(1, 3) + 1),      # dp does not divide: the last dp ranks pad
        (3, 2, 2, 3 * draw(1, 3)),          # [q | k | v]: a dp shard may cross a block
        (3, 4, 3, 3 * draw(1, 2)),          # crossing blocks, padding
        (3, 1, 2, 3 * draw(2, 3)),          # tp 1: FSDP alone, a shard across two blocks
        (1, 4, 1, draw(1, 4)),              # dp 1: tensor parallelism alone
        (1, 1, 4, draw(1, 2)),              # fewer rows than ranks: a rank holds nothing
        (3, 2, 4, 3 * draw(1, 2)),
    ]
    return [Case(f"n_rows={chunks_local(c, tp, local)} chunks={c} tp={tp} dp={dp}",
                 [dict(n_rows=chunks_local(c, tp, local), chunks=c, tp=tp, dp=dp)])
            for c, tp, dp, local in specs]


def chunks_local(chunks: int, tp: int, local: int) -> int:
    """n_rows for a TP-local size: a multiple of chunks per tp rank (local rows = n_rows / tp)."""
    return tp * chunks * math.ceil(local / chunks)


FSDP_TP_PIECES = ExerciseSpec(
    id="fsdp_tp_pieces", title="The rows a rank holds under FSDP inside tensor parallelism",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_pieces_cases, call=call_pieces,
    expect=expect_pieces, judge=judge_pieces, reference=course_fsdp_tp_pieces,
    banned=("reference.course.homework.parallel_fsdp.course_fsdp_tp_pieces",
            "reference.tensor_parallel.layers.column_shard", "reference.zero.fsdp_param.shard_rows",
            "reference.train.checkpoint_shards"))
