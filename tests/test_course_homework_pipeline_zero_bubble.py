"""Homework 04's zero-bubble exercise (`zb_h1_actions`): the solution earns every point, the
plausible wrong answers keep at most half, and the judge agrees with the course's ZB-H1.

Every wrong answer is the solution's function with one change. The solution is scored by the
grader itself (`score_exercise`); the wrong answers share one launch per world size (the
grader's cases, `call` and `judge`, each answer's outputs judged as the grader judges them),
and their score is weighed as the grader weighs it (`ExerciseScore`, the homework's
WRONG_KEEPS).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch.distributed as dist

from reference.course.homework import homework
from reference.course.homework.guard import exercise_rules
from reference.course.homework.pipeline_zero_bubble import (
    TIMES, course_zb_h1, expect_zb_h1, judge_zb_h1, zb_schedule_of,
)
from reference.course.homework.refuse import refusal_for
from reference.course.homework.scoring import ExerciseScore, _generator, score_exercise, weight
from reference.pipeline_parallel.registry import build_schedule
from reference.pipeline_parallel.zero_bubble import build_zb_h1, zero_bubble_formula
from reference.runtime import launch
from solution_cells import solution_source

STEM = "04_pipeline_parallel"
SPEC = next(s for s in homework(STEM) if s.id == "zb_h1_actions")  # with WRONG_KEEPS
TIMEOUT = 60  # s per launch; each needs a few seconds on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)
SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / f"{STEM}.ipynb"


def _function(*edits):
    """The solution's zb_h1_actions with each (old, new) replaced once, beside exercise 1's
    add_messages (which it calls), defined as a notebook would: pickled by value."""
    source = solution_source(STEM, "zb_h1_actions")
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    namespace = {"__name__": "student"}
    exec("from reference.pipeline_parallel.schedules import Action\n"
         + solution_source(STEM, "gpipe_actions") + "\n" + source, namespace)
    return namespace["zb_h1_actions"]


DEFER = "if len(waiting) > rank or warmup + mb >= m:"
WRONG = {
    # 1F1B with B split in place: the I a neighbour waits for comes after a W.
    "every W right after its I": ([(DEFER, "if True:")], "idle share"),
    # Nothing freed until the end: every rank holds all m micro-batches.
    "every W put off to the end": ([(DEFER, "if False:")], "from F to W"),
    # The W's put off on the wrong ranks: rank 0 (whose end is not idle) holds 2 pp - 1.
    "pp - 1 - r W's put off on rank r": ([("len(waiting) > rank", "len(waiting) > pp - 1 - rank")],
                                         "from F to W"),
    # A rank's W popped before its own I is appended: rank 0 runs W0 before I0.
    "a W before its I": ([("""        order.append(("I", mb))
        waiting.append(mb)
""", """        waiting.append(mb)
"""), ("""            order.append(("W", waiting.pop(0)))
""", """            order.append(("W", waiting.pop(0)))
        order.append(("I", mb))
