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
    # transitively: the composed step's config is read through parallelize, the clip through step
    assert {"parallel.config", "parallel.clip", "parallel.data_parallelism"} <= set(budget.topic_files("the composed step"))
    assert all(f.split(".")[0] == budget.TOPICS[t][1] for t in budget.TOPICS for f in budget.topic_files(t))
    # fp16's loss scaler and post-validation, imported under their option's `if`, are named apart
    assert set(budget.topic_options("the composed step")) == {"parallel.scaler", "parallel.post_validation"}


def test_an_import_inside_a_function_counts_unless_it_only_draws(tmp_path, monkeypatch):
    pkg = tmp_path / "reference" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "entry.py").write_text("from reference.pkg.top import x\n\ndef f():\n"
                                  "    from reference.pkg.helper import y\n    from reference.pkg.viz import plot\n")
    for name in ("top", "helper", "viz", "unread"):
        (pkg / f"{name}.py").write_text("x = y = plot = 1\n")
    monkeypatch.setattr(budget, "PACKAGE", tmp_path / "reference")
    monkeypatch.setitem(budget.TOPICS, "toy", (["pkg.entry"], "pkg"))
    assert budget.topic_files("toy") == ["pkg.entry", "pkg.helper", "pkg.top"]
    (pkg / "entry.py").write_text("from reference.pkg import viz\n")  # a picture loaded at the top is read
    assert budget.topic_files("toy") == ["pkg.entry", "pkg.viz"]


def test_a_table_of_kinds_is_counted_and_hides_nothing():
    """The schedules' registry counts under the topics that call it, its imports are not followed
    (a reader follows the kind they build), and each module it names is an entry point of a topic
    that calls it: 1F1B reads `schedules.py` and not the zero-bubble modules, zero-bubble reads both."""
    one_f_one_b, zero_bubble = set(budget.topic_files("1F1B")), set(budget.topic_files("zero-bubble"))
    assert "pipeline_parallel.registry" in one_f_one_b & zero_bubble
    assert not one_f_one_b & {"pipeline_parallel.zero_bubble", "pipeline_parallel.split_backward",
                              "pipeline_parallel.overlap", "pipeline_parallel.async_messages"}
    for table in budget.TABLES:
        entries = set().union(*(set(e) for e, _ in budget.TOPICS.values() if table in e))
        assert budget._imports(table) <= entries, f"{table} names a module no topic that calls it reads"


def test_an_import_under_an_if_in_a_function_is_an_option_named_beside_the_topic(tmp_path, monkeypatch):
    """One option's own module (fp16's loss scaler, post-validation), loaded only when the option
    is on, is not added into the topic: the table names it, with its lines of code, as an option."""
    pkg = tmp_path / "reference" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "entry.py").write_text("def f(on):\n    from reference.pkg.always import x\n    if on:\n"
                                  "        from reference.pkg.option import z\n")
    (pkg / "always.py").write_text("x = 1\n")
    (pkg / "option.py").write_text("z = 1\nw = 2\n")
    monkeypatch.setattr(budget, "PACKAGE", tmp_path / "reference")
    monkeypatch.setitem(budget.TOPICS, "toy", (["pkg.entry"], "pkg"))
    assert budget.topic_files("toy") == ["pkg.always", "pkg.entry"]
    assert budget.topic_options("toy") == {"pkg.option": 2}


def test_the_manual_prints_the_scripts_table():
    manual = (ROOT / "docs" / "reading-budget.md").read_text()
    assert budget.table(markdown=True) in manual, "rerun: python bench/reading_budget.py --markdown"
    assert f"under {budget.PACKAGE_CODE_LINES:,} lines of code" in manual


def test_the_composing_layer_branches_on_the_data_parallel_way_only_in_its_factory():
    """`train_step`, the gather and sampling ask `pm.data_parallel`; the branch conditions that
    still name the ZeRO stage or FSDP in `parallel/` and `train/` are counted and held."""
    assert budget.data_parallel_branches() <= 20


def test_the_package_outside_course_stays_under_its_size():
    """Lines of code, prose not counted: a part that is added pays for its code elsewhere, and an
    explanation never has to go to make room."""
    assert budget.package_lines() < budget.PACKAGE_CODE_LINES, \
        f"reference/ outside course/ holds {budget.package_lines()} lines of code, over {budget.PACKAGE_CODE_LINES}"
