"""Grade homework notebooks: execute each, score it with hidden checks, write a table.

    python -m reference.course grade submissions/*.ipynb --out results.json [--csv results.csv]
        [--jobs 2] [--timeout 300] [--check-timeout 60] [--homework 00_collectives]
        [--exercise ring_all_reduce ...] [--quiet]

For each submission, in its own fresh temporary folder:
  1. read it as a notebook (a file that is not one scores zero, with the reason);
  2. execute a rewritten copy with papermill in a runner process (`grade_runner`),
     passing the parameter `grading=True` (the visible checks then skip), with a
     time limit; the exercise functions are saved after every cell;
  3. score each exercise with its hidden checks (`reference.course.homework`): the grader
     draws the inputs from a seed it keeps to itself, computes the expected answers
     in this process (under a lock: the threads of --jobs share torch's random state),
     and runs the student's functions only in separate rank
     processes that can send back nothing but tensors, numbers and strings. An
     exercise earns its weight (by difficulty) times the share of its cases passed;
     a bonus exercise adds to the total, not to the maximum.
The visible check cells of the notebook are never read: printing "PASS", editing
or deleting them, or patching `torch.allclose` in the kernel changes nothing.
Only this process writes results.json and the CSV, at the end, from its memory,
after every process a submission started has been killed.

The homework of a submission is --homework, else the notebook's
`metadata.course.homework` (set in every generated exercise notebook), else its
file stem, else the only homework there is. `--exercise` (repeatable) grades only the
exercises named, e.g. to grade one exercise again after a fix to its checks.
"""
from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from reference.course.procs import ChildRegistry, become_subreaper
from reference.course.report import format_table, write_csv, write_json
from reference.course.homework import HOMEWORK, score_exercise
from reference.course.homework.scoring import one_line
from reference.runtime import launch

# nbformat, papermill's helpers and tqdm are imported where they are used: every rank
# of a hidden check re-imports the main module (this one, under `python -m`), and
# should not pay for them.

__all__ = ["GradeOptions", "grade", "grade_one", "main"]

MAX_NOTEBOOK_BYTES = 20 * 2**20
MAX_FUNCTION_BYTES = 20 * 2**20


@dataclass
class GradeOptions:
    """How to grade. The seed of the hidden inputs is drawn afresh for every batch and
    never printed or written, so no submission can know the inputs in advance."""
    homework: str | None = None
    timeout: float = 300.0        # seconds for executing one notebook
    check_timeout: float = 60.0   # seconds for one launch of a hidden check
    exercises: tuple | None = None  # ids to grade; None: every exercise of the homework
    seed: int = field(default_factory=lambda: secrets.randbits(63), repr=False)


def _read_notebook(path: Path):
    """(notebook, "") or (None, why it is not a notebook)."""
    import nbformat

    try:
        if path.stat().st_size > MAX_NOTEBOOK_BYTES:
            return None, f"larger than {MAX_NOTEBOOK_BYTES // 2**20} MiB"
        nb = nbformat.reads(path.read_bytes().decode("utf-8"), as_version=4)
        nbformat.validate(nb)
        return nb, ""
    except Exception as exc:  # noqa: BLE001 - any way of not being a notebook
        return None, one_line(f"{type(exc).__name__}: {exc}", 160)


def _homework_of(path: Path, nb, options: GradeOptions) -> str | None:
    candidates = [options.homework]
    if nb is not None:
        course = nb.metadata.get("course", {})
        candidates.append(course.get("homework") if isinstance(course, dict) else None)
    candidates.append(path.stem)
    if len(HOMEWORK) == 1:
        candidates.append(next(iter(HOMEWORK)))
    return next((c for c in candidates if isinstance(c, str) and c in HOMEWORK), None)


def _missing_reason(name: str, started: bool, finished: bool, timed_out: bool,
                    timeout: float) -> str:
    if timed_out:
        return f"the notebook ran past its {timeout:g} s limit before defining {name}"
    if not started:
        return "the notebook could not be executed (the kernel did not start)"
    if not finished:
        return (f"the notebook stopped before defining {name} "
                f"(sys.exit, os._exit or a crashed kernel?)")
    return f"{name} is not defined by the notebook (was its cell deleted or renamed?)"


def _saved_functions(folder: Path, names, started, finished, timed_out, timeout):
    """{name: (pickled bytes or None, reason when None)} from the files the run left."""
    saved = {}
    for name in names:
        path = folder / f"{name}.pkl"
        if not path.is_file():
            saved[name] = (None, _missing_reason(name, started, finished, timed_out, timeout))
        elif path.stat().st_size > MAX_FUNCTION_BYTES:
            saved[name] = (None, f"{name} pickles to more than {MAX_FUNCTION_BYTES // 2**20} MiB")
        else:
            data = path.read_bytes()
            if data == b"stub:":  # the whole body raises NotImplementedError
                saved[name] = (None, "not implemented (raises NotImplementedError)")
            elif data.startswith(b"error:"):
                why = one_line(data[6:].decode("utf-8", "replace"), 160)
                saved[name] = (None, f"{name} could not be saved for grading ({why})")
            else:
                saved[name] = (data, "")
    return saved


def _note(started: bool, finished: bool, timed_out: bool, timeout: float) -> str:
    if timed_out:
        return f"stopped at the {timeout:g} s time limit"
    if not started:
        return "the kernel did not start (tried twice)"
    if not finished:
        return "the notebook stopped before its last cell (sys.exit, os._exit or a crashed kernel?)"
    return ""


