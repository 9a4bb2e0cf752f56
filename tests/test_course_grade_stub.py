"""The grader's shortcut for untouched stubs: a function whose whole body raises
NotImplementedError scores zero without ranks; anything else is launched and judged."""
from __future__ import annotations

import builtins

import pytest

from reference.course import grade_runner


def _stub_test():
    """The `_course_grader_stub` the grader's added cells define in the kernel."""
    source = grade_runner._SAVE_CELL.format(names=(), folder="/nonexistent", marker=None)
    namespace: dict = {}
    exec(source.split("\n\n\ndef _course_grader_save")[0], namespace)
    return namespace["_course_grader_stub"]


def stub(x, group=None):
    """Docstrings are not code."""
    raise NotImplementedError("Exercise x: not implemented yet; write your answer here")


def bare_stub(x):
    raise NotImplementedError


def conditional(x):
    if x is None:
        raise NotImplementedError
    return x


def communicates_first(x):
    x.append(1)  # did something before giving up: the ranks must see it
    raise NotImplementedError


def other_error(x):
    raise ValueError("not this one")


@pytest.mark.parametrize("fn, is_stub", [(stub, True), (bare_stub, True), (conditional, False),
                                         (communicates_first, False), (other_error, False),
                                         (len, False), (type("Optimizer", (), {}), False)])
def test_only_a_function_that_does_nothing_but_raise_is_a_stub(fn, is_stub):
    assert _stub_test()(fn) is is_stub


def test_a_shadowed_not_implemented_error_is_not_trusted():
    namespace = {"NotImplementedError": ValueError}
    exec("def f(x):\n    raise NotImplementedError\n", namespace)
    assert namespace["NotImplementedError"] is not builtins.NotImplementedError
    assert _stub_test()(namespace["f"]) is False
