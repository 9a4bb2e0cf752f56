"""Homework 06's fsdp_tp_pieces: the expected rows are the cuts `parallelize` makes, the
solution earns every case, and the usual mistakes lose the cases that show them.

Every wrong answer is the solution notebook's function with one change, scored directly
with `score_exercise` (one process; tests/test_course_homework.py grades the notebook).
"""
from __future__ import annotations

import cloudpickle
import pytest
import torch

from reference.course.homework.parallel_fsdp import (FSDP_TP_PIECES, course_fsdp_tp_pieces,
                                                     make_pieces_cases)
from reference.course.homework.scoring import score_exercise
from reference.tensor_parallel import column_shard
from reference.zero.fsdp_param import shard_rows
from solution_cells import solution_function

pytestmark = pytest.mark.timeout(120)


def _score(*edits):
    fn = solution_function("06_3d_parallel", "fsdp_tp_pieces", *edits)
    return score_exercise(FSDP_TP_PIECES, cloudpickle.dumps(fn), seed=5, timeout=60)


def test_the_course_answer_is_the_rows_the_real_cuts_keep():
    """Each piece, read from a weight whose row i holds i, is exactly the rank's shard
    (padding rows after it), for every rank of every hidden mesh."""
    for case in make_pieces_cases(torch.Generator().manual_seed(1), 1):
        c = case.inputs[0]
        weight = torch.arange(c["n_rows"] * 2, dtype=torch.float64).view(c["n_rows"], 2)
        for t in range(c["tp"]):
            for d in range(c["dp"]):
                shard = shard_rows(column_shard(weight, t, c["tp"], c["chunks"]), d, c["dp"])
                pieces = course_fsdp_tp_pieces(c["n_rows"], c["chunks"], c["tp"], c["dp"], t, d)
                rows = torch.cat([weight[a:b] for a, b in pieces]) if pieces else weight[:0]
                assert torch.equal(shard[:rows.shape[0]], rows), (case.name, t, d)
                assert not shard[rows.shape[0]:].any(), (case.name, t, d)  # the rest: padding


def test_the_cases_cover_blocks_padding_and_an_empty_rank():
    cases = [c.inputs[0] for c in make_pieces_cases(torch.Generator().manual_seed(1), 1)]
    assert {c["chunks"] for c in cases} == {1, 3} and {c["tp"] for c in cases} >= {1, 2, 4}
    assert any((c["n_rows"] // c["tp"]) % c["dp"] for c in cases)              # padding
    assert any(course_fsdp_tp_pieces(c["n_rows"], c["chunks"], c["tp"], c["dp"], 0, c["dp"] - 1)
               == [] for c in cases)                                             # a rank holds nothing


def test_the_solution_earns_every_case():
    score = _score()
    assert score.points == score.max == 8, score.failures


@pytest.mark.parametrize("edits, lost_at_least", [
    # q|k|v ignored: the TP cut taken as one block
    ([("    local = [(k * block + tp_rank * part, k * block + (tp_rank + 1) * part) for k in range(chunks)]",
       "    local = [(tp_rank * chunks * part, (tp_rank + 1) * chunks * part)]")], 3),  # chunks 3, tp > 1
    # adjacent rows left as separate pieces (tp 1 with [q | k | v]: the blocks touch)
    ([("            if pieces and pieces[-1][1] == piece[0]:", "            if False:")], 1),
    # FSDP's chunk rounded down instead of up
    ([("    c = math.ceil(n_local / dp)", "    c = n_local // dp")], 2),
])
def test_mistakes_lose_the_cases_that_show_them(edits, lost_at_least):
    score = _score(*edits)
    assert score.points < score.max and score.max - score.points >= max(lost_at_least, 1), \
        score.failures
    assert all("pieces of tp rank" in f for f in score.failures), score.failures
