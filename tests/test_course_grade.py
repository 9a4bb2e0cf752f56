"""The grader: full marks for the solution, zero for the exercise, and no way to cheat it.

Every hostile submission is the real solution or exercise notebook of homework 00 with one
change. All of them are graded in ONE run of the command (`python -m reference.course grade
... --jobs 3`, a module fixture), on the two ring exercises only (`--exercise`): what a
hostile notebook does is the same for every exercise, and the other three would cost
launches and say nothing more. Each test then asserts on its own submission. Every
exercise of every homework, the solutions at full marks and a partly finished notebook, are
graded in tests/test_course_homework.py; every generated exercise notebook at zero in
tests/test_course_exercises.py (from its one Run All).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest

from reference.course.report import format_table
from reference.course.grade_runner import GRADER_TAG, prepare
from reference.course.homework import HOMEWORK
from reference.course.homework.collectives import ALL_REDUCE
from reference.course.homework.scoring import score_exercise, weight

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "00_collectives.ipynb"
EXERCISE = ROOT / "exercises" / "00_collectives.ipynb"
IDS = ["ring_all_reduce", "ring_all_gather"]  # the exercises this batch grades
WEIGHTS = {spec.id: weight(spec) for spec in HOMEWORK["00_collectives"] if spec.id in IDS}
MARKER = f"course-grade-orphan-{uuid.uuid4().hex[:12]}"  # in the command line of every sleeper
NOTEBOOK_TIMEOUT = 45     # s; the two-exercise notebooks need ~5 s, ~15 s on a loaded 2-core machine
CHECK_TIMEOUT = 20        # s per hidden-check launch (~1 s needed, ~5 s loaded): only the hanging case waits
# Submissions graded at once: "loops" sleeps for all of NOTEBOOK_TIMEOUT and "hangs" for one
# CHECK_TIMEOUT, idle; a third slot keeps two notebooks at work beside them on 2 cores.
JOBS = 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the fixture grades 11 files
FAKE = '{"submissions": [{"path": "fake", "total": 999, "max": 36}]}'
SLEEPER = f"[sys.executable, '-c', 'import time; time.sleep(600)', {MARKER!r}]"


def _load(path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _index(nb, cell_id) -> int:
    return next(i for i, c in enumerate(nb.cells) if c.get("id") == cell_id)


def _insert_after(nb, cell_id, source):
    nb.cells.insert(_index(nb, cell_id) + 1, nbformat.v4.new_code_cell(source))
    return nb


def _replace_in(nb, cell_id, old, new):
    cell = nb.cells[_index(nb, cell_id)]
    assert old in cell.source
    cell.source = cell.source.replace(old, new, 1)
    return nb


def _edit_checks(nb):
    for cell_id in ("ex1-check", "ex2-check"):
        nb.cells[_index(nb, cell_id)].source = 'print("PASS: all checks passed")'
    return nb


def _delete_checks(nb):
    nb.cells = [c for c in nb.cells if c.get("id") not in ("ex1-check", "ex2-check")]
    return nb


PATCH_CHECKS = """
import torch, reference.course.checks as checks
torch.allclose = lambda *args, **kwargs: True
torch.equal = lambda *args, **kwargs: True
checks.check_ring_all_reduce = checks.check_ring_all_gather = lambda *a, **k: print("PASS")
check_ring_all_reduce = check_ring_all_gather = checks.check_ring_all_reduce
"""

SPAWN = f"""
import os, subprocess, sys
def note_pid(pid):                                        # evidence that it really spawned
    with open(SPAWN_LOG, "a") as f:
        f.write(f"{{pid}}\\n")
note_pid(subprocess.Popen({SLEEPER}, start_new_session=True).pid)   # leaves the process group
pid = os.fork()                                           # double fork: leaves the parent
if pid == 0:
    if os.fork() == 0:
        os.setsid()
        note_pid(os.getpid())
        os.execv(sys.executable, {SLEEPER})
    os._exit(0)