def grade_one(path: Path, options: GradeOptions, registry: ChildRegistry) -> dict:
    """Execute and score one submission; never raises for anything the submission does."""
    path = Path(path)
    nb, invalid = _read_notebook(path)
    homework_id = _homework_of(path, nb, options)
    result = {"path": str(path), "homework": homework_id or "", "total": 0, "max": 0,
              "note": "", "exercises": []}
    if homework_id is None:
        result["note"] = "cannot tell which homework this is: pass --homework"
        return result
    specs = [s for s in HOMEWORK[homework_id]
             if options.exercises is None or s.id in options.exercises]
    names = [s.id for s in specs]
    if nb is None:
        result["note"] = f"not a valid notebook: {invalid}"
        saved = {n: (None, "the file is not a valid notebook") for n in names}
    else:
        saved, result["note"] = _execute(nb, names, options, registry)
    # After each launch, kill what its ranks left behind (the ranks themselves are
    # children of launch's forkserver, which the sweep spares).
    scores = [score_exercise(spec, saved[spec.id][0], options.seed, options.check_timeout,
                             missing=saved[spec.id][1], cleanup=registry.sweep)
              for spec in specs]
    result["exercises"] = [s.as_dict() for s in scores]
    result["total"] = _total(e["points"] for e in result["exercises"])
    result["max"] = _total(e["max"] for e in result["exercises"] if not e["bonus"])
    return result


def _total(points) -> float:
    """A sum of points, written as an int when it is one."""
    value = round(sum(points), 2)
    return int(value) if value == int(value) else value


def _execute(nb, names, options: GradeOptions, registry: ChildRegistry):
    """Run the notebook (retrying once if its kernel never started); ({name: saved}, note)."""
    import nbformat

    from reference.course.grade_runner import FINISHED, STARTED, execute, prepare

    root = Path(tempfile.mkdtemp(prefix="grade-"))
    try:
        for attempt in range(2):
            run = root / f"attempt{attempt}"
            functions, cwd = run / "functions", run / "cwd"
            functions.mkdir(parents=True)
            cwd.mkdir()
            notebook = run / "submission.ipynb"
            nbformat.write(prepare(nb, names, functions), notebook)
            timed_out = execute(registry, notebook, run / "executed.ipynb", cwd,
                                run / "runner.log", options.timeout)
            started = (functions / STARTED).exists()
            if started or timed_out:
                break
        finished = (functions / FINISHED).exists()
        saved = _saved_functions(functions, names, started, finished, timed_out, options.timeout)
        return saved, _note(started, finished, timed_out, options.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _noop():
    return 0


def _grade_or_report(path, options, registry) -> dict:
    """grade_one, or a zero with the grader's own error: one failure never stops a batch."""
    try:
        return grade_one(path, options, registry)
    except Exception as exc:  # noqa: BLE001 - e.g. a full disk while writing the copy
        return {"path": str(path), "homework": options.homework or "", "total": 0, "max": 0,
                "note": f"not graded, the grader failed: {one_line(f'{type(exc).__name__}: {exc}')}",
                "exercises": []}


def grade(paths, options: GradeOptions | None = None, jobs: int = 2,
          quiet: bool = False) -> list[dict]:
    """Grade every notebook in `paths` (in that order in the result), `jobs` at a time.

    The calling process becomes a child subreaper (Linux) for the rest of its life, so
    that no process a submission starts can escape being killed."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm.auto import tqdm

    options = options or GradeOptions()
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    become_subreaper()
    registry = ChildRegistry()
    # Start launch's forkserver now, while no runner exists: a sweep never mistakes it.
    launch(_noop, 1, quiet=True, timeout=300)
    results: list[dict | None] = [None] * len(paths)
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool, \
                tqdm(total=len(paths), disable=quiet, desc="grading", unit="notebook") as bar:
            futures = {pool.submit(_grade_or_report, Path(p), options, registry): i
                       for i, p in enumerate(paths)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update()
    finally:
        registry.sweep()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.course grade",
                                     description="Execute and grade homework notebooks.")
    parser.add_argument("submissions", nargs="+", type=Path, help="notebooks to grade")
    parser.add_argument("--out", type=Path, required=True, help="results.json to write")
    parser.add_argument("--csv", type=Path, help="also write this CSV table")
    parser.add_argument("--jobs", type=int, default=2, help="submissions run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed to execute one notebook (default 300)")
    parser.add_argument("--check-timeout", type=float, default=60.0,
                        help="seconds allowed to one hidden-check launch (default 60)")
    parser.add_argument("--homework", choices=sorted(HOMEWORK),
                        help="grade every submission as this homework")
    parser.add_argument("--exercise", action="append", metavar="ID",
                        help="grade only this exercise (repeatable; default: all)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0 or args.check_timeout <= 0:
        parser.error("--jobs, --timeout and --check-timeout must be positive")
    known = {spec.id for specs in HOMEWORK.values() for spec in specs}
    if unknown := sorted(set(args.exercise or ()) - known):
        parser.error(f"unknown exercise(s) {', '.join(unknown)}")
    options = GradeOptions(homework=args.homework, timeout=args.timeout,
                           check_timeout=args.check_timeout,
                           exercises=tuple(args.exercise) if args.exercise else None)
    started = time.time()
    results = grade(args.submissions, options, jobs=args.jobs, quiet=args.quiet)
    header = {"graded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "seconds": round(time.time() - started, 1)}
    if not args.quiet:
        print(format_table(results))  # first: still shown if the files cannot be written
    write_json(results, args.out, **header)
    if args.csv:
        write_csv(results, args.csv)
    if not args.quiet:
        print(f"\nwrote {args.out}" + (f" and {args.csv}" if args.csv else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
