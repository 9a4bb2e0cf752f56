"""Written questions whose answer is a number: asked in prose, answered by a function.

A homework asks, say, "how many bytes does each rank send in a ring all-reduce of
the 124M model's fp32 gradients on 8 ranks?". The student answers with a function
of the question's quantities,

    def ring_bytes_sent(n_elements, world_size, bytes_per_element):
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

and prints its value for the numbers in the text. The hidden checks call it with
other values of the same quantities (drawn from the grader's seed), so a number
copied from someone else's notebook earns nothing, and compare each answer with
the course's formula:

* an integer answer (bytes, counts) must be that integer exactly, and an `int`
  (a float such as 3.0 is refused: the question asks for a count);
* a real answer (a fraction, a ratio) must agree relative to the formula within
  `QUESTION_RTOL`, the rtol of the course's float64 bound
  (`reference.tolerance.forward(torch.float64)`, reasoned in reference/tolerance.py):
  the same formula written in another order rounds differently in the last bits of
  a float64, and nothing coarser than that is forgiven.

`question(...)` turns the formula and the parameter ranges into an `ExerciseSpec`
that the grader scores like any exercise (one rank per case, nothing communicated);
`reference.course.checks.questions.check_question` is the visible check: it runs
the function on the worked examples the text publishes (their values must come out)
and on the notebook's concrete case (a number of the right kind).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import torch

from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import forward

__all__ = ["question", "QUESTION_RTOL", "judge_number"]

QUESTION_RTOL = forward(torch.float64).rtol  # a float64 formula's last bits


def _draw(generator: torch.Generator, choices) -> object:
    return choices[int(torch.randint(len(choices), (1,), generator=generator))]


def judge_number(got, want, kind: str) -> str:
    """"" when `got` answers `want` (kind "int" exactly, "real" to QUESTION_RTOL), else why not."""
    if kind == "int":
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            return f"returned {type(got).__name__} {got!r}; the answer is a whole number (an int)"
        return "" if int(got) == int(want) else "wrong number"
    if isinstance(got, bool) or not isinstance(got, numbers.Real) or not math.isfinite(float(got)):
        return f"returned {type(got).__name__} {got!r}; the answer is a finite number"
    return "" if math.isclose(float(got), float(want), rel_tol=QUESTION_RTOL, abs_tol=0.0) or \
        float(got) == float(want) else "wrong number"


def question(id: str, title: str, formula: Callable[..., object], parameters: Mapping[str, tuple],
             kind: str = "int", n_cases: int = 6, difficulty: str = "★☆☆ easy",
             fixed: tuple[dict, ...] = (), banned: tuple = ()) -> ExerciseSpec:
    """An ExerciseSpec for a numeric question answered by `fn(**parameters)`.

    formula(**values) -> the right answer (runs in the grader only).
    parameters: name -> the values the hidden checks draw from (each case draws one per name).
    fixed: cases always included (edge cases: one rank, sizes that do not divide).
    kind: "int" (exact) or "real" (relative QUESTION_RTOL)."""
    if kind not in ("int", "real"):
        raise ValueError(f"kind must be 'int' or 'real', got {kind!r}")
    names = tuple(parameters)

    def make_cases(generator: torch.Generator, world_size: int) -> list[Case]:
        drawn = [dict(case) for case in fixed]
        while len(drawn) < n_cases + len(fixed):
            drawn.append({name: _draw(generator, parameters[name]) for name in names})
        return [Case(", ".join(f"{k}={v}" for k, v in case.items()), [case]) for case in drawn]

    def call(fn, case: dict) -> dict:
        value = fn(**case)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return {"value": None, "type": type(value).__name__}
        return {"value": int(value) if isinstance(value, numbers.Integral) else float(value),
                "type": "int" if isinstance(value, numbers.Integral) else type(value).__name__}

    def expect(inputs: list) -> list:
        return [formula(**inputs[0])]

    def judge(inputs, expected, outputs, world_size) -> str:
        out = outputs[0]
        if out.get("value") is None:
            return f"returned a {out.get('type')}, not a number"
        got = out["value"] if out["type"] == "int" else float(out["value"])
        if kind == "int" and out["type"] != "int":
            return f"returned {out['type']} {got!r}; the answer is a whole number (an int)"
        return judge_number(got, expected[0], kind)

    return ExerciseSpec(id=id, title=title, difficulty=difficulty, world_sizes=(1,),
                        make_cases=make_cases, call=call, expect=expect, judge=judge,
                        reference=formula, banned=tuple(banned))
