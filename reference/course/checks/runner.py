"""The one runner every visible check uses: launch, describe a failure, print one line.

A homework's check module supplies only what is its own: the exercise spec, its
hint table and its words for success. This module does the rest, the same way for
every homework:

* `run_cases` starts `world_size` ranks (`reference.runtime.launch`), runs the
  student's function on each rank's input of every case under the exercise's rules
  (the forbidden collectives switched off, the course's own answers refused, as in
  the grader: `reference.course.homework.refuse`), and judges the outputs against
  `spec.expect` computed here; `record_traffic=True` adds each case's point-to-point
  sends and receives to its output, for exercises that must be a ring or an
  all-to-all;
* `describe_launch_failure` turns a failed launch into one line for the student
  (not implemented, not allowed, timed out, or the last lines of a traceback);
* `report` prints PASS or FAIL with the hint whose key appears first in the
  reason's first line (a traceback below it could match any key; a call of the
  course's own answer gets `REFUSED_HINT`, whatever the exercise), and never raises:
  `run_visible` wraps a check so that a broken function, or a broken check, is a
  FAIL line and the notebook goes on.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import cloudpickle
import torch
import torch.distributed as dist

from reference.course.homework.guard import exercise_rules
from reference.course.homework.refuse import REFUSED, refusal_for
from reference.course.checks.unfinished import unfinished
from reference.course.homework.scoring import Case, ExerciseSpec, one_line
from reference.runtime import RankError, RankTimeoutError, launch

__all__ = ["VISIBLE_SEED", "NOT_IMPLEMENTED", "REFUSED", "hint_for", "describe_launch_failure", "traffic_rows",
           "run_cases", "subgroup_case", "report", "run_visible"]

VISIBLE_SEED = 2024  # public; the grader draws its cases from a seed of its own

NOT_IMPLEMENTED = "replace the `raise NotImplementedError` line with your code"
REFUSED_HINT = ("write it yourself: the course's own version, its close relatives and the "
                "checks' answers refuse to run from your function")


def hint_for(reason: str, hints: Mapping[str, str]) -> str:
    """The hint of the first key found in the reason's first line ("" when none)."""
    first = reason.splitlines()[0] if reason else ""
    return next((h for key, h in hints.items() if key in first), "")


def describe_launch_failure(err: RankError, world_size: int, timeout: float,
                            hang_hint: str = "") -> str:
    """Why a visible check's launch failed, for the student: one line, then for an
    exception the last lines of its traceback."""
    if isinstance(err, RankTimeoutError):
        return (f"on {world_size} ranks: timed out after {timeout:g} s; ranks {err.ranks} "
                f"did not finish" + (f" ({hang_hint})" if hang_hint else ""))
    summary = err.failures.get(err.rank) or str(err).splitlines()[0]
    if summary.startswith("NotImplementedError"):
        return "not implemented yet"
    if summary.startswith("NotAllowedError"):
        return one_line(summary.split(": ", 1)[-1]) + " (not allowed)"
    where = "\n".join("     | " + line for line in err.traceback.strip().splitlines()[-6:])
    return (f"on {world_size} ranks, rank {err.rank} raised {one_line(summary)}"
            + (f"\n{where}" if where else ""))


def traffic_rows(log) -> list:
    """A rank's recorded point-to-point messages as [[peer (-1: unknown), numbers], ...]."""
    return [[-1 if peer is None else int(peer), int(n)] for peer, n in log]


def _rank_outputs(spec: ExerciseSpec, fn_bytes: bytes, inputs: dict, record_traffic: bool) -> dict:
    """In each rank: the student's output for this rank's input of every case."""
    rank = dist.get_rank()
    outputs = {}
    refusal = refusal_for(spec)  # the course's own answers refuse to run, as in the grader
    with exercise_rules(spec.id, spec.forbidden) as traffic:
        fn = cloudpickle.loads(fn_bytes)  # only here, under the rules
        for name, per_rank in inputs.items():
            traffic.clear()
            out = refusal.run(spec.call, fn, per_rank[rank])
            if record_traffic:
                out["sends"], out["recvs"] = traffic_rows(traffic.sends), traffic_rows(traffic.recvs)
            outputs[name] = out
    return outputs


def run_cases(spec: ExerciseSpec, fn, world_size: int, cases: Sequence[Case], timeout: float,
              hang_hint: str = "", record_traffic: bool = False) -> tuple[str, str]:
    """("", "") when every case passes on `world_size` ranks, else (the first failure,
    the part of it that should pick the hint: the judge's reason without the case's
    name, which could match a key, or "" for an exception, whose traceback could).

    What the student's code prints shows as "[rank r] ..." lines (the launch is not quiet).
    A case marked ``alone`` (on a subgroup) runs after the others, in a launch of its own."""
    together = [c for c in cases if not c.alone]
    for batch in ([together] if together else []) + [[c] for c in cases if c.alone]:
        failure = _run_batch(spec, fn, world_size, batch, timeout, hang_hint, record_traffic)
        if failure[0]:
            return failure
    return "", ""


