"""Build the exercise notebooks from the solution notebooks: one source for each homework.

    python -m reference.course exercises   # write exercises/NN_topic.ipynb from solutions/
    python -m reference.course check       # exit 1 and list the files when exercises/ is stale

A homework is written once, with its answers, in `solutions/NN_topic.ipynb`. Inside
a code cell, each answer sits between two marker lines:

    def ring_all_reduce(tensor, group=None):
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION

The exercise notebook is the same notebook with every such region (markers
included) replaced by a stub at the indentation of the BEGIN marker:

        # YOUR CODE HERE
        raise NotImplementedError("Exercise ring_all_reduce: ...")

The exercise id is the cell's `metadata.course.exercise` (one rule, the one the
grader also uses to name exercises). A cell with markers but no id, a BEGIN
without its END, an END without a BEGIN, or a BEGIN inside another region is an
error naming the notebook and the cell index.

The exercise notebook also loses its outputs and execution counts and gains a
first markdown cell saying it is generated. It is written with a fixed JSON layout
(sorted keys, indent 1, trailing newline) and cell ids copied from the solution,
so building twice gives the same bytes and a stale file is a real difference.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import nbformat

__all__ = [
    "BEGIN", "END", "MarkerError", "strip_solutions", "make_exercise", "render",
    "build_exercises", "stale_exercises", "main",
]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
BANNER_ID = "generated-banner"
# Metadata a run leaves behind (timings, papermill's bookkeeping): never part of the source.
_RUN_CELL_METADATA = ("execution", "papermill", "ExecuteTime", "collapsed", "scrolled")
_RUN_NB_METADATA = ("papermill", "widgets")
REPO_ROOT = Path(__file__).resolve().parents[2]  # reference/course/exercises.py -> the course folder


class MarkerError(ValueError):
    """The solution markers of a notebook cell are not a sequence of closed, flat regions."""


def stub_lines(exercise_id: str, indent: str) -> list[str]:
    """What a student sees in place of an answer."""
    return [f"{indent}# YOUR CODE HERE\n",
            f'{indent}raise NotImplementedError("Exercise {exercise_id}: '
            f'not implemented yet; write your answer here")\n']


def strip_solutions(source: str, exercise_id: str | None, where: str) -> str:
    """Replace each BEGIN/END region of one cell's source by a stub.

    `where` names the notebook and cell in error messages."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    open_at = None  # line number of the BEGIN of the region being skipped
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if text.startswith(BEGIN):
            if open_at is not None:
                raise MarkerError(f"{where}: line {number}: '{BEGIN}' inside the region opened "
                                  f"at line {open_at} (regions cannot be nested)")
            if not exercise_id:
                raise MarkerError(f"{where}: has solution markers but no exercise id: set the "
                                  f"cell's metadata course.exercise (e.g. \"ring_all_reduce\")")
            open_at = number
            indent = line[: len(line) - len(line.lstrip())]
            stub = stub_lines(exercise_id, indent)
            if out and not out[-1].endswith("\n"):
                out[-1] += "\n"
            out += stub
        elif text.startswith(END):
            if open_at is None:
                raise MarkerError(f"{where}: line {number}: '{END}' without a '{BEGIN}' before it")
            open_at = None
        elif open_at is None:
            out.append(line)
    if open_at is not None:
        raise MarkerError(f"{where}: line {open_at}: '{BEGIN}' is never closed by '{END}'")
    result = "".join(out)
    # The last stub line carries a newline the cell did not have: keep the cell's own ending.
    if not source.endswith("\n") and result.endswith("\n"):
        result = result[:-1]
    return result


