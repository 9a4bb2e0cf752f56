"""What a student reads: the files behind each technique, and their lines of code.

    python bench/reading_budget.py              # the table, then the package's shape
    python bench/reading_budget.py --markdown   # the table as docs/reading-budget.md prints it

A topic starts at the module a student opens first (DDP at `data_parallel/ddp.py`) and
takes in every module of its own folder that module imports, and what those import, in
turn: the files one has to read to follow the technique to its end. Pictures (`viz`,
`widgets`) are left out: they draw a technique, they do not do it. The composed step takes
`parallel/step.py`, the data-parallel ways it asks (`parallel/data_parallelism.py`) and the
modules of `parallel/` and `zero/` these two import by name (their direct helpers); the
parallelisms they call through their packages count under their own topics.

A line of code is a line holding a token of Python other than a comment, its docstrings
(a module's, a class's, a function's) left out. Each topic has a budget (`BUDGET`) that
`tests/test_reading_budget.py` holds, and a target the course reads towards (`TARGET`);
docs/reading-budget.md's table is this script's table.

Below the table, the package's shape: its lines outside `course/`, the functions over 60
lines of code, the names starting with `_` that one module imports from another, and the
lines of the composing layer (`parallel/`, `train/`, `config.py` aside) whose branch
conditions name how the data-parallel gradients and weights are kept (`zero_stage`,
`fsdp`, `sharded`, `reshard_after_forward`), the one factory that chooses the way aside.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "reference"

# topic: (the modules a student opens first, the folders their imports are followed into,
# how deep: None = to the end, 1 = the direct imports only)
TOPICS = {
    "DDP": (["data_parallel.ddp"], ["data_parallel"], None),
    "TP layers (Megatron)": (["tensor_parallel.layers"], ["tensor_parallel"], None),
    "1F1B": (["pipeline_parallel.schedules", "pipeline_parallel.executor"], ["pipeline_parallel"], None),
    "zero-bubble": (["pipeline_parallel.zero_bubble", "pipeline_parallel.split_backward"], ["pipeline_parallel"],
                    None),
    "ZeRO-3 composed with TP and PP": (["zero.fsdp_param", "zero.fsdp_reshard"], ["zero"], None),
    "the composed step": (["parallel.step", "parallel.data_parallelism"], ["parallel", "zero"], 1),
}
PICTURES = ("viz", "widgets")
# the most lines of code each topic may take: a change that makes reading longer fails the
# test; where a topic is over its target, its budget is what it takes today, lowered as it shrinks
BUDGET = {"DDP": 300, "TP layers (Megatron)": 320, "1F1B": 400, "zero-bubble": 600,
          "ZeRO-3 composed with TP and PP": 400, "the composed step": 500}
# what the course reads towards
TARGET = {"DDP": 300, "TP layers (Megatron)": 320, "1F1B": 400, "zero-bubble": 600,
          "ZeRO-3 composed with TP and PP": 400, "the composed step": 500}
# the package's physical lines outside `course/` (code, docstrings, comments, blank lines) stay
# under this size, what the package took before each technique was read as one way to do it:
# a new part pays for its lines
PACKAGE_LINES = 18_431
LONG = 60  # lines of code: a function longer than this holds more than one idea
DP_BRANCH = re.compile(r"\b(zero_stage|fsdp|sharded|reshard_after_forward)\b")


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> set[int]:
    """The numbers of the lines that hold code: a token other than a comment, outside docstrings."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - _docstring_lines(ast.parse(source))