def _run_batch(spec, fn, world_size, cases, timeout, hang_hint, record_traffic) -> tuple[str, str]:
    """`run_cases` for ``cases`` in one launch."""
    if len(cases) == 1 and cases[0].alone:  # a hang here is this case's: say which, and why
        hang_hint = (f"{cases[0].name}: pass group=group to every collective; one without it "
                     f"waits for global rank 0, which is not in the group")
    inputs = {case.name: case.inputs for case in cases}
    try:
        ranks = launch(_rank_outputs, world_size, spec, cloudpickle.dumps(fn), inputs,
                       record_traffic, timeout=timeout)
    except RankError as err:
        text = describe_launch_failure(err, world_size, timeout, hang_hint)
        raised = not isinstance(err, RankTimeoutError) and text.startswith(f"on {world_size} ranks, rank")
        return text, "" if raised else text
    for case in cases:
        reason = spec.judge(case.inputs, spec.expect(case.inputs),
                            [r[case.name] for r in ranks], world_size)
        if reason:
            return f"on {world_size} ranks, {case.name}: {reason}", reason
    return "", ""


def public_cases(spec: ExerciseSpec, world_size: int, seed: int = VISIBLE_SEED) -> list[Case]:
    """The visible check's cases: the hidden checks' kinds, drawn from a public seed, but those
    on a subgroup (`reference.course.homework.subgroup`): `run_visible` runs one of those once,
    after the others pass (`subgroup_case`)."""
    cases = spec.make_cases(torch.Generator().manual_seed(seed + world_size), world_size)
    return [c for c in cases if not c.alone]


def subgroup_case(spec: ExerciseSpec, fn, timeout: float, seed: int = VISIBLE_SEED) -> tuple[str, str]:
    """`run_cases` of one case on a subgroup, at the smallest world size the exercise has
    them, in a launch of its own: an answer that forgets ``group=`` hangs there, and the
    failure names the case and says why (the grader runs such cases the same way)."""
    world_size = min(spec.subgroup_sizes)
    cases = spec.make_cases(torch.Generator().manual_seed(seed + world_size), world_size)
    return run_cases(spec, fn, world_size, [c for c in cases if c.alone][:1], timeout,
                     record_traffic=True)


def report(spec: ExerciseSpec, reason: str, success: str, hints: Mapping[str, str],
           hint_key: str | None = None) -> bool:
    """Print the one line (and the hint under a FAIL); True when `reason` is empty."""
    if not reason:
        print(f"PASS {spec.id}: {success}")
        return True
    hint = hint_for(reason if hint_key is None else hint_key, hints)
    if REFUSED in reason.splitlines()[0]:  # the same for every exercise
        hint = REFUSED_HINT
    print(f"FAIL {spec.id}: {reason}" + (f"\n     hint: {hint}" if hint else ""))
    return False


def run_visible(spec: ExerciseSpec, fn, attempt: Callable[[], str | tuple[str, str]],
                success: str | Callable[[], str], hints: Mapping[str, str],
                skip: bool = False, timeout: float = 30.0) -> bool | None:
    """The frame of every visible check: skip while grading, refuse what is not a
    function, say "not implemented yet" while its stub is there, run `attempt()` (the reason, or (reason, the text that picks the hint)),
    then, for an exercise that takes ``group=``, one case on a subgroup (`subgroup_case`,
    ``timeout`` seconds at most), and print the line. True/False, None when skipped; never raises."""
    if skip:
        print(f"skipped {spec.id}: the grader runs its own hidden checks")
        return None
    key = None
    try:
        if not callable(fn):
            reason = f"expected a function, got {type(fn).__name__}"
        elif unfinished(fn, spec.id):  # its stub is still there: no ranks needed to tell
            reason = "not implemented yet"
        else:
            reason = attempt()
            if isinstance(reason, tuple):
                reason, key = reason
            if not reason and spec.subgroup_sizes:
                reason, key = subgroup_case(spec, fn, timeout)
                key = key or None
    except Exception as exc:  # noqa: BLE001 - a check must never stop the notebook
        reason = f"the check could not run your function: {one_line(f'{type(exc).__name__}: {exc}')}"
        key = None
    text = success() if callable(success) else success
    if spec.subgroup_sizes:
        text += f", and one case on the subgroup of ranks 1 .. {min(spec.subgroup_sizes) - 1}"
    return report(spec, reason, text, hints, key)
