"""Every homework: its solution scores full marks, its generated exercise scores zero.

One grader run over every notebook in solutions/ and exercises/ except homework 00,
whose solution and exercise tests/test_course_grade.py already grades among the hostile
submissions. Each solution notebook must have hidden checks in reference.course.homework,
and each set of hidden checks a solution notebook.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference.course.homework import HOMEWORK

ROOT = Path(__file__).resolve().parent.parent
GRADED_ELSEWHERE = {"00_collectives"}
SOLUTIONS = sorted(p for p in (ROOT / "solutions").glob("*.ipynb")
                   if p.stem not in GRADED_ELSEWHERE)


def test_every_solution_has_hidden_checks_and_back():
    stems = {p.stem for p in (ROOT / "solutions").glob("*.ipynb")}
    assert stems == set(HOMEWORK)
    assert {p.stem for p in (ROOT / "exercises").glob("*.ipynb")} == stems


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if not SOLUTIONS:
        pytest.skip("no homework besides 00")
    out = tmp_path_factory.mktemp("grades") / "results.json"
    paths = [str(p) for p in SOLUTIONS] + [str(ROOT / "exercises" / p.name) for p in SOLUTIONS]
    run = subprocess.run([sys.executable, "-m", "reference.course", "grade", *paths, "--out", str(out),
                          "--jobs", "2", "--quiet"], cwd=out.parent, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {(Path(s["path"]).parent.name, Path(s["path"]).stem): s
            for s in json.loads(out.read_text())["submissions"]}


# The first test that asks for `graded` pays for grading every homework.
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("stem", [p.stem for p in SOLUTIONS])
def test_solution_scores_full_marks(graded, stem):
    result = graded[("solutions", stem)]
    assert result["max"] > 0 and result["total"] == result["max"], json.dumps(result, indent=1)
    assert [e["id"] for e in result["exercises"]] == [e.id for e in HOMEWORK[stem]]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("stem", [p.stem for p in SOLUTIONS])
def test_exercise_scores_zero_with_not_implemented(graded, stem):
    result = graded[("exercises", stem)]
    assert result["max"] > 0 and result["total"] == 0, json.dumps(result, indent=1)
    for exercise in result["exercises"]:
        assert "not implemented" in exercise["reason"], exercise
