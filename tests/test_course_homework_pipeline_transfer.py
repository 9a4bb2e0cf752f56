"""Homework 04's transfer exercises and written question: the solution notebook's answers
earn every point, the usual mistakes lose the cases they should, and the expected answers
agree with the course's own schedules.

Every wrong answer is the solution's function with one change, scored directly with
`score_exercise` (tests/test_course_homework.py grades the whole notebooks). Mistakes in
the schedule are judged on the one-rank cases only (the lists are judged the same way
there; the runs on 2 and 3 ranks are shown to bite by tampering with their results).
"""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch

from reference.course.homework import homework
from reference.course.homework.pipeline_balance import (
    BALANCE_STAGES, best_cut, course_balance_stages, make_balance_cases, stage_memory,
)
from reference.course.homework.pipeline_interleaved import (
    INTERLEAVED_ACTIONS, INTERLEAVED_PEAK_BYTES, course_interleaved, expect_interleaved,
    interleaved_peak_bytes_formula, judge_interleaved, make_interleaved_cases,
)
from reference.course.homework.scoring import _generator, _launch_cases, score_exercise
from reference.pipeline_parallel.registry import build_schedule
from solution_cells import solution_function

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "04_pipeline_parallel.ipynb"
TIMEOUT = 60  # s per launch; each needs a few seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)
ONE_RANK = dict(world_sizes=(1,))  # the 7 list-only cases of interleaved_actions


def _function(exercise: str, *edits):
    """The solution's function with each (old, new) replaced once, defined as a notebook would."""
    return solution_function("04_pipeline_parallel", exercise, *edits,
                             imports="from reference.pipeline_parallel.schedules import Action\n")


def _score(spec, fn, seed=3, **changes):
    """The score as the grader weighs it: the homework's spec (its WRONG_KEEPS)."""
    spec = next((s for s in homework("04_pipeline_parallel") if s.id == spec.id), spec)
    return score_exercise(dataclasses.replace(spec, **changes), cloudpickle.dumps(fn), seed=seed,
                          timeout=TIMEOUT)


def test_homework_04_has_its_warm_ups_three_transfers_and_a_question():
    ids = [s.id for s in homework("04_pipeline_parallel")]
    assert ids == ["gpipe_actions", "one_f_one_b_actions", "interleaved_actions",
                   "zb_h1_actions", "balance_stages", "interleaved_peak_bytes"]


# ------------------------------------------------------------------ interleaved_actions

@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_the_course_interleaved_lists_pass_the_judge(pp):
    """No process: the course's own lists meet every rule, m below pp and multiples of it."""
    for v, m in itertools.product((2, 3, 4), list(range(1, pp)) + [pp, 2 * pp]):
        case = {"pp": pp, "m": m, "v": v}
        out = {"error": "", "actions": course_interleaved(case)}
        assert judge_interleaved([case], expect_interleaved([case]), [out], 1) == "", case


def test_interleaved_solution_scores_full_marks():
    score = _score(INTERLEAVED_ACTIONS, _function("interleaved_actions"))
    # 7 pipelines judged on one rank, 2 run on 2 ranks, 2 run on 3 ranks
    assert score.points == score.max == 11, score.failures


WARMUP = "warmup = min((v - 1) * g + 2 * (pp - 1 - rank), n)"


@pytest.mark.parametrize("edits, points, reason", [
    # 1F1B's warm-up: chunk v-1's backward comes before its forward on some rank, always.
    ([(WARMUP, "warmup = min(pp - 1 - rank, n)")], 0, "which it needs"),
    # One forward more than needed: more in flight; right only when it is capped at v m
    # everywhere (pp=2 m=1 v=3 holds all its 3 pairs anyway).
    ([(WARMUP, "warmup = min((v - 1) * g + 2 * (pp - 1 - rank) + 1, n)")], 1,
     "(micro-batch, chunk) pairs at once"),
    # All forwards first (GPipe with chunks): right only where everything fits the bound.
    ([(WARMUP, "warmup = n")], 1, "(micro-batch, chunk) pairs at once"),
    # The pair's messages split as in exercise 1: deadlocks or a larger bubble where a
    # steady state has forwards and backwards of different chunks crossing.
    ([("groups += [[nth(warmup + k, False), nth(k, True)] for k in range(n - warmup)]",
       "groups += [x for k in range(n - warmup) "
       "for x in ([nth(warmup + k, False)], [nth(k, True)])]")], 3, "deadlock"),
    # Backwards through the chunks in forward order: gradients arrive for the wrong chunk.
    ([("chunk = v - 1 - i // g if backward else i // g", "chunk = i // g")], 0,
     "invalid schedule"),
])
def test_interleaved_mistakes_lose_their_cases(edits, points, reason):
    score = _score(INTERLEAVED_ACTIONS, _function("interleaved_actions", *edits), **ONE_RANK)
    assert score.max == 7 and score.points == points, score.failures
    assert reason in score.reason, score.reason
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