""")], "which it needs"),
    # The W's put off never run: the weights' gradients of the last micro-batches are lost.
    "the W's put off missing": ([("order += [(\"W\", mb) for mb in waiting]", "pass")], "never runs W"),
    # 1F1B handed in: the backward not split.
    "whole B's": ([("""            actions += [Action("I", mb) if a.op == "B" else a
                        for a in add_messages([("B" if op == "I" else op, mb)], pp, rank)]""",
                    """            actions += add_messages([("B" if op == "I" else op, mb)], pp, rank)"""),
                   ("""            actions.append(Action("W", mb))""", """            pass""")], "runs B"),
}


def _several_answers(answers: bytes, inputs: dict) -> dict:
    """In each rank: every answer's output for this rank's input of every case, under the
    exercise's rules, as the grader's `_rank_entry` does for one answer. It travels by value
    (below): a rank imports nothing of the tests (pytest alone costs seconds a rank)."""
    rank, refusal = dist.get_rank(), refusal_for(SPEC)
    out = {}
    with exercise_rules(SPEC.id, SPEC.forbidden):
        for name, fn in cloudpickle.loads(answers).items():
            for case, per_rank in inputs.items():
                out[name, case] = refusal.run(SPEC.call, fn, per_rank[rank])
    return out


cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def launched():
    """{(answer, world size): ([Case], [per-rank outputs by (answer, case name)])} for the
    solution and every wrong answer, from one launch per world size."""
    answers = {"right": _function(), **{name: _function(*edits) for name, (edits, _) in WRONG.items()}}
    out = {}
    for world_size in SPEC.world_sizes:
        cases = SPEC.make_cases(_generator(3, SPEC.id, world_size), world_size)
        out[world_size] = cases, launch(_several_answers, world_size, cloudpickle.dumps(answers),
                                        {c.name: c.inputs for c in cases}, timeout=TIMEOUT, quiet=True)
    return out


@pytest.fixture(scope="module")
def scores(launched):
    """{answer: ExerciseScore}, judged and weighed as the grader does."""
    failures = {name: [] for name in ["right", *WRONG]}
    total = 0
    for world_size, (cases, ranks) in launched.items():
        total += len(cases)
        for case in cases:
            want = expect_zb_h1(case.inputs)
            for name in failures:
                why = judge_zb_h1(case.inputs, want, [r[name, case.name] for r in ranks], world_size)
                if why:
                    failures[name].append(f"{world_size} ranks, {case.name}: {why}")
    return {name: ExerciseScore(SPEC.id, total - len(lost), total, lost[0] if lost else "", lost,
                                weight(SPEC), wrong_keeps=SPEC.wrong_keeps)
            for name, lost in failures.items()}


def test_homework_04_lists_zb_h1_as_a_medium_exercise():
    ids = [s.id for s in homework(STEM)]
    assert ids.index("zb_h1_actions") == ids.index("interleaved_actions") + 1
    assert weight(SPEC) == 4 and SPEC.wrong_keeps == 0.5 and SPEC.world_sizes == (2, 4)


def test_the_cases_cover_every_m_from_pp_to_2pp_plus_1_and_run_on_2_and_4():
    names = {ws: [c.name for c in SPEC.make_cases(_generator(0, SPEC.id, ws), ws)]
             for ws in SPEC.world_sizes}
    covered = {(int(n.split()[0][3:]), int(n.split()[1][2:])) for ns in names.values() for n in ns}
    assert covered == {(pp, m) for pp in (2, 3, 4) for m in range(pp, 2 * pp + 2)}
    assert all("run" in n for n in names[4]) and len(names[4]) == 2
    assert all(("run" in n) == n.startswith("pp=2") for n in names[2])


def test_the_course_lists_pass_the_judge_and_the_solution_writes_them():
    """No process: the course's ZB-H1 meets every rule, with the idle share of its formula,
    and the solution's lists are the course's, action for action (messages included)."""
    fn = _function()
    for pp in (2, 3, 4, 5):
        for m in range(pp, 2 * pp + 2):
            case = {"pp": pp, "m": m}
            out = {"error": "", "actions": course_zb_h1(case)}
            assert judge_zb_h1([case], expect_zb_h1([case]), [out], 1) == "", case
            s = build_zb_h1(pp, m)
            assert all(fn(pp, m, r) == s.actions(r) for r in range(pp)), case
            assert s.bubble_fraction(*TIMES) == pytest.approx(zero_bubble_formula("zb-h1", pp, m, *TIMES))


def test_the_solution_scores_full_marks():
    score = score_exercise(SPEC, cloudpickle.dumps(_function()), seed=3, timeout=TIMEOUT)
    assert score.points == score.max == 17 and score.weighted() == 4, score.failures


def test_the_solution_passes_every_case_of_the_shared_launch(scores):
    assert scores["right"].points == scores["right"].max == 17, scores["right"].failures


@pytest.mark.parametrize("name", list(WRONG))
def test_each_wrong_answer_keeps_at_most_half(scores, name):
    score, reason = scores[name], WRONG[name][1]
    assert score.max == 17 and score.points < score.max, score.failures
    assert score.weighted() <= score.weight / 2
    assert any(reason in f for f in score.failures), score.failures


def test_the_wrong_answers_lose_every_case(scores):
    """Each of them breaks a rule that every case shows: none keeps a point."""
    assert {name: scores[name].points for name in WRONG} == {name: 0 for name in WRONG}


def test_the_judge_compares_the_run_with_one_process(launched):
    """The solution's runs pass; a gradient nudged, or the loss changed, after a run fails."""
    for world_size, (cases, ranks) in launched.items():
        case = next(c for c in cases if "run" in c.name)
        got, want = [r["right", case.name] for r in ranks], expect_zb_h1(case.inputs)
        assert all(o["ran"] for o in got) and judge_zb_h1(case.inputs, want, got, world_size) == ""
        name = next(iter(got[0]["grads"]))
        nudged = [dict(got[0], grads=dict(got[0]["grads"], **{name: got[0]["grads"][name] + 1e-3})),
                  *got[1:]]
        assert "rank 0's gradient of" in judge_zb_h1(case.inputs, want, nudged, world_size)
        off = [*got[:-1], dict(got[-1], loss=got[-1]["loss"] * 1.001)]
        assert "the loss differs" in judge_zb_h1(case.inputs, want, off, world_size)


def test_a_wrong_answer_costs_no_run(launched):
    """Lists that break a rule a list shows are not run: a wrong answer costs the grader no
    executor, and the judge still says why from the lists."""
    for world_size, (cases, ranks) in launched.items():
        for case in (c for c in cases if "run" in c.name):
            assert not any(r[name, case.name]["ran"] for r in ranks for name in WRONG)


def test_the_worked_example_is_the_course_schedule_and_the_text_says_it():
    from reference.course.checks.pipeline_parallel import ZB_WORKED

    pp, m = ZB_WORKED["pp"], ZB_WORKED["m"]
    s = build_zb_h1(pp, m).validate()
    assert s.bubble_fraction(*TIMES) == pytest.approx(ZB_WORKED["bubble"]) == pytest.approx(2 / 14)
    assert [s.peak_in_flight(r) for r in range(pp)] == [ZB_WORKED["rank0_peak"]] * pp
    assert build_schedule("1f1b", pp, m).bubble_fraction(*TIMES) == pytest.approx(6 / 18)
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(SOLUTION.read_text())["cells"]}
    text = cells["zb-text"]
    assert "`pp = 3`, `m = 4`" in text and "**2/14 = 14.3 %**" in text and "**3**" in text
    assert "of a makespan of 18, 33.3 %" in text and "The rules, all checked:" in text
    assert "zb_h1_actions(3, 4, r)" in cells["zb-check"]


def test_visible_check_passes_the_solution_and_fails_a_wrong_worked_example(capsys):
    from reference.course.checks.pipeline_parallel import check_zb_h1_actions

    check_zb_h1_actions(_function(), world_sizes=())  # the lists here; the runs are tested above
    check_zb_h1_actions(_function(*WRONG["every W right after its I"][0]), world_sizes=())
    check_zb_h1_actions(_function(*WRONG["a W before its I"][0]), world_sizes=())
    out = capsys.readouterr().out
    assert "PASS zb_h1_actions" in out
    assert "FAIL zb_h1_actions: the text's worked example (pp=3, m=4): idle share 0.250" in out
    assert "hint: a rank idles where a W could run" in out
    assert "hint: an action comes before what it needs (a W before its I?)" in out
