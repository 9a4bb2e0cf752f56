"""Every homework: its solution scores full marks, and a partly finished notebook earns
exactly the points of the exercises it finished.

One grader run over every notebook in solutions/ and one partly finished homework 00
(tests/test_course_grade.py grades the hostile submissions, on homework 00's ring exercises,
the exercise notebook among them). Every generated exercise notebook scores zero, each exercise
"not implemented": tests/test_course_exercises.py scores the functions the grader saves from
its one Run All of each (executing them again here would only repeat it). Each solution
notebook must have hidden checks in reference.course.homework, and each set of hidden checks
a solution notebook.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from reference.course.homework import HOMEWORK
from reference.course.homework.scoring import weight

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
PARTLY = "00_collectives"
FINISHED = ("ring_all_reduce", "tree_all_reduce", "ring_doubling_crossover")  # the rest: stubs


def test_every_solution_has_hidden_checks_and_back():
    stems = {p.stem for p in SOLUTIONS}
    assert stems == set(HOMEWORK)
    assert {p.stem for p in (ROOT / "exercises").glob("*.ipynb")} == stems


def _partly_finished(folder: Path) -> Path:
    """The exercise notebook with the answers of FINISHED copied from the solution."""
    solution = nbformat.read(ROOT / "solutions" / f"{PARTLY}.ipynb", 4)
    exercise = nbformat.read(ROOT / "exercises" / f"{PARTLY}.ipynb", 4)
    answers = {c.metadata["course"]["exercise"]: c.source for c in solution.cells
               if c.metadata.get("course", {}).get("exercise") in FINISHED}
    for cell in exercise.cells:
        if cell.metadata.get("course", {}).get("exercise") in answers:
            cell.source = answers[cell.metadata["course"]["exercise"]]
    path = folder / f"{PARTLY}_partly.ipynb"
    nbformat.write(exercise, path)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    out = tmp_path_factory.mktemp("grades") / "results.json"
    partly = _partly_finished(out.parent)
    paths = [str(p) for p in SOLUTIONS]
    run = subprocess.run([sys.executable, "-m", "reference.course", "grade", *paths, str(partly),
                          "--out", str(out), "--jobs", "2", "--quiet"], cwd=out.parent,
                         capture_output=True, text=True, timeout=1400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {(Path(s["path"]).parent.name, Path(s["path"]).stem): s
            for s in json.loads(out.read_text())["submissions"]}


# The first test that asks for `graded` pays for grading every homework.
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("stem", [p.stem for p in SOLUTIONS])
def test_solution_scores_full_marks(graded, stem):
    result = graded[("solutions", stem)]
    assert [e["id"] for e in result["exercises"]] == [e.id for e in HOMEWORK[stem]]
    # Every exercise at its weight; the maximum leaves a bonus out, the total counts it.
    specs = HOMEWORK[stem]
    assert [e["points"] for e in result["exercises"]] == [weight(s) for s in specs], \
        json.dumps(result, indent=1)
    assert result["max"] == sum(weight(s) for s in specs if not s.bonus) > 0
    assert result["total"] == sum(weight(s) for s in specs) >= result["max"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_partly_finished_notebook_earns_the_finished_exercises_points(graded):
    [result] = [s for (_, stem), s in graded.items() if stem == f"{PARTLY}_partly"]
    weights = {s.id: weight(s) for s in HOMEWORK[PARTLY]}
    by_id = {e["id"]: e for e in result["exercises"]}
    for exercise_id, e in by_id.items():
        if exercise_id in FINISHED:
            assert e["points"] == weights[exercise_id] and e["reason"] == "", e
        else:
            assert e["points"] == 0 and "not implemented" in e["reason"], e
    assert result["total"] == sum(weights[i] for i in FINISHED) < result["max"]
    assert result["note"] == ""  # its unfinished cells did not stop the run


# ----------------------------------------------------------------- the weights, stated in the notebook

HEADER_LINE = re.compile(r"^\d+\. `(\w+)` ([★☆]{3}) \((\d+) points?(, bonus)?")


@pytest.mark.parametrize("stem", [p.stem for p in SOLUTIONS])
def test_the_notebook_states_each_exercise_weight_and_stars(stem):
    """The list at the top of each homework: every exercise, its stars, its points, as graded."""
    nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", 4)
    stated = {}
    for line in nb.cells[0].source.splitlines():
        if match := HEADER_LINE.match(line):
            stated[match[1]] = (match[2], int(match[3]), bool(match[4]))
    graded = {s.id: (s.difficulty.split()[0], weight(s), s.bonus) for s in HOMEWORK[stem]}
    assert stated == graded
