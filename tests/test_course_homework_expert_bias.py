"""Homework 05's exercise balanced_step (DeepSeek-V3's bias, moved by a whole step's load):
the solution notebook's answer earns every point, the course's own answer and the `Router`
the checks compare with agree with the text's worked example, and each plausible mistake
keeps at most half of the exercise (WRONG_KEEPS).

Every wrong answer is the solution's function with one change. Those that run on any group
are scored together, in one launch of 3 ranks (`_together`: every case once per answer,
graded by the real grader, the answers told apart by the case's name); the one that forgets
`group=` would hang there, so it is scored alone on the subgroup case, with a short timeout.
"""
from __future__ import annotations

import dataclasses
import functools

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from reference.course.checks.expert_parallel import WORKED_BALANCED_STEP, WORKED_NEW_BIAS
from reference.course.homework import homework
from reference.course.homework.expert_bias import (
    GAP, call_balanced_step, course_balanced_step, expect_balanced_step,
    judge_balanced_step, make_balanced_step_cases,
)
from reference.course.homework.scoring import Case, ExerciseScore, score_exercise
from reference.course.homework.subgroup import MEMBERS
from reference.runtime import launch
from solution_cells import solution_function

TIMEOUT = 60  # s per launch; each needs a few seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)
IMPORTS = "import torch\nimport torch.distributed as dist\n"
SPEC = next(s for s in homework("05_expert_parallel") if s.id == "balanced_step")  # as graded


def _function(*edits):
    """The solution's balanced_step with each (old, new) replaced once."""
    return solution_function("05_expert_parallel", "balanced_step", *edits, imports=IMPORTS)


def _score(spec, fn, timeout=TIMEOUT, **changes):
    return score_exercise(dataclasses.replace(spec, **changes), cloudpickle.dumps(fn), seed=5,
                          timeout=timeout)


def _inner(x):
    return x["input"] if isinstance(x, dict) and MEMBERS in x and "input" in x else x


# ------------------------------------------------------------------ the exercise and its oracle

def test_homework_05_grades_the_bias_exercise_last_at_four_points():
    spec = homework("05_expert_parallel")[-1]
    assert spec.id == "balanced_step" and spec.wrong_keeps == 0.5
    assert spec.difficulty.startswith("★★☆") and not spec.bonus
    assert set(spec.forbidden) and "all_reduce" not in spec.forbidden


def test_the_router_gives_the_text_s_worked_example():
    """The text's table and new bias, as the course's Router (the checks' oracle) gives them."""
    expected = expect_balanced_step(WORKED_BALANCED_STEP.inputs)
    assert expected[0]["loads"].tolist() == [2, 1, 1, 4]
    assert [i.tolist() for i in expected[0]["expert_idx"]] == [[[0, 3]], [[1, 3]]]
    assert [i.tolist() for i in expected[1]["expert_idx"]] == [[], [[2, 3], [3, 0]]]
    assert torch.allclose(expected[1]["weights"][1], torch.tensor([[5 / 6, 1 / 6], [4 / 7, 3 / 7]]))
    for mine in expected:
        assert torch.allclose(mine["new_bias"], torch.tensor(WORKED_NEW_BIAS))


def test_the_cases_have_no_near_ties_and_show_each_rule():
    """Every token's top k + 1 biased scores at least GAP apart; an empty micro-batch, k = 1, 2
    and 3, an expert exactly at the mean (its bias stays) and one that moves both ways."""
    for world_size in (2, 3):
        for seed in range(3):
            cases = make_balanced_step_cases(torch.Generator().manual_seed(seed), world_size)
            ks, empty = set(), False
            for case in cases:
                inputs = [_inner(x) for x in case.inputs if "probs" in _inner(x)]
                ks.add(inputs[0]["k"])
                assert len({len(x["probs"]) for x in inputs}) == 1  # as many micro-batches
                for x in inputs:
                    for p in x["probs"]:
                        empty |= p.shape[0] == 0
                        top = (p.double() + x["bias"].double()).sort(dim=-1, descending=True).values
                        gaps = top[:, :x["k"]] - top[:, 1:x["k"] + 1]
                        assert bool((gaps >= GAP).all()), case.name
                loads = expect_balanced_step(inputs)[0]["loads"]
                moved = torch.sign(loads.double().mean() - loads.double())
                if "mean" in case.name:
                    assert (moved == 0).any() and (moved != 0).any(), (case.name, loads)
            assert ks == {1, 2, 3} and empty


