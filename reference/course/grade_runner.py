"""Execute one submission with papermill, so that the grader can take its functions.

The grader never imports a submission. It rewrites a copy (`prepare`), then runs
it in a runner process of its own (`python -m reference.course.grade_runner`), which
declares itself a child subreaper, executes the copy with papermill in a fresh
kernel, and at the end kills every process left below it.

The rewritten copy differs from the submission in three ways:
  * every code cell is tagged `raises-exception`, so an error in one cell does not
    stop the cells after it (papermill still reports failure at the end: the
    grader ignores its exit status);
  * after every code cell, a cell added by the grader saves each exercise function
    that exists at that point, with cloudpickle, into a folder outside the
    kernel's working directory (a function whose whole body is `raise
    NotImplementedError`, an untouched stub, is saved as the marker `stub:`: it
    scores zero without starting ranks that would only raise it). A notebook that stops early (sys.exit, os._exit, a
    crash, the time limit) keeps the credit of what it defined before;
  * a first and a last added cell leave the files `started` and `finished`, so the
    grader can tell "never ran" (retry) from "stopped early" (report it).
The functions travel as bytes: only the ranks of the hidden checks unpickle them.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import nbformat

from reference.course.procs import ChildRegistry, become_subreaper, kill_descendants

__all__ = ["prepare", "execute", "GRADER_TAG", "main"]

GRADER_TAG = "course-grader"
STARTED, FINISHED = "started", "finished"

# The cell the grader adds after each code cell. It defines, calls and deletes one
# function so that the student's namespace is left as it was.
_SAVE_CELL = '''\
def _course_grader_stub(fn):
    """Added by the grader: True for a function whose whole body raises NotImplementedError."""
    import builtins, dis, types
    if not isinstance(fn, types.FunctionType) or fn.__code__.co_names != ("NotImplementedError",):
        return False
    if fn.__globals__.get("NotImplementedError", builtins.NotImplementedError) is not builtins.NotImplementedError:
        return False
    ops = set(i.opname for i in dis.get_instructions(fn))
    quiet = set(("RESUME", "NOP", "CACHE", "EXTENDED_ARG", "LOAD_GLOBAL", "LOAD_CONST", "PUSH_NULL",
                 "PRECALL", "CALL", "CALL_FUNCTION", "RAISE_VARARGS"))
    return "RAISE_VARARGS" in ops and ops <= quiet


def _course_grader_save(names={names!r}, folder={folder!r}, marker={marker!r}):
    """Added by the grader: save the exercise functions as they are now."""
    import os, cloudpickle
    for name in names:
        fn, path = globals().get(name), os.path.join(folder, name + ".pkl")
        if not callable(fn):
            if os.path.exists(path):
                os.remove(path)
            continue
        try:
            data = b"stub:" if _course_grader_stub(fn) else cloudpickle.dumps(fn)
        except Exception as exc:
            data = ("error:" + type(exc).__name__ + ": " + str(exc))[:300].encode()
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    if marker:
        open(os.path.join(folder, marker), "w").close()
_course_grader_save()
del _course_grader_save, _course_grader_stub
'''


def _save_cell(names, folder, marker=None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(_SAVE_CELL.format(names=tuple(names), folder=str(folder),
                                                       marker=marker))
    cell.metadata["tags"] = ["raises-exception", GRADER_TAG]
    return cell


def prepare(nb: nbformat.NotebookNode, names, folder) -> nbformat.NotebookNode:
    """The copy of submission `nb` the grader executes (see the module docstring)."""
    nb = copy.deepcopy(nb)
    cells = [_save_cell(names, folder, STARTED)]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata["tags"] = list(cell.metadata.get("tags", [])) + ["raises-exception"]
            cells += [cell, _save_cell(names, folder)]
        else:
            cells.append(cell)
    cells.append(_save_cell(names, folder, FINISHED))
    nb.cells = cells
    for cell in nb.cells:
        cell.pop("id", None)
    nb.nbformat_minor = 4  # no cell ids: the added cells need none, and none can clash
    return nb


def execute(registry: ChildRegistry, notebook: Path, output: Path, cwd: Path, log: Path,
            timeout: float) -> bool:
    """Run the prepared `notebook` in a runner process; True when it hit `timeout`.

    The runner leads a new session (the student's kernel cannot signal the grader's
    process group), its output goes to `log`, and whatever is left of it after it
    ends or times out is killed by `registry.release`."""
    # The kernel must be this interpreter: put its folder first on PATH for
    # anything the notebook starts by name (jupyter_client already maps "python").
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    with open(log, "wb") as out:
        proc = registry.popen(
            [sys.executable, "-m", "reference.course.grade_runner", str(notebook), str(output), str(cwd)],
            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        registry.release(proc)


def main(argv=None) -> int:
    """The runner: python -m reference.course.grade_runner NOTEBOOK OUTPUT CWD."""
    notebook, output, cwd = (argv or sys.argv[1:])[:3]
    become_subreaper()
    import psutil
    import papermill

    code = 0
    try:
        papermill.execute_notebook(notebook, output, parameters={"grading": True},
                                   kernel_name="python3", cwd=cwd, progress_bar=False,
                                   log_output=False, start_timeout=120)
    except BaseException as exc:  # noqa: BLE001 - errors in cells are expected; report and go on
        print(f"runner: papermill stopped: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        code = 3
    finally:
        kill_descendants(psutil.Process())
    return code


if __name__ == "__main__":
    sys.exit(main())
