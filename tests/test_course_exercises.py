"""Exercises are generated from solutions: stubs, marker errors, determinism, staleness;
and the visible checks that the homework notebooks call."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from reference.course.exercises import (BANNER_ID, MarkerError, build_exercises, make_exercise, render,
                              stale_exercises, strip_solutions)
from reference.course.homework import HOMEWORK
from reference.course.homework.scoring import weight

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"


def _notebook(*sources, exercise="demo"):
    nb = nbformat.v4.new_notebook()
    for i, source in enumerate(sources):
        cell = nbformat.v4.new_code_cell(source)
        cell["id"] = f"c{i}"
        cell.metadata["course"] = {"exercise": exercise}
        nb.cells.append(cell)
    return nb


# ----------------------------------------------------------------- stubs

def test_stub_keeps_the_indentation_of_the_begin_marker():
    source = ("def f(x):\n"
              "    y = x + 1\n"
              "    ### BEGIN SOLUTION\n"
              "    return y * 2\n"
              "    ### END SOLUTION\n"
              "\n"
              "class Ring:\n"
              "    def step(self):\n"
              "        ### BEGIN SOLUTION\n"
              "        if True:\n"
              "            pass\n"
              "        ### END SOLUTION\n"
              "        return self")
    out = strip_solutions(source, "ring_step", "nb: cell 0")
    assert out == ("def f(x):\n"
                   "    y = x + 1\n"
                   "    # YOUR CODE HERE\n"
                   '    raise NotImplementedError("Exercise ring_step: not implemented yet; '
                   'write your answer here")\n'
                   "\n"
                   "class Ring:\n"
                   "    def step(self):\n"
                   "        # YOUR CODE HERE\n"
                   '        raise NotImplementedError("Exercise ring_step: not implemented yet; '
                   'write your answer here")\n'
                   "        return self")
    compile(out, "<stub>", "exec")  # still valid Python


def test_stub_raises_not_implemented_naming_the_exercise():
    out = strip_solutions("def g():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
                          "my_exercise", "nb: cell 0")
    namespace = {}
    exec(out, namespace)
    with pytest.raises(NotImplementedError, match="Exercise my_exercise"):
        namespace["g"]()


@pytest.mark.parametrize("source, message", [
    ("x = 1\n### END SOLUTION\n", "without a '### BEGIN SOLUTION'"),
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_bad_markers_name_the_notebook_and_the_cell(source, message):
    nb = _notebook("a = 0", "b = 1", source)
    with pytest.raises(MarkerError, match=message) as err:
        make_exercise(nb, "07_broken.ipynb")
    assert "solutions/07_broken.ipynb: cell 2" in str(err.value)


def test_markers_without_an_exercise_id_are_an_error():
    nb = _notebook("def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION")
    del nb.cells[0].metadata["course"]
    with pytest.raises(MarkerError, match="cell 0: has solution markers but no exercise id"):
        make_exercise(nb, "01_x.ipynb")


def test_outputs_cleared_banner_first_markdown_untouched():
    nb = _notebook("print(1)", "def f():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION")
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[0].execution_count = 3
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "2024-01-01"}
    nb.cells.append(nbformat.v4.new_markdown_cell("Write between `### BEGIN SOLUTION` and ..."))
    ex = make_exercise(nb, "03_tp.ipynb")
    banner = ex.cells[0]
    assert banner.cell_type == "markdown" and banner["id"] == BANNER_ID
    assert "solutions/03_tp.ipynb" in banner.source and "make exercises" in banner.source
    assert "edit the solution" in banner.source
    code = [c for c in ex.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert "execution" not in code[0].metadata
    assert "return 2" not in code[1].source
    assert ex.cells[-1].source == nb.cells[-1].source
    assert ex.metadata["course"]["homework"] == "03_tp"
    nbformat.validate(ex)


def test_rendering_is_deterministic(tmp_path):
    nb = _notebook("x = 1")
    nb.cells[0]["id"] = None  # no id in the file: a fixed one, not a random one
    first, second = render(make_exercise(nb, "a.ipynb")), render(make_exercise(nb, "a.ipynb"))
    assert first == second and first.endswith(b"}\n")
    solutions = tmp_path / "solutions"
    shutil.copytree(SOLUTIONS, solutions)
    a = {p.name: p.read_bytes() for p in build_exercises(solutions, tmp_path / "a")}
    b = {p.name: p.read_bytes() for p in build_exercises(solutions, tmp_path / "b")}
    assert a == b and a


# ----------------------------------------------------------------- the committed exercises/

def test_committed_exercises_are_up_to_date(tmp_path):
    """Fails when someone edited solutions/ (or exercises/) without `make exercises`."""
    fresh = {p.name: p.read_bytes() for p in build_exercises(SOLUTIONS, tmp_path)}
    committed = {p.name: p.read_bytes() for p in EXERCISES.glob("*.ipynb")}
    assert sorted(fresh) == sorted(committed), "run `make exercises`"
    for name, data in fresh.items():
        assert committed[name] == data, f"exercises/{name} is stale: run `make exercises`"


def test_check_command_lists_stale_files(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    shutil.copytree(SOLUTIONS, solutions)
    build_exercises(solutions, exercises)
    command = [sys.executable, "-m", "reference.course", "check",
               "--solutions", str(solutions), "--exercises", str(exercises)]
    assert subprocess.run(command, capture_output=True).returncode == 0
    target = exercises / "00_collectives.ipynb"
    target.write_bytes(target.read_bytes().replace(b"YOUR CODE HERE", b"my answer"))
    (exercises / "99_orphan.ipynb").write_text("{}")
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode == 1
    assert "00_collectives.ipynb (differs" in run.stderr and "99_orphan.ipynb (no" in run.stderr
    assert len(stale_exercises(solutions, exercises)) == 2


def test_the_exercise_notebook_keeps_everything_but_the_answers():
    solution, exercise = nbformat.read(SOLUTIONS / "00_collectives.ipynb", 4), \
        nbformat.read(EXERCISES / "00_collectives.ipynb", 4)
    assert len(exercise.cells) == len(solution.cells) + 1
    for sol_cell, ex_cell in zip(solution.cells, exercise.cells[1:]):
        if "### BEGIN SOLUTION" in sol_cell.source:
            exercise_id = sol_cell.metadata["course"]["exercise"]
            assert f"Exercise {exercise_id}" in ex_cell.source
            assert "### BEGIN SOLUTION" not in ex_cell.source
        else:
            assert ex_cell.source == sol_cell.source


# ----------------------------------------------------------------- the checks' rules and the visible checks

def _guarded_rank():
    import torch
    import torch.distributed as dist

    from reference.course.homework.guard import NotAllowedError, exercise_rules

    peer = 1 - dist.get_rank()
    with exercise_rules("demo") as traffic:
        a = torch.zeros(5)
        if peer == 1:
            dist.send(a, dst=peer)  # send calls isend inside torch: still one message
        else:
            dist.recv(a, src=peer)
        ops = [dist.P2POp(dist.isend, torch.zeros(3), peer), dist.P2POp(dist.irecv, a[:3], peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        refused = []
        for call in (lambda: dist.all_reduce(a), lambda: dist.group.WORLD.allreduce([a])):
            try:
                call()
            except NotAllowedError:
                refused.append(True)
    dist.all_reduce(a)  # the rules are lifted on exit
    return {"sends": traffic.sends, "recvs": traffic.recvs, "refused": len(refused)}


def test_rules_refuse_collectives_and_record_each_message_once():
    from reference.runtime import launch

    rank0, rank1 = launch(_guarded_rank, 2, quiet=True)
    assert rank0 == {"sends": [(1, 5), (1, 3)], "recvs": [(1, 3)], "refused": 2}
    assert rank1 == {"sends": [(0, 3)], "recvs": [(0, 5), (0, 3)], "refused": 2}


def _functions(path: Path) -> dict:
    """The notebook's setup and exercise cells, run here (as a student's kernel would)."""
    nb = nbformat.read(path, 4)
    namespace = {"__name__": "homework_under_test"}  # not importable: pickled by value
    for cell in nb.cells:
        if cell.get("id") in ("setup", "ex1", "ex2"):
            exec(cell.source, namespace)
    return namespace


def test_visible_checks_pass_the_solution(capsys):
    from reference.course.checks.collectives import ALL_GATHER, ALL_REDUCE, run_check

    ns = _functions(SOLUTIONS / "00_collectives.ipynb")
    assert run_check(ALL_REDUCE, ns["ring_all_reduce"], world_sizes=(2, 3)) is True
    assert run_check(ALL_GATHER, ns["ring_all_gather"], world_sizes=(4,)) is True
    assert capsys.readouterr().out.count("PASS") == 2


def test_visible_checks_report_failures_without_raising(capsys):
    from reference.course.checks.collectives import ALL_REDUCE, check_ring_all_gather, run_check

    ns = _functions(EXERCISES / "00_collectives.ipynb")
    check_ring_all_gather(ns["ring_all_gather"])  # prints, returns nothing, never raises
    assert "FAIL ring_all_gather: not implemented yet" in capsys.readouterr().out

    def builtin(tensor, group=None):
        import torch.distributed as dist
        dist.all_reduce(tensor)
        return tensor

    def off_by_one(tensor, group=None):
        tensor += 1
        return tensor

    def skips_recv(tensor, group=None):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            dist.recv(tensor.clone(), src=1)
        return tensor

    assert run_check(ALL_REDUCE, builtin, world_sizes=(2,)) is False
    assert "is not allowed in this exercise" in capsys.readouterr().out
    assert run_check(ALL_REDUCE, off_by_one, world_sizes=(2,)) is False
    out = capsys.readouterr().out
    assert "wrong sum" in out and "hint:" in out
    assert run_check(ALL_REDUCE, skips_recv, world_sizes=(2,), timeout=5) is False
    assert "timed out" in capsys.readouterr().out
    assert run_check(ALL_REDUCE, "not a function") is False
    assert run_check(ALL_REDUCE, builtin, skip=True) is None
    assert "skipped" in capsys.readouterr().out


@pytest.mark.notebook
def test_solution_notebook_runs_headless_and_passes_its_checks(tmp_path):
    import papermill

    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(SOLUTIONS / "00_collectives.ipynb"), str(out),
                               kernel_name="python3", cwd=str(tmp_path), progress_bar=False)
    text = "".join(o.get("text", "") for c in nbformat.read(out, 4).cells
                   if c.cell_type == "code" for o in c.outputs)
    assert text.count("PASS") == 5 and "FAIL" not in text


# ----------------------------------------------------------------- Run All on a fresh exercise notebook

EXERCISE_NOTEBOOKS = sorted(EXERCISES.glob("*.ipynb"))


def _run_all(path: Path, workdir: Path) -> tuple[nbformat.NotebookNode, Path]:
    """Run All on the exercise notebook, as the grader rewrites it (`prepare`: each exercise
    function saved after every cell, a first and a last marker cell; the student's cells
    unchanged, `grading` left False): (the executed copy, the folder of saved functions).
    One execution serves both what a student sees and what the grader scores."""
    from nbclient import NotebookClient

    from reference.course.grade_runner import prepare

    functions = workdir / "functions"
    functions.mkdir()
    names = [spec.id for spec in HOMEWORK[path.stem]]
    nb = prepare(nbformat.read(path, 4), names, functions)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return nb, functions


@pytest.fixture(scope="module")
def run_all(tmp_path_factory):
    """Every exercise notebook run top to bottom as a student's Run All would, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {p.name: pool.submit(_run_all, p, tmp_path_factory.mktemp(p.stem))
                   for p in EXERCISE_NOTEBOOKS}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.notebook
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [p.name for p in EXERCISE_NOTEBOOKS])
def test_run_all_goes_through_and_says_what_is_not_implemented(run_all, name):
    """What the banner promises: no traceback, one "not implemented yet" per exercise."""
    from reference.course.grade_runner import GRADER_TAG

    assert "Run All goes through" in nbformat.read(EXERCISES / name, 4).cells[0].source
    nb = run_all[name][0]
    errors = [(i, o.ename, o.evalue) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    student = [c for c in nb.cells if c.cell_type == "code" and GRADER_TAG not in c.metadata["tags"]]
    text = "".join(o.get("text", "") for c in student for o in c.outputs)
    exercise_ids = {c.metadata.get("course", {}).get("exercise") for c in nb.cells} - {None}
    for exercise_id in exercise_ids:
        assert f"FAIL {exercise_id}: not implemented yet" in text, exercise_id
    assert "Traceback" not in text and "PASS" not in text
    added = [c for c in nb.cells if c.cell_type == "code" and GRADER_TAG in c.metadata["tags"]]
    assert all(not c.outputs for c in added), [c.outputs for c in added if c.outputs]


@pytest.mark.notebook
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [p.name for p in EXERCISE_NOTEBOOKS])
def test_the_grader_scores_every_exercise_zero_with_not_implemented(run_all, name):
    """Every generated exercise, as the grader saves it from the run above, is a stub: it scores
    zero as "not implemented" without starting ranks (the grader's own reading of the saved
    functions and its scoring, as `grade_one` does after executing a submission)."""
    from reference.course.grade import _saved_functions
    from reference.course.grade_runner import FINISHED, STARTED
    from reference.course.homework import score_exercise

    functions, specs = run_all[name][1], HOMEWORK[Path(name).stem]
    assert (functions / STARTED).exists() and (functions / FINISHED).exists()
    saved = _saved_functions(functions, [s.id for s in specs], True, True, False, 300)
    assert sum(weight(s) for s in specs if not s.bonus) > 0
    for spec in specs:
        fn_bytes, missing = saved[spec.id]
        assert fn_bytes is None, f"{spec.id}: saved as a function, not as the stub marker"
        score = score_exercise(spec, fn_bytes, seed=1, timeout=60, missing=missing)
        assert score.points == 0 and "not implemented" in score.reason, score