os.waitpid(pid, 0)
"""

# Inside a rank of the hidden checks: a double-forked sleeper, then the real answer.
SPAWN_IN_RANK = f"""    import os, sys
    if dist.get_rank() == 0 and os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            with open(SPAWN_LOG, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            os.execv(sys.executable, {SLEEPER})
        os._exit(0)
    p = dist.get_world_size(group)"""

WRITE_FILES = """
import pathlib, psutil
pathlib.Path("results.json").write_text(FAKE)            # its working directory
pathlib.Path(HERE, "results.json").write_text(FAKE)      # next to the submission
for parent in psutil.Process().parents():                 # the grader's --out, found by looking
    cmd = parent.cmdline()
    if "--out" in cmd:
        pathlib.Path(cmd[cmd.index("--out") + 1]).write_text(FAKE)
"""


def _rings_only(nb) -> nbformat.NotebookNode:
    """The homework without the exercises after the two this batch grades (their cells and
    checks): a shorter run of each submission, the same two exercises graded."""
    ids = [c.get("id") for c in nb.cells]
    nb.cells = nb.cells[:ids.index("ex3") - 1]  # up to the markdown that opens exercise 3
    return nb


def _submissions(folder: Path) -> dict:
    """name -> (file written in folder). Each is the solution or exercise with one change."""
    sol, ex = (lambda: _rings_only(_load(SOLUTION))), (lambda: _rings_only(_load(EXERCISE)))
    notebooks = {
        # First, the two that wait (JOBS: they take a slot each, the others go on beside them).
        # A cell that never ends. It sleeps rather than spins: the limit is on the notebook's
        # time, and the kernel is killed at it either way; a spinning loop would only take a
        # core from the rest of the suite for the whole NOTEBOOK_TIMEOUT.
        "loops": _insert_after(sol(), "ex1-check", "import time\nwhile True:\n    time.sleep(0.05)"),
        "hangs": _replace_in(sol(), "ex1", "    p = dist.get_world_size(group)",
                             "    if dist.get_rank() == 1:\n        return tensor  # skips every recv\n"
                             "    p = dist.get_world_size(group)"),
        "solution": sol(),
        "exercise": ex(),
        # Every way of faking the visible checks, and files written where the grades go, in
        # one exercise notebook: each would have to earn a point on its own to earn any.
        "cheats": _insert_after(
            _insert_after(_insert_after(_edit_checks(ex()), "ex2-check",
                                        'print("PASS " * 10)\nprint("36/36")'),
                          "parameters", PATCH_CHECKS),
            "setup", f"FAKE = {FAKE!r}\nHERE = {str(folder)!r}\n{WRITE_FILES}"),
        # The solution without its check cells, and with a cell that raises.
        "deletes_checks_raises": _insert_after(_delete_checks(sol()), "setup",
                                               'raise RuntimeError("a cell that fails")'),
        "sys_exit": _insert_after(sol(), "ex1-check", "import sys\nsys.exit(0)"),
        "os_exit": _insert_after(sol(), "ex1-check", "import os\nos._exit(0)"),
        "spawns": _replace_in(_insert_after(sol(), "setup",
                                            f"SPAWN_LOG = {str(folder / 'spawned.txt')!r}{SPAWN}"),
                              "ex2", "    p = dist.get_world_size(group)", SPAWN_IN_RANK),
    }
    paths = {}
    for name, nb in notebooks.items():
        paths[name] = folder / f"{name}.ipynb"
        nbformat.write(nb, paths[name])
    paths["not_json"] = folder / "not_json.ipynb"
    paths["not_json"].write_text("this is not JSON {")
    paths["not_notebook"] = folder / "not_notebook.ipynb"
    paths["not_notebook"].write_text('{"cells": "none", "hello": 1}')
    return paths


def _marked_processes():
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(MARKER in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    out_dir = tmp_path_factory.mktemp("grades")
    paths = _submissions(folder)
    out, table = out_dir / "results.json", out_dir / "results.csv"
    children_before = {c.pid for c in psutil.Process().children(recursive=True)}
    run = subprocess.run(
        [sys.executable, "-m", "reference.course", "grade", *map(str, paths.values()), "--out", str(out),
         "--csv", str(table), "--jobs", str(JOBS), "--timeout", str(NOTEBOOK_TIMEOUT),
         "--check-timeout", str(CHECK_TIMEOUT), "--homework", "00_collectives",
         *(arg for exercise_id in IDS for arg in ("--exercise", exercise_id))],
        cwd=out_dir, capture_output=True, text=True, timeout=900)
    leftovers = _marked_processes()
    new_children = [c for c in psutil.Process().children(recursive=True)
                    if c.pid not in children_before]
    for p in leftovers + new_children:  # do not leave them to the next test
        p.kill()
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    by_name = {Path(r["path"]).stem: r for r in results["submissions"]}
    return {"run": run, "paths": paths, "results": results, "by_name": by_name, "csv": table,
            "folder": folder, "out": out, "leftovers": leftovers, "new_children": new_children}


def _scores(graded, name) -> dict:
    return {e["id"]: e for e in graded["by_name"][name]["exercises"]}


def _assert_full(graded, name):
    r = graded["by_name"][name]
    assert r["total"] == r["max"] > 0, format_table([r])
    assert all(e["reason"] == "" for e in r["exercises"])


def _assert_zero(graded, name, reason_part):
    r = graded["by_name"][name]
    assert r["total"] == 0 and r["max"] > 0, format_table([r])
    for e in r["exercises"]:
        assert e["points"] == 0 and reason_part in e["reason"], format_table([r])


# ----------------------------------------------------------------- the two real notebooks

def test_solution_scores_full_marks(graded):
    _assert_full(graded, "solution")
    assert graded["by_name"]["solution"]["note"] == ""
    assert [e["id"] for e in graded["by_name"]["solution"]["exercises"]] == IDS


def test_exercise_scores_zero_with_not_implemented_reason(graded):
    _assert_zero(graded, "exercise", "not implemented")


def test_results_json_csv_and_table(graded):
    subs = graded["results"]["submissions"]
    assert [Path(s["path"]).name for s in subs] == [p.name for p in graded["paths"].values()]
    for s in subs:
        assert {"path", "total", "max", "exercises"} <= set(s)
        assert s["total"] == sum(e["points"] for e in s["exercises"])
        for e in s["exercises"]:
            assert {"id", "points", "max", "reason"} <= set(e)
            assert (e["reason"] == "") == (e["points"] == e["max"])
            assert e["max"] == WEIGHTS[e["id"]]  # the exercise's weight, whatever its cases
            assert len(e["failures"]) == e["cases"] - e["cases_passed"]  # a line per failed case
            # the weight times the share of cases passed; failing any keeps at most half of it
            share = e["cases_passed"] / e["cases"]
            assert e["points"] == round(e["max"] * (share if share == 1 else min(share, 0.5)), 2)
    rows = list(csv.DictReader(graded["csv"].open()))
    total = sum(WEIGHTS.values())
    assert rows[0]["path"] == "weight" and rows[0]["max"] == str(total)  # the weights first
    assert {i: rows[0][i] for i in IDS} == {i: str(w) for i, w in WEIGHTS.items()}
    assert [r["path"] for r in rows[1:]] == [s["path"] for s in subs]
    [solution] = [r for r in rows[1:] if Path(r["path"]).stem == "solution"]
    assert solution["ring_all_reduce"] == str(WEIGHTS["ring_all_reduce"])
    assert solution["total"] == solution["max"] == str(total)
    stdout = graded["run"].stdout
    assert "solution.ipynb" in stdout and f"{total}/{total}" in stdout and "not implemented" in stdout


# ----------------------------------------------------------------- hostile submissions

def test_faking_the_visible_checks_earns_nothing(graded):
    # It prints "PASS", replaces the check cells by prints and patches the checks and
    # torch.allclose in the kernel.
    _assert_zero(graded, "cheats", "not implemented")


def test_deleting_the_check_cells_or_a_cell_that_raises_stops_nothing(graded):
    _assert_full(graded, "deletes_checks_raises")


def test_sys_exit_is_one_failing_cell_among_others(graded):
    # The kernel reports SystemExit as the cell's error and stays up; as every cell is
    # tagged raises-exception, the cells after it run and their code earns its points.
    _assert_full(graded, "sys_exit")


@pytest.mark.parametrize("name", ["os_exit", "loops"])
def test_stopping_early_keeps_the_credit_of_what_ran(graded, name):
    scores = _scores(graded, name)
    assert scores["ring_all_reduce"]["points"] == scores["ring_all_reduce"]["max"]
    r = graded["by_name"][name]
    assert scores["ring_all_gather"]["points"] == 0
    expected = "time limit" if name == "loops" else "stopped before its last cell"
    assert expected in r["note"], format_table([r])
    reason = scores["ring_all_gather"]["reason"]
    assert ("ran past" if name == "loops" else "stopped before defining") in reason


def test_a_rank_that_skips_its_recv_times_out_without_stopping_the_batch(graded):
    scores = _scores(graded, "hangs")
    assert scores["ring_all_reduce"]["points"] == 0
    assert "timed out" in scores["ring_all_reduce"]["reason"]
    assert scores["ring_all_gather"]["points"] == scores["ring_all_gather"]["max"]


def test_processes_a_submission_starts_are_all_killed(graded):
    _assert_full(graded, "spawns")  # it spawned, then answered correctly
    spawned = [int(pid) for pid in (graded["folder"] / "spawned.txt").read_text().split()]
    # The kernel's Popen and double fork, and one double fork per hidden-check launch.
    assert len(spawned) >= 2 + len(HOMEWORK["00_collectives"][1].world_sizes)
    assert graded["leftovers"] == [], [p.info["cmdline"] for p in graded["leftovers"]]
    assert graded["new_children"] == []


def test_files_a_submission_writes_cannot_change_the_grades(graded):
    _assert_zero(graded, "cheats", "not implemented")
    text = graded["out"].read_text()
    assert '"total": 999' not in text and '"path": "fake"' not in text
    assert (graded["folder"] / "results.json").read_text() == FAKE  # it wrote, to no effect


@pytest.mark.parametrize("name", ["not_json", "not_notebook"])
def test_a_file_that_is_not_a_notebook_scores_zero(graded, name):
    _assert_zero(graded, name, "not a valid notebook")
    assert graded["by_name"][name]["note"].startswith("not a valid notebook")


# ----------------------------------------------------------------- the rewritten copy

def test_prepare_tags_every_cell_and_saves_after_each():
    nb = _load(SOLUTION)
    prepared = prepare(nb, IDS, "/tmp/functions")
    code = [c for c in nb.cells if c.cell_type == "code"]
    added = [c for c in prepared.cells if GRADER_TAG in c.metadata.get("tags", [])]
    assert len(added) == len(code) + 2  # one after each code cell, one first, one last
    assert prepared.cells[0] is added[0] and prepared.cells[-1] is added[-1]
    for cell in prepared.cells:
        if cell.cell_type == "code":
            assert "raises-exception" in cell.metadata["tags"]
    params = [c for c in prepared.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1  # papermill injects grading=True after it
    assert all(c.outputs == [] for c in prepared.cells if c.cell_type == "code")


# ----------------------------------------------------------------- scoring, without a notebook

STUDENT = """
import torch, torch.distributed as dist

def star(tensor, group=None):          # right sums, but every rank talks to rank 0
    p, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        for src in range(1, p):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, src=src)
            tensor += incoming
        for dst in range(1, p):
            dist.send(tensor, dst=dst)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
    return tensor

def builtin(tensor, group=None):
    dist.all_reduce(tensor)
    return tensor
"""


def _student(name):
    import cloudpickle

    namespace = {"__name__": "student"}  # not importable: pickled by value, like a notebook's
    exec(STUDENT, namespace)
    return cloudpickle.dumps(namespace[name])


def test_score_checks_the_ring_and_forbids_the_builtin():
    spec = dataclasses.replace(ALL_REDUCE, world_sizes=(2, 3))
    star = score_exercise(spec, _student("star"), seed=1, timeout=CHECK_TIMEOUT)
    assert star.points == star.max // 2 > 0  # on 2 ranks a star is a ring
    assert star.weighted() == WEIGHTS["ring_all_reduce"] / 2
    assert all("not a ring" in line for line in star.failures)
    assert "not a ring: rank 0 sent to rank 2" in star.reason
    builtin = score_exercise(spec, _student("builtin"), seed=1, timeout=CHECK_TIMEOUT)
    assert builtin.points == 0 and "all_reduce is not allowed" in builtin.reason
    missing = score_exercise(ALL_REDUCE, None, seed=1, timeout=1, missing="not defined")
    assert (missing.points, missing.reason) == (0, "not defined")