def test_interleaved_may_not_build_the_course_schedule():
    def course(pp, m, v, rank):
        return build_schedule("interleaved", pp, m, v).actions(rank)
    score = _score(INTERLEAVED_ACTIONS, course, **ONE_RANK)
    assert score.points == 0 and "build_schedule" in score.reason, score.reason


def test_the_interleaved_run_is_compared_with_one_process():
    """Correct ranks pass; a gradient or the loss changed after the run fails the case."""
    cases = make_interleaved_cases(torch.Generator().manual_seed(3), 2)
    outputs = _launch_cases(INTERLEAVED_ACTIONS, cloudpickle.dumps(_function("interleaved_actions")),
                            2, cases, TIMEOUT, None)
    case = cases[0]
    want = expect_interleaved(case.inputs)
    got = outputs[case.name]
    assert all(o["ran"] for o in got)
    assert judge_interleaved(case.inputs, want, got, 2) == ""
    name = next(iter(got[0]["grads"]))
    nudged = [dict(got[0], grads=dict(got[0]["grads"], **{name: got[0]["grads"][name] + 1e-3})),
              got[1]]
    assert "rank 0's gradient of" in judge_interleaved(case.inputs, want, nudged, 2)
    off = [got[0], dict(got[1], loss=got[1]["loss"] * 1.001)]
    assert "the loss differs" in judge_interleaved(case.inputs, want, off, 2)


# ------------------------------------------------------------------ balance_stages

def test_the_course_cut_is_the_best_of_every_cut():
    """The dynamic programme against trying every cut, on the hidden cases of 4 seeds."""
    for seed in range(4):
        for case in make_balance_cases(torch.Generator().manual_seed(seed), 1):
            c = case.inputs[0]
            units = (c["times"], c["weight_bytes"], c["activation_bytes"])
            sizes = course_balance_stages(*units, c["pp"], c["m"], c["memory"])
            fastest, _, _ = best_cut(*units, c["pp"], c["m"], c["memory"])
            if fastest is None:
                assert sizes is None, case.name
                continue
            assert max(stage_memory(c["weight_bytes"], c["activation_bytes"], c["pp"], c["m"],
                                    sizes)) <= c["memory"]
            starts = list(itertools.accumulate([0] + sizes))
            assert max(sum(c["times"][a:b]) for a, b in zip(starts, starts[1:])) == fastest


def test_the_budgets_that_should_bind_do():
    """In the cases named so, the fastest cut without a budget does not fit in it."""
    for seed in range(4):
        for case in make_balance_cases(torch.Generator().manual_seed(seed), 1):
            c = case.inputs[0]
            units = (c["times"], c["weight_bytes"], c["activation_bytes"], c["pp"], c["m"])
            free, _, _ = best_cut(*units)
            bound, _, _ = best_cut(*units, c["memory"])
            if "binds" in case.name:
                assert bound is not None and bound > free, case.name
            if "nothing fits" in case.name:
                assert bound is None


def test_balance_solution_scores_full_marks():
    score = _score(BALANCE_STAGES, _function("balance_stages"))
    assert score.points == score.max == 9, score.failures


FITS = "held = min(pp - r, m)"


@pytest.mark.parametrize("edits, lost, reason", [
    # No budget: the three cases whose budget binds, and the one where nothing fits.
    ([(FITS, "return True")], 4, "micro-batches of activations"),
    # pp - r micro-batches even when m < pp: too cautious in the case where m < pp binds.
    ([(FITS, "held = pp - r")], 1, "m < pp"),
    # Balanced by weights instead of time: wrong wherever the two disagree (the chains
    # whose units differ in time and weight, budget or not; equal times agree).
    ([("found = (sum(times[i:]), [L - i])", "found = (sum(weight_bytes[i:]), [L - i])"),
      ("slowest = max(sum(times[i:j]), rest[0])", "slowest = max(sum(weight_bytes[i:j]), rest[0])")],
     3, "slowest"),
])
def test_balance_mistakes_lose_their_cases(edits, lost, reason):
    score = _score(BALANCE_STAGES, _function("balance_stages", *edits))
    assert score.max - score.points == lost, score.failures
    assert all(reason in f for f in score.failures), score.failures
    assert score.weighted() <= score.weight / 2  # each stated rule, broken alone: half lost


