"""The reading budget: the files a student opens for each technique stay within their lines
of code (`bench/reading_budget.py` counts them), and docs/reading-budget.md prints the script's table."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("reading_budget", ROOT / "bench" / "reading_budget.py")
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)


def test_a_line_of_code_leaves_out_docstrings_comments_and_blank_lines():
    source = ('"""Module docstring,\n\non three lines."""\nimport os  # a comment\n\n'
              '# a comment line\nclass A:\n    """Class docstring."""\n    x = (1,\n         2)\n\n'
              'def f():\n    """Docstring."""\n    s = """not a docstring"""\n    return s\n')
    assert sorted(budget.code_lines(source)) == [4, 7, 9, 10, 12, 14, 15]


def test_each_topic_stays_within_its_budget():
    over = {t: sum(budget.topic_lines(t).values()) for t in budget.TOPICS}
    over = {t: n for t, n in over.items() if n > budget.BUDGET[t]}
    assert not over, f"over the reading budget (lines of code): {over}; budgets {budget.BUDGET}"
    assert all(budget.BUDGET[t] >= budget.TARGET[t] for t in budget.TOPICS)


def test_a_topic_follows_the_imports_of_its_own_folder():
    files = budget.topic_files("DDP")
    assert "data_parallel.ddp" in files and "data_parallel.buckets" in files
    assert not any(f.endswith(("viz", "widgets")) for t in budget.TOPICS for f in budget.topic_files(t))
    assert all(f.split(".")[0] in ("parallel", "zero") for f in budget.topic_files("the composed step"))


def test_the_manual_prints_the_scripts_table():
    manual = (ROOT / "docs" / "reading-budget.md").read_text()
    assert budget.table(markdown=True) in manual, "rerun: python bench/reading_budget.py --markdown"
    assert f"under {budget.PACKAGE_LINES:,} lines" in manual


def test_the_composing_layer_branches_on_the_data_parallel_way_only_in_its_factory():
    """`train_step`, the gather and sampling ask `pm.data_parallel`; the branch conditions that
    still name the ZeRO stage or FSDP in `parallel/` and `train/` are counted and held."""
    assert budget.data_parallel_branches() <= 20


def test_the_package_outside_course_stays_under_its_size():
    """Physical lines, prose included: a part that is added pays for its lines elsewhere."""
    assert budget.package_lines() < budget.PACKAGE_LINES, \
        f"reference/ outside course/ holds {budget.package_lines()} lines, over {budget.PACKAGE_LINES}"
