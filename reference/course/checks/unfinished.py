"""Run All on an exercise notebook goes through: an unfinished exercise is one line, never a traceback.

Two helpers, used by every homework notebook:

* `unfinished(fn, exercise_id)` reads `fn`'s code (and the code of the functions and
  classes of the same notebook it names, recursively) for the stub that
  `reference.course.exercises` puts in place of an answer. The visible checks call it
  first, so that a check of an exercise not yet started prints "not implemented yet"
  at once instead of starting ranks to find out.
* `example(*names)` wraps a notebook cell that runs an exercise's function outside its
  check (a printed example, a picture, a measurement):

      with example("ring_doubling_crossover"):
          n = ring_doubling_crossover(8, 5e-6, 1 / 50e9)
          print(n)

  When an exercise it runs is not implemented yet (its stub raises
  NotImplementedError, in this process or in a rank started by `launch`), the cell
  prints one line saying so and the notebook goes on. Any other error is raised as
  usual: it is a bug to see.
"""
from __future__ import annotations

import types
from contextlib import contextmanager

from reference.runtime import RankError

__all__ = ["unfinished", "example", "STUB_TEXT"]

STUB_TEXT = "not implemented yet; write your answer here"  # in every stub's message


def _codes(obj):
    """The code objects of a function, or of a class's own methods (not of the classes its
    attributes hold: an autograd Function's class points to its backward class and back)."""
    if isinstance(obj, type):
        values = list(vars(obj).values())
    else:
        values = [obj]
    for value in values:
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            yield value.__code__


def unfinished(fn, exercise_id: str) -> bool:
    """True when `fn`, or a function or class of its notebook that it names, still holds
    the stub of `exercise_id` (its `raise NotImplementedError("Exercise ...")`)."""
    stub = f"Exercise {exercise_id}: {STUB_TEXT}"
    module = getattr(fn, "__module__", None)
    namespace = getattr(fn, "__globals__", {})
    seen, todo = set(), list(_codes(fn))
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                todo.append(const)
            elif const == stub:
                return True
        for name in code.co_names:  # the notebook's own helpers it calls, not imports
            value = namespace.get(name)
            if getattr(value, "__module__", None) == module and not isinstance(value, types.ModuleType):
                todo.extend(_codes(value))
    return False


def _not_implemented(exc: BaseException) -> str | None:
    """The stub's first line when `exc` is an unfinished exercise, else None."""
    if isinstance(exc, NotImplementedError):
        return str(exc).splitlines()[0] if str(exc) else "NotImplementedError"
    if isinstance(exc, RankError):
        summary = (getattr(exc, "failures", None) or {}).get(exc.rank) or str(exc)
        first = summary.splitlines()[0] if summary else ""
        if first.startswith("NotImplementedError"):
            return first.split(": ", 1)[-1]
    return None


@contextmanager
def example(*names: str):
    """Run the cell's example; an exercise not implemented yet prints one line instead."""
    try:
        yield
    except (NotImplementedError, RankError) as exc:
        message = _not_implemented(exc)
        if message is None:
            raise
        which = ", ".join(names) if names else message
        print(f"not run yet: {which} is not implemented yet; run this cell again when it is")
