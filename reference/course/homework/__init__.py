"""The homework the grader knows: for each notebook in solutions/, its hidden checks.

A homework id is the notebook's file stem ("00_collectives"). Its exercise ids are
the `metadata.course.exercise` ids of the solution's answer cells, which are also
the names of the functions the grader takes from the executed notebook. Each
homework is one module of this package that defines HOMEWORK_ID and EXERCISES (and
optionally WRONG_KEEPS, the share of an exercise's points an answer failing any of its cases
keeps at most, `ExerciseSpec.wrong_keeps`); it is found by name, so adding a homework edits
no shared file.

Shared by every homework: `scoring` (run a submission's function on fresh ranks and
judge it), `guard` (the collectives an exercise must build are switched off and the
messages recorded), `refuse` (the course's own answers refuse to run from a student's
code, however they are reached) and `questions` (written
questions answered by a number, graded exactly).
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from reference.course.homework.scoring import ExerciseScore, ExerciseSpec, score_exercise
from reference.runtime import preload

preload(__name__)  # the hidden checks' ranks import every homework module: once, in the fork server

__all__ = ["HOMEWORK", "homework", "ExerciseSpec", "ExerciseScore", "score_exercise"]



def _discover() -> dict[str, tuple[ExerciseSpec, ...]]:
    """Every module of this package that names a HOMEWORK_ID contributes its EXERCISES."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        homework_id = getattr(module, "HOMEWORK_ID", None)
        if homework_id is not None:
            if homework_id in found:
                raise RuntimeError(f"two homework modules claim the id {homework_id!r}")
            keeps = getattr(module, "WRONG_KEEPS", None)
            found[homework_id] = tuple(module.EXERCISES if keeps is None else (
                dataclasses.replace(spec, wrong_keeps=keeps) for spec in module.EXERCISES))
    return found


HOMEWORK: dict[str, tuple[ExerciseSpec, ...]] = _discover()


def homework(homework_id: str) -> tuple[ExerciseSpec, ...]:
    """The exercises of `homework_id`, or a KeyError listing the known ids."""
    try:
        return HOMEWORK[homework_id]
    except KeyError:
        raise KeyError(f"unknown homework {homework_id!r}; known: {sorted(HOMEWORK)}") from None
