"""The visible check of a numeric question: the text's worked values, then the kind of number.

    check_question(SPEC, ring_bytes_sent, {"n_elements": 10, "world_size": 4, ...},
                   worked=(Worked({"n_elements": 12, "world_size": 3, ...}, 64),))

It calls the student's function (in this process: a formula needs no ranks) on each worked
example the question's text publishes and says FAIL when the answer differs from the
published value (exactly for an `int`; for a real, within the float64 bound the grader uses,
or to the digits the text prints, `Worked.places`); then on the notebook's concrete case,
where it asks only for a number of the right kind (an `int` for a count, any finite real
for a ratio). The hidden checks grade other values of the same quantities.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from reference.course.checks.runner import NOT_IMPLEMENTED, run_visible
from reference.course.homework.questions import judge_number
from reference.course.homework.refuse import refusal_for
from reference.course.homework.scoring import ExerciseSpec

__all__ = ["check_question", "Worked"]


class Worked(NamedTuple):
    """A worked example the question's text publishes: the quantities and the answer,
    `places` decimals when the text rounds it (None: the exact answer)."""
    inputs: dict
    value: int | float
    places: int | None = None


_HINTS = {
    "not implemented": NOT_IMPLEMENTED,
    "the text's worked example": ("recompute the text's worked example by hand, term by term: "
                                  "which quantity does your formula count twice, or miss?"),
    "whole number": "a count of bytes or elements is an int: use // and -(-a // b) for a ceiling",
    "not a number": "return the number itself (an int or a float), not a string or a tensor",
    "raised": "the function must work for every value of the question's quantities",
}


def _call(spec: ExerciseSpec, fn, inputs: dict) -> tuple[object, str]:
    """(value, type name) of fn(**inputs), watched like the grader's call."""
    out = refusal_for(spec).run(spec.call, fn, dict(inputs))
    return out["value"], out["type"]


def _kind_error(value, kind_got: str, kind: str) -> str:
    if value is None:
        return f"returned a {kind_got}, not a number"
    if kind == "int" and kind_got != "int":
        return f"returned {value!r}; the answer is a whole number (an int)"
    if not math.isfinite(float(value)):
        return f"returned {value!r}; the answer is a finite number"
    return ""


def _worked_error(example: Worked, value, kind: str) -> str:
    if example.places is not None:
        right = round(float(value), example.places) == round(float(example.value), example.places)
    else:
        right = judge_number(value, example.value, kind) == ""
    if right:
        return ""
    args = ", ".join(f"{k}={v!r}" for k, v in example.inputs.items())
    return (f"gives {value!r} on the text's worked example ({args}); the text says "
            f"{example.value!r}" + (f" (to {example.places} decimals)" if example.places else ""))


def check_question(spec: ExerciseSpec, fn, example: dict, kind: str = "int",
                   skip: bool = False, worked: tuple[Worked, ...] = ()) -> bool | None:
    """PASS when fn gives every `worked` value and fn(**example) is a number of the kind
    `kind` ("int" or "real")."""
    def attempt() -> str:
        try:
            for item in worked:
                value, kind_got = _call(spec, fn, item.inputs)
                if error := _kind_error(value, kind_got, kind) or _worked_error(item, value, kind):
                    return error
            value, kind_got = _call(spec, fn, example)
        except NotImplementedError:
            return "not implemented yet"
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            return f"raised {type(exc).__name__}: {exc}"
        return _kind_error(value, kind_got, kind)

    def success() -> str:
        said = (f"gives the text's worked value{'s' if len(worked) > 1 else ''} and "
                if worked else "")
        return (f"{said}returns a number of the right kind for the concrete case (the hidden "
                f"checks grade other values)")

    return run_visible(spec, fn, attempt, success, _HINTS, skip)
