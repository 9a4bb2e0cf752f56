"""Homework 06's hidden checks take points from wrong answers, and say why.

Every wrong answer is the solution notebook's own function with one change, scored
directly with `score_exercise` (tests/test_course_homework.py grades the notebooks).
"""
from __future__ import annotations

from pathlib import Path

import cloudpickle
import nbformat
import pytest

from reference.course.homework.parallel import MESH_GROUPS, PARAMETERS_PER_RANK
from reference.course.homework.scoring import score_exercise

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "06_3d_parallel.ipynb"
pytestmark = pytest.mark.timeout(300)


def _variant(exercise: str, *edits) -> bytes:
    nb = nbformat.read(SOLUTION, as_version=4)
    source = next(c.source for c in nb.cells
                  if c.cell_type == "code" and c.metadata.get("course", {}).get("exercise") == exercise)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    namespace = {"__name__": "student"}  # pickled by value, like a notebook's function
    exec(source, namespace)
    return cloudpickle.dumps(namespace[exercise])


def _score(spec, *edits):
    return score_exercise(spec, _variant(spec.id, *edits), seed=1, timeout=60)


def test_solutions_score_full_marks():
    for spec in (MESH_GROUPS, PARAMETERS_PER_RANK):
        score = _score(spec)
        assert (score.points, score.reason) == (score.max, "") and score.max >= 5, spec.id


def test_tp_outermost_loses_every_case_with_tp_above_one():
    score = _score(MESH_GROUPS, ("tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)",
                                 "pp_rank, dp_rank, tp_rank = rank % pp, (rank // pp) % dp, rank // (pp * dp)"))
    assert 0 < score.points < score.max and "groups" in score.reason


def test_ep_outermost_inside_dp_loses_the_expert_cases():
    score = _score(MESH_GROUPS, ('"ep": dp_rank % ep, "edp": dp_rank // ep',
                                 '"ep": dp_rank // (dp // ep), "edp": dp_rank % (dp // ep)'))
    assert score.points < score.max and ("ep groups" in score.reason or "edp groups" in score.reason)


def test_forgetting_the_tied_copy_loses_the_pipelined_tied_cases():
    score = _score(PARAMETERS_PER_RANK, ("if not (tied and stage == 0):", "if not tied:"))
    assert 0 < score.points < score.max and "holds" in score.reason


def test_unpadded_vocabulary_loses_the_padded_case():
    score = _score(PARAMETERS_PER_RANK, ("vocab_shard = -(-V // tp)", "vocab_shard = V // tp"))
    assert 0 < score.points < score.max and "holds" in score.reason


def test_extra_layers_on_the_first_stages_lose_the_uneven_cases():
    score = _score(PARAMETERS_PER_RANK, ("1 if stage >= pp - extra else 0", "1 if stage < extra else 0"))
    assert 0 < score.points < score.max


def test_a_one_call_answer_through_the_course_calculator_scores_zero():
    """Exercise 2 says to count by hand: stage_params (the calculator the expected answers come
    from) refuses to run from the student's function, however it is imported."""
    def parameters_per_rank(model, dp, tp, pp):
        from reference.model import GPTConfig
        from reference.parallel.config import ParallelConfig
        from reference.parallel.estimate import stage_params
        config = ParallelConfig(dp=dp, tp=tp, pp=pp)
        mesh = config.mesh()
        return [stage_params(GPTConfig(**model), config, mesh.coords(r).pp) for r in range(dp * tp * pp)]
    score = score_exercise(PARAMETERS_PER_RANK, cloudpickle.dumps(parameters_per_rank), seed=1, timeout=60)
    assert score.points == 0 and "reference implementation" in score.reason, score.reason


def _markdown(cell_id: str) -> str:
    nb = nbformat.read(SOLUTION, as_version=4)
    (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
    return " ".join(cell.source.split())


def test_the_text_says_what_is_graded():
    """The header describes all eight parts and promises no warm-up or bonus; exercise 2 says
    one stage where it means one and refuses the calculator; exercise 3 says the groups' order
    and the helpers allowed; exercise 6 says what the random-state check does (a .backward()
    that leaves the caller's generator where it found it); question 8 says its one byte size
    for every message, the dp all-reduce's included, is a simplification, and the formula
    graded charges it so (dp alone: 2 (dp - 1) ceil(m / dp) numbers at 2 bytes)."""
    from reference.course.homework import homework
    from reference.course.homework.parallel_transfer import step_bytes_3d_formula

    title = _markdown("title")
    ids = [s.id for s in homework("06_3d_parallel")]
    assert all(f"`{i}`" in title for i in ids) and "warm-up" not in title and "bonus" not in title
    assert "the first and last stage are one stage (pp = 1)" in _markdown("ex2-text")
    assert "refuses to run from your function" in _markdown("ex2-text")
    ex3 = _markdown("2f741efe")
    assert "lists its ranks in coordinate order" in ex3 and "`dist.get_rank(group)`" in ex3
    ex6 = _markdown("72f399c6")
    assert "`.backward()`" in ex6 and "your backward leaves the generator where it found it" in ex6
    assert "after the backward, the generator stands where one direct call" not in ex6
    q8 = _markdown("74bb0503")
    assert "a simplification" in q8 and "the grader charges `bytes_per_element` throughout" in q8
    m, dp = 1_000, 4
    assert step_bytes_3d_formula(m, 4, 1, 4, 4, 2, dp, 1, 1, 0, 2) == 2 * (dp - 1) * 250 * 2
