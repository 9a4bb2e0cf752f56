"""What a student reads: the files behind each technique, and their lines of code.

    python bench/reading_budget.py              # the table, then the package's shape
    python bench/reading_budget.py --markdown   # the table as docs/reading-budget.md prints it

A topic starts at the modules that hold what a notebook calls (1F1B: `build_schedule`,
`run_pipeline` and `split_stages`, in `registry.py`, `accounting.py` and `stage.py`, and the
builders of its kinds, in `schedules.py`). From there the count follows imports, transitively,
into every module of the topic's own package: the files a reader has to open to follow the
technique to its end. An import counts when it runs on the way: at the top of a module, or
inside a function unless the module it loads is a picture (`viz`, `widgets`) loaded only to draw,
or unless it sits under an `if` in that function: then it is one option's own module (fp16's loss
scaler, optimizer post-validation), loaded only when the option is on, and the table names it
beside the topic as an option, with its lines of code, instead of adding it in.
One kind of module is counted but not followed: a table of kinds (`TABLES`: the pipeline's
`registry.py`, one dict naming each schedule's builder where it is written). A reader follows
the kind they build, not every kind the table names, so the modules of a topic's kinds are its
entry points (1F1B's `schedules.py`, zero-bubble's `zero_bubble.py` and `dualpipe.py`). A package's `__init__.py`
only re-exports and registers nothing: what a topic runs is named where a reader looks (the
executor's table, a schedule's own). The shared core (`runtime`, `comms`, `model`, ...) and the
other parallelisms are not counted under a topic; they have their own.

A line of code is a line holding a token of Python other than a comment, its docstrings
(a module's, a class's, a function's) left out: prose is never counted, so an explanation never
has to go to meet a budget. Each topic has a target (`TARGET`) and a budget (`BUDGET`) that
`tests/test_reading_budget.py` holds: the target, or what the topic takes today where it is
still over its target. docs/reading-budget.md's table is this script's table.

Below the table, the package's shape: its lines of code outside `course/` (held under
`PACKAGE_CODE_LINES`), the functions over 60 lines of code, the names starting with `_` that
one module imports from another, and the lines of the composing layer (`parallel/`, `train/`,
`config.py` aside) whose branch conditions name how the data-parallel gradients and weights
are kept (`zero_stage`, `fsdp`, `sharded`, `reshard_after_forward`), the one factory that
chooses the way aside.
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

# topic: (the modules holding what a notebook calls, the package whose modules are followed)
TOPICS = {
    "DDP": (["data_parallel.ddp"], "data_parallel"),
    "ZeRO-1/2": (["zero.optimizer"], "zero"),
    "ZeRO-3 by blocks (FSDP)": (["zero.fsdp"], "zero"),
    "ZeRO-3 composed with TP and PP": (["zero.fsdp_param", "zero.fsdp_reshard"], "zero"),
    "TP layers (Megatron)": (["tensor_parallel.layers"], "tensor_parallel"),
    "TP on the GPT": (["tensor_parallel.plan"], "tensor_parallel"),
    "1F1B": (["pipeline_parallel.registry", "pipeline_parallel.schedules", "pipeline_parallel.accounting",
              "pipeline_parallel.stage"], "pipeline_parallel"),
    "zero-bubble": (["pipeline_parallel.registry", "pipeline_parallel.zero_bubble", "pipeline_parallel.split_backward"],
                    "pipeline_parallel"),
    "DualPipe": (["pipeline_parallel.registry", "pipeline_parallel.dualpipe", "pipeline_parallel.overlap"],
                 "pipeline_parallel"),
    "the composed step": (["parallel.step", "parallel.parallelize", "parallel.config"], "parallel"),
}
PICTURES = ("viz", "widgets")
# tables of kinds: counted where a topic calls them, their imports not followed (a reader follows
# the kind they build; each topic names the modules of its kinds among its entry points)
TABLES = ("pipeline_parallel.registry",)
# what each topic should take at most, in lines of code
TARGET = {"DDP": 300, "ZeRO-1/2": 450, "ZeRO-3 by blocks (FSDP)": 450, "ZeRO-3 composed with TP and PP": 450,
          "TP layers (Megatron)": 320, "TP on the GPT": 700, "1F1B": 600, "zero-bubble": 900,
          "DualPipe": 1057,  # no target given yet: held at what it reads today
          "the composed step": 700}
# what the test holds: the target, or, where a topic is still over it, what it takes today
# (lowered as it shrinks), so that a change that makes reading longer fails
BUDGET = {**TARGET, "1F1B": 815, "the composed step": 818}
# the package's lines of code outside `course/` (docstrings, comments and blank lines not counted)
PACKAGE_CODE_LINES = 12_500
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


def _imported(node: ast.ImportFrom) -> list[str]:
    """The modules of `reference` a ``from ... import ...`` names: the module, or from a package
    the names that are its modules (``from reference.x import viz``); a package's re-exported
    names are read where they are defined, so its `__init__` is not followed."""
    name = node.module[len("reference."):]
    if _path(name).name != "__init__.py":
        return [name]
    return [f"{name}.{a.name}" for a in node.names if (PACKAGE / Path(*name.split(".")) / f"{a.name}.py").exists()]


def _imports(module: str, options: bool = False) -> set[str]:
    """The modules of `reference` that ``module`` loads when it runs: its imports at the top,
    and those inside functions unless they load a picture (imported there only to draw) or sit
    under an `if` (an option's own module). ``options=True``: those under an `if` instead."""
    tree = ast.parse(_path(module).read_text())
    out = set()

    def visit(node, in_function: bool, under_if: bool) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("reference."):
            for name in _imported(node):
                if not in_function:
                    taken = not options
                elif name.split(".")[-1] in PICTURES:
                    taken = False
                else:
                    taken = under_if == options
                if taken:
                    out.add(name)
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        under_if = under_if or (in_function and isinstance(node, ast.If))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, under_if)

    visit(tree, False, False)
    return out


