"""Numeric questions: graded exactly (ints) or to QUESTION_RTOL relative (reals, a float64's last
bits), on hidden parameters."""
import cloudpickle

from reference.course.homework.questions import judge_number, question
from reference.course.homework.scoring import score_exercise


def _ring_bytes(n_elements, world_size, bytes_per_element):
    return 2 * (world_size - 1) * -(-n_elements // world_size) * bytes_per_element


SPEC = question("ring_bytes", "bytes a rank sends", _ring_bytes,
                {"n_elements": (7, 100, 1001), "world_size": (2, 3, 8),
                 "bytes_per_element": (2, 4)}, n_cases=3,
                fixed=({"n_elements": 1, "world_size": 1, "bytes_per_element": 4},))


def _score(fn):
    return score_exercise(SPEC, cloudpickle.dumps(fn), seed=7, timeout=60)


def test_right_formula_earns_every_point_and_wrong_or_float_answers_earn_none():
    right = _score(_ring_bytes)
    assert (right.points, right.max) == (4, 4), right.failures
    # The formula without the ceiling is wrong wherever n does not divide.
    wrong = _score(lambda n_elements, world_size, bytes_per_element:
                   2 * (world_size - 1) * n_elements // world_size * bytes_per_element)
    assert wrong.points < wrong.max and "wrong number" in wrong.reason
    as_float = _score(lambda **kw: float(_ring_bytes(**kw)))
    assert as_float.points == 0 and "whole number" in as_float.reason


def test_judge_number_rules():
    assert judge_number(3, 3, "int") == ""
    assert judge_number(True, 1, "int") != ""          # a bool is not a count
    assert judge_number(0.1 + 0.2, 0.3, "real") == ""   # rounding in the last bits forgiven
    assert judge_number(0.3 + 1e-7, 0.3, "real") == "wrong number"
    assert judge_number(float("nan"), 0.3, "real") != ""


def test_visible_question_check_without_worked_values_says_kind(capsys):
    from reference.course.checks.questions import check_question
    example = {"n_elements": 10, "world_size": 4, "bytes_per_element": 4}
    assert check_question(SPEC, _ring_bytes, example) is True
    assert check_question(SPEC, lambda **kw: 1, example) is True      # wrong, but an int
    assert check_question(SPEC, lambda **kw: 1.5, example) is False
    assert check_question(SPEC, lambda **kw: "12", example) is False
    out = capsys.readouterr().out
    assert "whole number" in out and "not a number" in out
    assert check_question(SPEC, _ring_bytes, example, skip=True) is None