def _banner(solution_name: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_markdown_cell(
        f"> **Generated file.** This notebook is generated from `solutions/{solution_name}` "
        f"by `make exercises` (`python -m reference.course exercises`). Do not edit it by "
        f"hand: edit the solution notebook and regenerate.\n"
        f">\n"
        f"> Students: replace each `raise NotImplementedError(...)` under `# YOUR CODE HERE` "
        f"with your answer, run the check cell below it, and hand in this notebook.\n"
        f">\n"
        f"> **Run All goes through** whatever you have finished: the check of an exercise you "
        f"have not done yet prints `FAIL ...: not implemented yet`, and a cell that shows an "
        f"unfinished exercise's result prints `not run yet: ...` instead of a traceback. "
        f"Each exercise earns its own points (its weight is listed at the top), so hand in "
        f"what you have.")
    cell["id"] = BANNER_ID
    return cell


def make_exercise(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The exercise notebook for the solution notebook `name` (e.g. "00_collectives.ipynb")."""
    nb = copy.deepcopy(solution)
    nb["nbformat"], nb["nbformat_minor"] = 4, max(5, nb.get("nbformat_minor", 5))
    for key in _RUN_NB_METADATA:
        nb.metadata.pop(key, None)
    nb.metadata["course"] = {"homework": Path(name).stem, "generated_from": f"solutions/{name}"}
    for index, cell in enumerate(nb.cells):
        where = f"solutions/{name}: cell {index}"
        # Ids from the file when present; a fixed one otherwise (nbformat would draw a random one).
        cell["id"] = cell.get("id") or f"cell-{index}"
        for key in _RUN_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            exercise_id = cell.metadata.get("course", {}).get("exercise")
            cell.source = strip_solutions(cell.source, exercise_id, where)
            cell.outputs = []
            cell.execution_count = None
        # Markdown cells are copied as they are: they may talk about the markers.
    nb.cells.insert(0, _banner(name))
    return nb


def render(nb: nbformat.NotebookNode) -> bytes:
    """Fixed JSON layout: sorted keys, indent 1, UTF-8, one trailing newline."""
    text = nbformat.writes(nb, version=4)
    return (text if text.endswith("\n") else text + "\n").encode("utf-8")


def _expected(solutions_dir: Path) -> dict[str, bytes]:
    """Every exercise file that solutions_dir implies, by file name."""
    files = {}
    for path in sorted(Path(solutions_dir).glob("*.ipynb")):
        solution = nbformat.read(path, as_version=4)
        files[path.name] = render(make_exercise(solution, path.name))
    return files


def build_exercises(solutions_dir: Path, exercises_dir: Path) -> list[Path]:
    """Write one exercise notebook per solution notebook; returns the paths written."""
    exercises_dir = Path(exercises_dir)
    exercises_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in _expected(solutions_dir).items():
        target = exercises_dir / name
        target.write_bytes(data)
        written.append(target)
    return written


def stale_exercises(solutions_dir: Path, exercises_dir: Path) -> list[str]:
    """Exercise files that differ from what the solutions give, are missing, or have no solution."""
    expected = _expected(solutions_dir)
    stale = []
    for name, data in expected.items():
        target = Path(exercises_dir) / name
        if not target.exists():
            stale.append(f"{target} (missing)")
        elif target.read_bytes() != data:
            stale.append(f"{target} (differs from solutions/{name})")
    for target in sorted(Path(exercises_dir).glob("*.ipynb")):
        if target.name not in expected:
            stale.append(f"{target} (no solutions/{target.name})")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.course",
                                     description="Build exercises/ from solutions/.")
    parser.add_argument("command", choices=["exercises", "check"],
                        help="exercises: (re)write exercises/; check: exit 1 if it is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="the course folder holding solutions/ and exercises/")
    parser.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    parser.add_argument("--exercises", type=Path, help="default: ROOT/exercises")
    args = parser.parse_args(argv)
    solutions = args.solutions or args.root / "solutions"
    exercises = args.exercises or args.root / "exercises"
    try:
        if args.command == "exercises":
            for path in build_exercises(solutions, exercises):
                print(f"wrote {path}")
            return 0
        stale = stale_exercises(solutions, exercises)
    except MarkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if stale:
        print("exercises/ is stale; run `make exercises` and commit the result:", file=sys.stderr)
        for line in stale:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"exercises/ is up to date with {solutions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