def topic_files(topic: str) -> list[str]:
    """The modules (dotted, under `reference`) a student reads for ``topic``: its entry points
    and what they load of their package, transitively."""
    entries, package = TOPICS[topic]
    seen, frontier = set(), list(entries)
    while frontier:
        module = frontier.pop()
        if module in seen:
            continue
        seen.add(module)
        if module not in TABLES:
            frontier += [m for m in _imports(module) if m.split(".")[0] == package and m not in seen]
    return sorted(seen)


def topic_options(topic: str) -> dict[str, int]:
    """The modules of the topic's package that its files load only under an option (an import
    under an `if` in a function), with their lines of code: read when that option is on."""
    files, package = topic_files(topic), TOPICS[topic][1]
    names = {m for f in files for m in _imports(f, options=True) if m.split(".")[0] == package} - set(files)
    return {m: len(code_lines(_path(m).read_text())) for m in sorted(names)}


def topic_lines(topic: str) -> dict[str, int]:
    return {m: len(code_lines(_path(m).read_text())) for m in topic_files(topic)}


def _outside_course() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "course" not in p.relative_to(PACKAGE).parts]


def package_lines() -> int:
    """Lines of code outside `course/` (`code_lines`: prose is not counted)."""
    return sum(len(code_lines(p.read_text())) for p in _outside_course())


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
    return {f"lines of code outside course/ (under {PACKAGE_CODE_LINES:,})": package_lines(),
            "functions over 60 lines of code": long_functions(),
            "private names imported across modules": private_imports(),
            "data-parallel branching lines in parallel/ and train/": data_parallel_branches()}


def table(markdown: bool) -> str:
    rows = []
    for topic in TOPICS:
        lines = topic_lines(topic)
        files = ", ".join(f"`{m.replace('.', '/')}.py` {n}" for m, n in lines.items())
        options = topic_options(topic)
        if options:
            files += "; options, read when on: " + ", ".join(
                f"`{m.replace('.', '/')}.py` {n}" for m, n in options.items())
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