def _path(module: str) -> Path:
    path = PACKAGE / Path(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"


def _imports(module: str) -> set[str]:
    """The modules of `reference` that ``module`` imports by name (a package's own names not)."""
    out = set()
    for node in ast.walk(ast.parse(_path(module).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reference."):
            name = node.module[len("reference."):]
            if _path(name).name != "__init__.py":
                out.add(name)
    return out


def topic_files(topic: str) -> list[str]:
    """The modules (dotted, under `reference`) a student reads for ``topic``."""
    entries, folders, depth = TOPICS[topic]
    seen, frontier, level = set(entries), list(entries), 0
    while frontier and (depth is None or level < depth):
        level += 1
        found = {m for f in frontier for m in _imports(f)
                 if m.split(".")[0] in folders and m.split(".")[-1] not in PICTURES}
        frontier = sorted(found - seen)
        seen |= found
    return sorted(seen)


def topic_lines(topic: str) -> dict[str, int]:
    return {m: len(code_lines(_path(m).read_text())) for m in topic_files(topic)}


def _outside_course() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "course" not in p.relative_to(PACKAGE).parts]


def package_lines() -> int:
    return sum(len(p.read_text().splitlines()) for p in _outside_course())


def long_functions() -> list[tuple[str, int]]:
    """(module:function, lines of code) of every function over `LONG` lines outside `course/`."""
    out = []
    for path in _outside_course():
        source = path.read_text()
        lines = code_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len([i for i in lines if node.lineno <= i <= node.end_lineno]) - len(
                    _docstring_lines(node) & lines)
                if n > LONG:
                    out.append((f"{path.relative_to(PACKAGE)}:{node.name}", n))
    return sorted(out, key=lambda x: -x[1])


def private_imports() -> list[str]:
    """`module: name` for each name starting with `_` imported from another module of `reference`."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reference"):
                out += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def data_parallel_branches() -> int:
    """Lines of code in `parallel/` and `train/` (`parallel/config.py`, which validates, aside)
    whose branch conditions (`if`, `elif`, `while`, `x if c else y`) name how the data-parallel
    state is kept; the one factory that chooses the way (`data_parallelism`) aside."""
    count = 0
    for folder in ("parallel", "train"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            if path.name == "config.py" and folder == "parallel":
                continue
            source = path.read_text()
            tree, text = ast.parse(source), source.splitlines()
            factory = {i for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                       and node.name == "data_parallelism" for i in range(node.lineno, node.end_lineno + 1)}
            lines = set()
            for node in ast.walk(tree):
                test = getattr(node, "test", None) if isinstance(node, (ast.If, ast.IfExp, ast.While)) else None
                tests = [test] if test is not None else list(getattr(node, "ifs", []))
                for t in tests:
                    lines.update(i for i in range(t.lineno, t.end_lineno + 1)
                                 if DP_BRANCH.search(text[i - 1]) and i not in factory)
            count += len(lines)
    return count


def shape() -> dict:
    return {f"lines outside course/ (under {PACKAGE_LINES})": package_lines(),
            "functions over 60 lines of code": long_functions(),
            "private names imported across modules": private_imports(),
            "data-parallel branching lines in parallel/ and train/": data_parallel_branches()}


def table(markdown: bool) -> str:
    rows = []
    for topic in TOPICS:
        lines = topic_lines(topic)
        files = ", ".join(f"`{m.replace('.', '/')}.py` {n}" for m, n in lines.items())
        rows.append((topic, sum(lines.values()), BUDGET[topic], TARGET[topic], files))
    if markdown:
        out = ["| topic | lines of code | budget | target | files (lines of code) |", "|---|---|---|---|---|"]
        return "\n".join(out + [f"| {t} | {n} | {b} | {g} | {f} |" for t, n, b, g, f in rows])
    return "\n".join(f"{t:32} {n:5} (budget {b}, target {g})\n    {f}" for t, n, b, g, f in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="the table as docs/reading-budget.md prints it")
    args = parser.parse_args()
    print(table(args.markdown))
    if not args.markdown:
        print()
        for what, value in shape().items():
            if isinstance(value, list):
                print(f"{what}: {len(value)}")
                for item in value:
                    print(f"    {item[0]} {item[1]}" if isinstance(item, tuple) else f"    {item}")
            else:
                print(f"{what}: {value}")


if __name__ == "__main__":
    main()