def test_balance_may_not_use_the_course_search():
    def planned(times, weight_bytes, activation_bytes, pp, m, memory):
        from reference.pipeline_parallel.stage import _min_max_cut
        return _min_max_cut(times, pp)
    score = _score(BALANCE_STAGES, planned)
    assert score.points == 0 and "calls the course's reference implementation" in score.reason


# ------------------------------------------------------------------ the written question

def test_the_peak_formula_is_what_the_course_schedule_holds():
    for pp, v, m, rank in itertools.product((2, 3, 4), (2, 3), (1, 2, 4, 8), range(4)):
        if rank < pp and (m < pp or m % pp == 0):
            peak = build_schedule("interleaved", pp, m, v).peak_in_flight(rank)
            assert interleaved_peak_bytes_formula(pp, m, v, rank, 12 * v) == peak * 12


def test_the_peak_question_is_graded_exactly():
    right = _score(INTERLEAVED_PEAK_BYTES, _function("interleaved_peak_bytes"))
    assert right.points == right.max == 9, right.failures

    def one_f_one_b(pp, m, v, rank, stage_bytes):  # 1F1B's peak
        return min(pp - rank, m) * stage_bytes
    # Equal only where interleaving holds every micro-batch anyway (all v m pairs, m <= pp - rank):
    # exactly those cases pass, and they are not all.
    cases = [c.inputs[0] for c in
             INTERLEAVED_PEAK_BYTES.make_cases(_generator(3, "interleaved_peak_bytes", 1), 1)]
    agree = sum(one_f_one_b(**c) == interleaved_peak_bytes_formula(**c) for c in cases)
    assert any(c["m"] >= c["pp"] for c in cases) and 0 < agree < len(cases)
    assert _score(INTERLEAVED_PEAK_BYTES, one_f_one_b).points == agree

    uncapped = _function("interleaved_peak_bytes", (
        "pairs = min((v - 1) * g + 2 * (pp - 1 - rank) + 1, v * m)",
        "pairs = (v - 1) * g + 2 * (pp - 1 - rank) + 1"))
    score = _score(INTERLEAVED_PEAK_BYTES, uncapped)  # wrong where m is tiny (fixed: m = 1, 2)
    assert 0 < score.points < score.max and score.failures


def test_visible_checks_print_pass_and_fail(capsys):
    from reference.course.checks.pipeline_parallel import (
        check_balance_stages, check_interleaved_actions, check_interleaved_peak_bytes,
    )
    check_interleaved_actions(_function("interleaved_actions", (WARMUP, "warmup = n")))
    check_balance_stages(_function("balance_stages"))
    check_balance_stages(_function("balance_stages", (FITS, "return True")))
    check_interleaved_peak_bytes(lambda **kw: 1.5)
    out = capsys.readouterr().out
    assert "FAIL interleaved_actions" in out and "hint: a rank holds more (micro-batch, chunk) pairs" in out
    assert "PASS balance_stages" in out
    assert "FAIL balance_stages" in out and "hint: under 1F1B stage r keeps" in out
    assert "FAIL interleaved_peak_bytes" in out and "whole number" in out


def test_the_notebook_example_sheds_blocks_from_stage_0_under_a_budget():
    """The example printed under exercise 4: with 800 MB per rank, stage 0 (4 micro-batches
    in flight) holds fewer units than without a budget, and the pipeline is slower."""
    times, weights = [1] + [10] * 6 + [22], [400] + [120] * 6 + [400]
    activations = [2] + [25] * 6 + [80]
    free = course_balance_stages(times, weights, activations, 4, 8, 10**9)
    tight = course_balance_stages(times, weights, activations, 4, 8, 800)
    assert tight[0] < free[0]
    nb = nbformat.read(SOLUTION, as_version=4)
    example = next(c.source for c in nb.cells if c.get("id") == "ex4-check")  # the same numbers
    assert "[1] + [10] * 6 + [22]" in example and "(10**9, 800)" in example