def test_unfinished_reads_the_stub_in_the_function_and_its_notebook_helpers():
    from reference.course.checks.unfinished import unfinished

    source = strip_solutions(
        "class Op:\n"
        "    @staticmethod\n"
        "    def forward(x):\n"
        "        ### BEGIN SOLUTION\n"
        "        return x\n"
        "        ### END SOLUTION\n"
        "\n"
        "def exercise(x):\n"
        "    return Op.forward(x)\n"
        "\n"
        "def done(x):\n"
        "    return x\n", "demo", "nb: cell 0")
    namespace = {"__name__": "notebook"}
    exec(source, namespace)
    assert unfinished(namespace["exercise"], "demo")  # the stub is in a class it calls
    assert not unfinished(namespace["exercise"], "other")  # another exercise's stub: not this one
    assert not unfinished(namespace["done"], "demo")
    # A finished autograd Function: its class and its backward class point to each other.
    exec("import torch\n"
         "class Twice(torch.autograd.Function):\n"
         "    @staticmethod\n"
         "    def forward(ctx, x):\n"
         "        return 2 * x\n"
         "    @staticmethod\n"
         "    def backward(ctx, g):\n"
         "        return 2 * g\n"
         "def twice(x):\n"
         "    return Twice.apply(x)\n", namespace)
    assert not unfinished(namespace["twice"], "demo")


def test_example_turns_an_unfinished_exercise_into_one_line(capsys):
    from reference.course.checks.unfinished import example
    from reference.runtime import RankError

    with example("demo"):
        raise NotImplementedError("Exercise demo: not implemented yet; write your answer here")
    failure = RankError("rank 0 failed", rank=0,
                        failures={0: "NotImplementedError: Exercise demo: not implemented yet"})
    with example("demo"):
        raise failure
    out = capsys.readouterr().out
    assert out.count("not run yet: demo is not implemented yet") == 2
    with pytest.raises(ValueError), example("demo"):  # a real bug still shows
        raise ValueError("a bug")
    with pytest.raises(RankError), example("demo"):
        raise RankError("rank 1 failed", rank=1, failures={1: "ValueError: a bug"})