def _course_answer(cases):
    """In a plain rank (no rules, no refusal): the course's answer through the exercise's call."""
    rank = dist.get_rank()
    return {c.name: call_balanced_step(course_balanced_step, c.inputs[rank]) for c in cases}


def test_the_course_answer_passes_the_hidden_judge():
    cases = make_balanced_step_cases(torch.Generator().manual_seed(0), 2) + [WORKED_BALANCED_STEP]
    results = launch(_course_answer, 2, cases, timeout=TIMEOUT, quiet=True)
    for case in cases:
        outs = [r[case.name] for r in results]
        assert judge_balanced_step(case.inputs, expect_balanced_step(case.inputs), outs, 2) == "", \
            case.name


def test_the_solution_scores_full_marks():
    score = _score(SPEC, _function())
    # 5 cases on 2 and on 3 ranks, and on 3 two of them again on the subgroup of ranks 1, 2
    assert score.points == score.max == 12, score.failures
    assert score.weighted() == 4


# ------------------------------------------------------------------ the mistakes

MISTAKES = {
    # the counts of each micro-batch move the bias after that micro-batch (m moves a step)
    "per micro-batch": ((
        ("        counts += torch.bincount(idx.reshape(-1), minlength=E)\n",
         "        step = torch.bincount(idx.reshape(-1), minlength=E)\n"
         "        dist.all_reduce(step, group=group)\n"
         "        step = step.to(bias.dtype)\n"
         "        bias = bias + rate * torch.sign(step.mean() - step)\n"),
        ("    dist.all_reduce(counts, group=group)", "    pass"),
        ("return chosen, combine, bias + rate * torch.sign(load.mean() - load)",
         "return chosen, combine, bias")), ("experts", "new_bias")),
    # the bias in the combine weights: they are probs + bias renormalised
    "bias in the weights": ((("top = p.gather(-1, idx)", "top = (p + bias).gather(-1, idx)"),),
                            ("weights",)),
    # this rank's counts only
    "no all_reduce": ((("    dist.all_reduce(counts, group=group)", "    pass"),), ("new_bias",)),
    # the sign reversed: an overloaded expert pulled further up
    "sign reversed": ((("torch.sign(load.mean() - load)", "torch.sign(load - load.mean())"),),
                      ("new_bias",)),
    # the load as the combine weight each expert got, not the assignments it got
    "load from the weights": ((
        ("counts = torch.zeros(E, dtype=torch.int64)", "counts = torch.zeros(E)"),
        ("counts += torch.bincount(idx.reshape(-1), minlength=E)",
         "counts += torch.zeros(E).index_add(0, idx.reshape(-1), combine[-1].reshape(-1))")),
        ("new_bias",)),
}
WORLD = "the world, not the group"
WORLD_EDIT = ("dist.all_reduce(counts, group=group)", "dist.all_reduce(counts)")


def _together(spec, names: tuple, whole_world_only: tuple = ()):
    """`spec` with every case once per answer in `names` (named "answer: case"), so that one
    launch per world size scores them all; the function it grades takes the answer's name
    first. The answers in `whole_world_only` skip the subgroup cases."""
    def make_cases(generator, world_size):
        cases = spec.make_cases(generator, world_size)
        return [Case(f"{name}: {c.name}", [{"answer": name, "input": x} for x in c.inputs])
                for name in names for c in cases
                if not (name in whole_world_only and "subgroup" in c.name)]

    inner_call = spec.call  # a closure cell: the refusal lets the grader's call reach it

    def call(fn, case):
        return inner_call(functools.partial(fn, case["answer"]), case["input"])

    def expect(inputs):
        return spec.expect([x["input"] for x in inputs])

    def judge(inputs, expected, outputs, world_size):
        return spec.judge([x["input"] for x in inputs], expected, outputs, world_size)

    return dataclasses.replace(spec, make_cases=make_cases, call=call, expect=expect, judge=judge)


