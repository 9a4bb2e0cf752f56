"""The visible check of a numeric question: is the answer a number of the right kind?

    check_question(SPEC, ring_bytes_sent, {"n_elements": 10, "world_size": 4, ...})

It calls the student's function on the notebook's own example (in this process: a
formula needs no ranks), and prints PASS when it returns a number of the kind the
question asks for (an `int` for a count, any finite real for a ratio). It never says
whether the number is right: that is what the hidden checks grade, on other values.
"""
from __future__ import annotations

import math

from reference.course.checks.runner import NOT_IMPLEMENTED, run_visible
from reference.course.homework.refuse import refusal_for
from reference.course.homework.scoring import ExerciseSpec

__all__ = ["check_question"]

_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "whole number": "a count of bytes or elements is an int: use // and -(-a // b) for a ceiling",
    "not a number": "return the number itself (an int or a float), not a string or a tensor",
    "raised": "the function must work for every value of the question's quantities",
}


def check_question(spec: ExerciseSpec, fn, example: dict, kind: str = "int",
                   skip: bool = False) -> bool | None:
    """PASS when fn(**example) returns a number of the kind `kind` ("int" or "real")."""
    def attempt() -> str:
        try:  # the question's own call wrapper, watched like the grader's
            out = refusal_for(spec).run(spec.call, fn, dict(example))
        except NotImplementedError:
            return "not implemented yet"
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            return f"raised {type(exc).__name__}: {exc}"
        value, kind_got = out["value"], out["type"]
        if value is None:
            return f"returned a {kind_got}, not a number"
        if kind == "int" and kind_got != "int":
            return f"returned {value!r}; the answer is a whole number (an int)"
        if not math.isfinite(float(value)):
            return f"returned {value!r}; the answer is a finite number"
        return ""

    return run_visible(spec, fn, attempt,
                       lambda: f"returns a number of the right kind for the example "
                               f"(whether it is right, the hidden checks grade)", _HINTS, skip)
