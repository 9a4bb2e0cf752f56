"""The package's layers, read from the source (ast, nothing is imported or executed).

    core           runtime, comms, mesh, model, loss, data, memory, viz, tolerance
    parallelisms   data_parallel < zero < tensor_parallel < pipeline_parallel
                   < expert_parallel < context_parallel (the order they are taught)
    composing      everything that puts them together (train, ...)
    course         the course's machinery: exercises, grader, checks, homework

Rules: the core imports no parallelism; a parallelism imports only the core and
the parallelisms taught before it; nothing outside `reference/course/` imports it;
`model` imports nothing from `torch.distributed`; no two files import each other,
directly or round a longer circle (imports inside functions count: they run too).

`test_checker_catches_each_violation` builds a small package that breaks every
rule once and shows the checker reporting each; the other tests run it on
`reference/` itself.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CORE = ("runtime", "comms", "mesh", "model", "loss", "data", "memory", "viz", "tolerance")
PARALLELISMS = ("data_parallel", "zero", "tensor_parallel", "pipeline_parallel",
                "expert_parallel", "context_parallel")
COMPOSING = ("train", "parallel", "profile")
COURSE = "course"


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package folder."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules of the package `name` imports (anywhere in the file), with line numbers.

    `from a.b import c` names module a.b.c when that is a file, else a.b; relative
    imports are resolved against the file's package."""
    top = next(iter(known)).split(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out += [(t, node.lineno) for t in targets]
    return [(t, line) for t, line in out if t == top or t.startswith(top + ".") or t.startswith("torch.distributed")]


def unit_of(module: str) -> str:
    """reference.zero.fsdp -> zero; reference.model -> model."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(package_dir: Path) -> list[str]:
    known = modules(package_dir)
    problems = []
    for name, path in known.items():
        unit = unit_of(name)
        where = path.relative_to(package_dir.parent)
        if unit and unit not in CORE + PARALLELISMS + COMPOSING + (COURSE,):
            problems.append(f"{where}: `{unit}` is in no layer; add it to tests/test_layers.py")
            continue
        for target, line in imports_of(name, path, known):
            if target.startswith("torch.distributed"):
                if unit == "model":
                    problems.append(f"{where}:{line}: the model imports {target}; it must "
                                    f"know nothing of distribution")
                continue
            other = unit_of(target)
            if not other or other == unit:
                continue
            if other == COURSE and unit != COURSE:
                problems.append(f"{where}:{line}: imports {target}; only reference/course/ "
                                f"may import the course's machinery")
            elif unit in CORE and other not in CORE:
                problems.append(f"{where}:{line}: the core ({unit}) imports {target}")
            elif unit in PARALLELISMS and other not in CORE and not (
                    other in PARALLELISMS and PARALLELISMS.index(other) < PARALLELISMS.index(unit)):
                problems.append(f"{where}:{line}: {unit} imports {target}; a parallelism may "
                                f"import only the core and the parallelisms taught before it")
    return problems


def import_cycles(package_dir: Path) -> list[list[str]]:
    """Every elementary circle of imports between files, found by depth-first search."""
    known = modules(package_dir)
    graph = {name: sorted({t for t, _ in imports_of(name, path, known) if t in known and t != name})
             for name, path in known.items()}
    cycles, seen = [], set()
    state = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state[nxt] == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cycle)
            elif state[nxt] == 0:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if state[node] == 0:
            visit(node)
    return cycles


def test_reference_keeps_its_layers():
    problems = layer_violations(ROOT / "reference")
    assert not problems, "layer rules broken:\n  " + "\n  ".join(problems)


def test_reference_has_no_import_cycles():
    cycles = import_cycles(ROOT / "reference")
    assert not cycles, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_every_package_maps_its_technique():
    """Each sub-package's __init__ has a docstring (the map) that names its modules."""
    for init in sorted((ROOT / "reference").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 5, f"{init} needs a docstring that maps the package"
        for sibling in sorted(init.parent.glob("*.py")):
            if sibling.stem not in ("__init__", "__main__"):
                assert sibling.stem in doc, f"{init}'s docstring does not mention {sibling.name}"


# Functions still over the limit, to be split by idea; the list only shrinks.
LONG_TODAY: set = set()


def test_no_function_holds_two_ideas():
    """A function over 60 lines of code (docstring and comments aside) outside `course/` holds
    more than one idea: split it where the ideas part (the design's rule is by idea, not by a
    file's size; what a student reads per topic is held by tests/test_reading_budget.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reading_budget", ROOT / "bench" / "reading_budget.py")
    budget = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(budget)
    long = {name for name, _ in budget.long_functions()}
    assert long <= LONG_TODAY, f"split these functions: {sorted(long - LONG_TODAY)}"
    assert LONG_TODAY <= long, f"no longer over the limit, take them off LONG_TODAY: {sorted(LONG_TODAY - long)}"


def private_uses(package_dir: Path) -> list[str]:
    """Every private name (one leading underscore) a file takes from another module of the
    package: `from a.b import _x`, or `b._x` on a module `b` it imported."""
    known = modules(package_dir)
    top = package_dir.name
    found = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(package_dir.parent)
        imported = {}  # local name -> module of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{mod}.{a.name}" in known:
                        imported[a.asname or a.name] = f"{mod}.{a.name}"
                    elif a.name.startswith("_") and mod != name and (mod == top or mod.startswith(top + ".")):
                        found.append(f"{where}:{node.lineno}: from {mod} import {a.name}")
            elif isinstance(node, ast.Import):
                imported.update((a.asname, a.name) for a in node.names if a.asname and a.name in known)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{where}:{node.lineno}: {imported[node.value.id]}.{node.attr}")
    return sorted(set(found))


# Private names the course's machinery still reaches across modules; the list only shrinks.
PRIVATE_TODAY = {
    # the homework's pipeline exercise replaces the schedules' grouping to refuse build_schedule
    "reference/course/homework/pipeline_runs.py: reference.pipeline_parallel.schedules._compute_groups",
}


def test_no_private_name_crosses_modules():
    """What another module uses is public (or lives where it is used): a student reads a
    module's public names as its interface."""
    uses = {f"{u.split(':')[0]}:{u.split(':', 2)[2]}" for u in private_uses(ROOT / "reference")}
    assert uses <= PRIVATE_TODAY, "private names used across modules:\n  " + "\n  ".join(sorted(uses - PRIVATE_TODAY))
    assert PRIVATE_TODAY <= uses, f"no longer used, take them off PRIVATE_TODAY: {sorted(PRIVATE_TODAY - uses)}"


def test_the_private_name_checker_finds_both_forms(tmp_path):
    package = _write(tmp_path, {
        "__init__.py": "",
        "viz.py": "_Figure = 1\n_x = 2\n",
        "model.py": "from reference.viz import _Figure\n",
        "data.py": "from reference import viz\ny = viz._x\n",
        "mesh.py": "from reference.viz import _Figure as F\n",
    })
    uses = private_uses(package)
    assert uses == ["reference/data.py:2: reference.viz._x",
                    "reference/mesh.py:1: from reference.viz import _Figure",
                    "reference/model.py:1: from reference.viz import _Figure"], uses


def test_the_design_manual_lists_every_module():
    """docs/design.md's package table names each module of each folder of `reference/`."""
    manual = (ROOT / "docs" / "design.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in manual.splitlines()
            if line.startswith("| `reference/")}
    missing = []
    for folder in sorted(p for p in (ROOT / "reference").iterdir() if (p / "__init__.py").exists()):
        row = rows.get(f"reference/{folder.name}/", "")
        missing += [f"reference/{folder.name}/{m.stem}" for m in sorted(folder.glob("*.py"))
                    if m.stem not in ("__init__", "__main__") and f"`{m.stem}`" not in row]
    assert not missing, "docs/design.md's package table does not name: " + ", ".join(missing)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "reference" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "reference"


def test_checker_catches_each_violation(tmp_path):
    """A deliberately broken package: each rule is violated once and reported."""
    package = _write(tmp_path, {
        "__init__.py": "",
        "model.py": "import torch.distributed as dist\n",                        # model + dist
        "viz.py": "from reference.zero import FSDP\n",                             # core -> parallelism
        "zero/__init__.py": "from reference.zero.fsdp import FSDP\n",
        "zero/fsdp.py": "def f():\n    from reference.tensor_parallel import g\n",  # taught later
        "tensor_parallel/__init__.py": "from .layers import g\n",
        "tensor_parallel/layers.py": "from reference.data_parallel import DDP\ng = 1\n",  # fine
        "data_parallel/__init__.py": "import reference.course\nDDP = 1\n",         # -> course
        "course/__init__.py": "",
        "course/checks.py": "from reference.zero import FSDP\nx = 1\n",         # fine
        "pipeline_parallel/__init__.py": "",
        "pipeline_parallel/a.py": "from reference.pipeline_parallel.b import y\nx = 1\n",
        "pipeline_parallel/b.py": "def f():\n    from . import c\ny = 1\n",       # lazy, still a cycle
        "pipeline_parallel/c.py": "from reference.pipeline_parallel import a\n",
        "mystery.py": "",                                                            # no layer
    })
    problems = "\n".join(layer_violations(package))
    assert "model imports torch.distributed" in problems
    assert "the core (viz) imports reference.zero" in problems
    assert "zero imports reference.tensor_parallel" in problems
    assert "reference/data_parallel/__init__.py:1: imports reference.course;" in problems
    assert "`mystery` is in no layer" in problems
    assert "tensor_parallel/layers.py" not in problems and "course/checks.py" not in problems
    cycles = import_cycles(package)
    assert [sorted(set(c)) for c in cycles] == [["reference.pipeline_parallel.a",
                                                 "reference.pipeline_parallel.b",
                                                 "reference.pipeline_parallel.c"]]


@pytest.mark.parametrize("statement", [
    "from reference.runtime import launch",
    "from reference.comms import CommMeter",
    "from reference.data_parallel import DDP",
    "from reference.zero import ZeroOptimizer, FSDP",
    "from reference.tensor_parallel import ColumnParallelLinear, apply_tensor_parallel",
    "from reference.pipeline_parallel import build_schedule, run_pipeline",
    "from reference.expert_parallel import MoE, ExpertParallelMoE",
    "from reference.course.checks import check_ring_all_reduce",
])
def test_public_imports(statement):
    exec(statement, {})


def test_readme_and_manuals_name_only_what_exists():
    """Every `reference/...` path and `reference.x` module the README and docs/ name exists."""
    import importlib.util
    import re

    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    paths = set(re.findall(r"\breference/[\w/.]*\w", text))
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    dotted = set(re.findall(r"\breference(?:\.\w+)+", text))
    for name in sorted(dotted):
        # reference.runtime.device() names a function: drop trailing parts until a module
        parts = name.split(".")
        def found(name):
            try:
                return importlib.util.find_spec(name) is not None
            except ModuleNotFoundError:  # a.b.c where a.b is a module, not a package
                return False

        while len(parts) > 1 and not found(".".join(parts)):
            parts.pop()
        if len(parts) == 1:
            missing.append(name)
    assert paths and not missing, f"the README or docs/ name what does not exist: {missing}"