def _answers(table: dict):
    def answer(name, *args, **kwargs):
        return table[name](*args, **kwargs)
    return answer


def test_each_mistake_keeps_at_most_half_and_the_world_passes_the_whole_world():
    """One launch of 3 ranks: 5 cases on the world and 2 on the subgroup of ranks 1, 2, for
    each mistake; the answer that uses the world's group instead of `group=` on the 5 cases of
    the whole world only, where it is right (the next test shows the subgroup's)."""
    table = {name: _function(*edits) for name, (edits, _) in MISTAKES.items()}
    table[WORLD] = _function(WORLD_EDIT)
    names = tuple(table)
    spec = _together(SPEC, names, whole_world_only=(WORLD,))
    score = _score(spec, _answers(table), world_sizes=(3,))
    assert score.max == 7 * len(MISTAKES) + 5
    assert "raised" not in score.reason, score.reason
    for name, (_, words) in MISTAKES.items():
        lost = [f for f in score.failures if f.startswith(f"3 ranks, {name}: ")]
        mine = ExerciseScore(id=name, points=7 - len(lost), max=7, weight=4,
                             wrong_keeps=SPEC.wrong_keeps)
        assert lost and mine.weighted() <= 2, (name, score.failures)
        assert all(any(w in f for w in words) for f in lost), (name, lost)
    assert not [f for f in score.failures if f.startswith(f"3 ranks, {WORLD}: ")], score.failures


HANG = 12  # s: a launch that hangs waits this long; the others finish in a few seconds


def test_the_world_instead_of_the_group_loses_the_subgroup_case_named_and_only_it():
    """Without group= the all-reduce waits for global rank 0, which is not in the group. The
    subgroup case runs in a launch of its own: the grader names it as the one that hung, and
    the 5 cases of the whole world, right, keep their points."""
    spec = dataclasses.replace(SPEC, make_cases=lambda g, w, make=SPEC.make_cases: (
        lambda cases: [c for c in cases if not c.alone] + [c for c in cases if c.alone][:1])(make(g, w)))
    score = _score(spec, _function(WORLD_EDIT), timeout=HANG, world_sizes=(3,))
    assert (score.max, score.points) == (6, 5), score.failures
    (failure,) = score.failures
    assert "on the subgroup of global ranks [1, 2]" in failure and "this case alone" in failure, failure
    assert "subgroup" in score.reason and "group=group" in score.reason, score.reason
    # even were every other case of the grader's 12 passed, it keeps at most half
    whole = ExerciseScore(id=WORLD, points=12 - 2, max=12, weight=4,
                          wrong_keeps=SPEC.wrong_keeps)
    assert whole.weighted() <= 2


def test_the_visible_check_runs_a_subgroup_case_and_names_it_when_it_hangs(capsys):
    from reference.course.checks.expert_parallel import check_balanced_step
    check_balanced_step(_function(WORLD_EDIT), world_sizes=(3,), timeout=HANG)
    out = capsys.readouterr().out
    assert "FAIL balanced_step: on 3 ranks: timed out" in out, out
    assert "on the subgroup of global ranks [1, 2]" in out and "pass group=group" in out, out


def test_balanced_step_may_use_only_all_reduce():
    def gathered(probs, bias, k, rate, group=None):
        import torch.distributed as dist
        dist.broadcast(bias.clone(), src=0, group=group)
        return [], [], bias
    score = _score(SPEC, gathered, world_sizes=(2,))
    assert score.points == 0 and "not allowed" in score.reason


def test_visible_check_passes_the_solution_and_fails_on_the_worked_example(capsys):
    from reference.course.checks.expert_parallel import check_balanced_step
    check_balanced_step(_function(), world_sizes=(2,))
    check_balanced_step(_function(*MISTAKES["sign reversed"][0]), world_sizes=(2,))
    out = capsys.readouterr().out
    assert "PASS balanced_step" in out
    assert "FAIL balanced_step: on 2 ranks, the text's worked example: rank 0: new_bias" in out
    assert "hint: the new bias differs" in out
