"""A homework's solution cell as a student's notebook would define it, for the tests that
score changed copies of it (each mistake is the solution with one edit)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import nbformat

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"
IMPORTS = "import math\nimport torch\nimport torch.distributed as dist\n"


def solution_source(stem: str, exercise: str) -> str:
    """The source of the cell tagged `exercise` in solutions/<stem>.ipynb."""
    nb = nbformat.read(SOLUTIONS / f"{stem}.ipynb", as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code"
                and c.metadata.get("course", {}).get("exercise") == exercise)


def solution_function(stem: str, exercise: str, *edits, imports: str = IMPORTS, every: bool = False):
    """The solution's function with each (old, new) replaced once (``every``: wherever it
    occurs; old must be there), defined under `imports` as a notebook defines it: not
    importable, so pickled by value."""
    source = solution_source(stem, exercise)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, -1 if every else 1)
    namespace = {"__name__": "student"}
    exec(imports + source, namespace)
    return namespace[exercise]


def subgroup_only(spec):
    """`spec` with one case only, its first on the subgroup of ranks 1 .. p - 1: one launch (a
    rank that raises in a launch of several cases makes the grader run each again alone)."""
    return dataclasses.replace(spec, make_cases=lambda g, w, make=spec.make_cases: [
        c for c in make(g, w) if "subgroup" in c.name][:1])
