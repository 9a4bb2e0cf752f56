"""The homework the grader knows: for each notebook in solutions/, its hidden checks.

A homework id is the notebook's file stem ("00_collectives"). Its exercise ids are
the `metadata.course.exercise` ids of the solution's answer cells, which are also
the names of the functions the grader takes from the executed notebook.
"""
from __future__ import annotations

from . import collectives
from .scoring import ExerciseScore, ExerciseSpec, score_exercise

__all__ = ["HOMEWORK", "homework", "ExerciseSpec", "ExerciseScore", "score_exercise"]

HOMEWORK: dict[str, tuple[ExerciseSpec, ...]] = {
    "00_collectives": collectives.EXERCISES,
}


def homework(homework_id: str) -> tuple[ExerciseSpec, ...]:
    """The exercises of `homework_id`, or a KeyError listing the known ids."""
    try:
        return HOMEWORK[homework_id]
    except KeyError:
        raise KeyError(f"unknown homework {homework_id!r}; known: {sorted(HOMEWORK)}") from None
